"""``python -m mempool run``: a script runs as ``python script.py`` runs it (argv, path,
``__main__``, exit status, tracebacks), on the default pool, configured from ``--conf``,
``MEMPOOL_CONF`` or PyTorch's variables. Each run is a child process; without a GPU (or with
a ``sim`` pool) nothing is hooked and the line on stderr says why."""
import importlib.util
import os
import re

import pytest

from mempool import _conf_parse
from mempool import _config as cfg
from mempool import run as mrun
from _support import CONF_VARS, child

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = '''\
"""the script's docstring"""
import os, pickle, sys

class Thing:
    pass

def fail():
    raise ValueError("boom " + sys.argv[2])

def at_exit():
    # __main__ is still the script at exit: its classes pickle by reference
    print("at exit", type(pickle.loads(pickle.dumps(Thing()))).__name__, flush=True)

import atexit
atexit.register(at_exit)
print("argv", sys.argv)
print("path0", sys.path[0])
print("file", __file__, __name__, __doc__, __spec__ and __spec__.name, __package__)
print("main", sys.modules["__main__"].__dict__ is globals())
action = sys.argv[1] if len(sys.argv) > 1 else ""
if action == "raise":
    fail()
if action == "exit":
    sys.exit(int(sys.argv[2]))
if action == "exitmsg":
    sys.exit("leaving: " + sys.argv[2])
if action == "interrupt":
    raise KeyboardInterrupt
if action == "pool":
    import mempool
    pool = mempool.default_pool()
    print("pool", pool.backend, os.environ.get("MEMPOOL_CONF"))
    print("options", {k: pool.options[k] for k in sys.argv[2:]})
    print("env", [os.environ.get(v) for v in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")])
'''


def ours(stderr):
    """mempool run's own lines of stderr."""
    return [line for line in stderr.splitlines() if line.startswith("mempool run: ")]


def theirs(stderr):
    """stderr without mempool run's lines: what the script itself printed."""
    return "".join(line for line in stderr.splitlines(keepends=True)
                   if not line.startswith("mempool run: "))


@pytest.fixture
def script(tmp_path):
    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "train.py"
    path.write_text(SCRIPT)
    return path


# Leaving PyTorch and CuPy alone keeps the comparisons with python fast and free of their
# import-time output where they are installed; the first test and the GPU tier hook them.
NO_HOOKS = ["--no-torch", "--no-cupy"]


def same_as_python(script, tmp_path, *args, env=None, hooks=False):
    """Run `script` both ways; assert stdout, the script's stderr and the status match."""
    flags = [] if hooks else NO_HOOKS
    ran = child([*flags, os.path.relpath(script, tmp_path), *args], tmp_path, env)
    plain = child([os.path.relpath(script, tmp_path), *args], tmp_path, env, python=())
    assert ran.stdout == plain.stdout
    assert theirs(ran.stderr) == plain.stderr
    assert ran.returncode == plain.returncode
    return ran


def test_a_script_runs_as_python_runs_it(script, tmp_path):
    ran = same_as_python(script, tmp_path, "plain", "--lr", "3e-4", "-m", "x", hooks=True)
    assert ran.returncode == 0, ran.stderr
    assert "argv ['sub/train.py', 'plain', '--lr', '3e-4', '-m', 'x']" in ran.stdout
    assert f"path0 {tmp_path / 'sub'}" in ran.stdout
    assert f"file {script} __main__ the script's docstring None None" in ran.stdout
    assert "main True" in ran.stdout
    assert ran.stdout.endswith("at exit Thing\n")
    line, = ours(ran.stderr)
    assert line.startswith("mempool run: pool on ")
    assert re.search(r"torch: (hooked on device [\d, ]+|not hooked \(.+\))", line)
    assert re.search(r"cupy: (hooked on device [\d, ]+|not hooked \(.+\))", line)


@pytest.mark.skipif(any(importlib.util.find_spec(m) for m in ("torch", "cupy")),
                    reason="PyTorch or CuPy is installed here")
def test_without_torch_or_cupy_it_runs_on_the_default_pool_and_says_so(script, tmp_path):
    ran = child([str(script), "pool"], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert "pool sim None" in ran.stdout
    line, = ours(ran.stderr)
    assert line == ("mempool run: pool on sim device 0 (default settings); torch: not hooked "
                    "(PyTorch is not installed); cupy: not hooked (CuPy is not installed)")


def test_a_pool_off_the_gpu_hooks_nothing(script, tmp_path):
    ran = child([str(script)], tmp_path, {"MEMPOOL_CONF": "backend:sim"})
    assert ran.returncode == 0, ran.stderr
    line, = ours(ran.stderr)
    assert line.startswith("mempool run: pool on sim device 0 (settings from MEMPOOL_CONF: "
                           "backend:sim); torch: not hooked (")
    assert "hooked on" not in line


def test_no_torch_and_no_cupy_are_said(script, tmp_path):
    ran = child(["--no-torch", "--no-cupy", "--conf", "backend:sim", str(script)], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ours(ran.stderr)[0].endswith("torch: not hooked (--no-torch); "
                                        "cupy: not hooked (--no-cupy)")


@pytest.mark.parametrize("args", [["exit", "0"], ["exit", "3"], ["exit", "255"],
                                  ["exitmsg", "now"], ["raise", "here"], ["interrupt"]])
def test_exit_status_and_traceback_are_pythons(script, tmp_path, args):
    ran = same_as_python(script, tmp_path, *args)
    if args[0] == "raise":
        assert ran.returncode == 1
        assert theirs(ran.stderr).startswith("Traceback (most recent call last):\n"
                                             f'  File "{script}", line ')
        assert "mempool" not in theirs(ran.stderr)     # no frame of the runner
        assert theirs(ran.stderr).endswith("ValueError: boom here\n")
    elif args[0] == "interrupt":
        assert ran.returncode == -2                   # killed by SIGINT, as Python does
        assert theirs(ran.stderr).endswith("KeyboardInterrupt\n")
    elif args[0] == "exitmsg":
        assert ran.returncode == 1 and theirs(ran.stderr) == "leaving: now\n"
    else:
        assert ran.returncode == int(args[1])


def test_a_syntax_error_is_printed_as_python_prints_it(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\nif x\n    pass\n")
    ran = same_as_python(bad, tmp_path)
    assert ran.returncode == 1
    assert "SyntaxError" in theirs(ran.stderr) and "Traceback" not in theirs(ran.stderr)


def test_a_module_runs_as_python_dash_m_runs_it(tmp_path):
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "loop.py").write_text(SCRIPT)
    (pkg / "__main__.py").write_text("import sys\nprint('package main', __name__, "
                                     "__spec__.name, __package__, sys.argv)\n")
    for name, args in (("trainer.loop", ["plain", "x"]), ("trainer", ["a"])):
        ran = child([*NO_HOOKS, "-m", name, *args], tmp_path)
        plain = child(["-m", name, *args], tmp_path, python=())
        assert ran.returncode == plain.returncode == 0, ran.stderr
        assert ran.stdout == plain.stdout
        assert theirs(ran.stderr) == plain.stderr
    loop = child(["-m", "trainer.loop", "plain"], tmp_path)
    assert f"argv ['{pkg / 'loop.py'}', 'plain']" in loop.stdout
    assert f"path0 {tmp_path}" in loop.stdout
    pkg_main = child(["-mtrainer", "a"], tmp_path)
    assert f"package main __main__ trainer.__main__ trainer ['{pkg / '__main__.py'}', 'a']" in (
        pkg_main.stdout)


def test_a_module_that_raises_prints_pythons_traceback(tmp_path):
    (tmp_path / "failing.py").write_text(SCRIPT)
    ran = child([*NO_HOOKS, "-m", "failing", "raise", "m"], tmp_path)
    plain = child(["-m", "failing", "raise", "m"], tmp_path, python=())
    assert ran.returncode == plain.returncode == 1
    assert theirs(ran.stderr) == plain.stderr


@pytest.mark.parametrize("args,status,fragment", [
    (["missing.py"], 2, "can't open file"),
    (["-m", "no_such_module_here"], 1, "No module named no_such_module_here"),
    ([], 2, "no script given"),
    (["--conf"], 2, "--conf needs a value"),
    (["--bogus", "x.py"], 2, "unknown option '--bogus'"),
    (["-m"], 2, "-m needs a module name"),
])
def test_what_cannot_run_is_refused_clearly(tmp_path, args, status, fragment):
    ran = child(args, tmp_path)
    assert ran.returncode == status
    assert fragment in ran.stderr
    assert ran.stdout == ""
    if status == 2:
        assert len(ran.stderr.strip().splitlines()) == 1, ran.stderr     # one line


def test_help(tmp_path):
    ran = child(["--help"], tmp_path)
    assert ran.returncode == 0 and ran.stdout.startswith("usage: python -m mempool run")
    listed = child([], tmp_path, python=("-m", "mempool"))    # no command: help, status 2
    assert listed.returncode == 2 and re.search(r"^  run +run a script", listed.stderr, re.M)


# --------------------------------------------------------------------------- settings


def test_settings_come_from_pytorchs_variable_when_that_is_all_there_is(script, tmp_path):
    pytorch = ("backend:native,initial_pool_size_mb:64,max_split_size_mb:128,"
               "garbage_collection_threshold:0.6,pinned_use_cuda_host_register:True")
    ran = child(["--no-torch", "--no-cupy", str(script), "pool", "initial_pool_size",
                 "max_split_size", "garbage_collection_threshold"], tmp_path,
                {"PYTORCH_CUDA_ALLOC_CONF": pytorch})
    assert ran.returncode == 0, ran.stderr
    assert ("options {'initial_pool_size': 67108864, 'max_split_size': 134217728, "
            "'garbage_collection_threshold': 0.6}") in ran.stdout
    # written to MEMPOOL_CONF in one spelling, so default_pool and child processes agree
    assert re.search(r"pool \w+ initial_pool_size:64MiB,max_split_size:128MiB,"
                     r"garbage_collection_threshold:0\.6\n", ran.stdout)
    assert f"env [None, '{pytorch}']" in ran.stdout     # PyTorch not hooked: left alone
    warned = [line for line in ours(ran.stderr) if "warning:" in line]
    assert len(warned) == 2
    assert "'backend:native'" in warned[0] and "'pinned_use_cuda_host_register'" in warned[1]
    assert "settings from PYTORCH_CUDA_ALLOC_CONF: initial_pool_size:64MiB," in ran.stderr


def test_pytorch_alloc_conf_comes_before_the_cuda_one_as_in_pytorch(script, tmp_path):
    ran = child(["--no-torch", "--no-cupy", str(script), "pool", "max_split_size"], tmp_path,
                {"PYTORCH_ALLOC_CONF": "max_split_size_mb:64",
                 "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"})
    assert "options {'max_split_size': 67108864}" in ran.stdout, ran.stderr


def test_mempool_conf_comes_before_pytorchs_and_conf_before_both(script, tmp_path):
    env = {"MEMPOOL_CONF": "backend:sim,max_split_size:32MiB",
           "PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:256"}
    ran = child([str(script), "pool", "max_split_size"], tmp_path, env)
    assert "options {'max_split_size': 33554432}" in ran.stdout, ran.stderr
    assert "pool sim backend:sim,max_split_size:32MiB\n" in ran.stdout
    ran = child(["--conf", "backend:sim,max_split_size_mb:48", str(script), "pool",
                 "max_split_size"], tmp_path, env)
    assert "options {'max_split_size': 50331648}" in ran.stdout, ran.stderr
    assert "pool sim backend:sim,max_split_size:48MiB\n" in ran.stdout


def test_a_bad_setting_stops_before_the_script_runs(script, tmp_path):
    ran = child([str(script), "plain"], tmp_path,
                {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,limit:lots"})
    assert ran.returncode == 2
    assert ran.stdout == ""
    line, = ours(ran.stderr)
    assert "environment variable PYTORCH_CUDA_ALLOC_CONF" in line and "'limit'" in line
    ran = child([str(script)], tmp_path, {"LOCAL_RANK": "first"})
    assert ran.returncode == 2 and "LOCAL_RANK: 'first'" in ran.stderr


def test_a_warning_turned_into_an_error_stops_the_run(script, tmp_path):
    ran = child([str(script)], tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": "pinned_num_register_threads:4",
                                         "PYTHONWARNINGS": "error::UserWarning"})
    assert ran.returncode == 2 and ran.stdout == ""
    assert "mempool run: error:" in ran.stderr and "'pinned_num_register_threads'" in ran.stderr


def test_report_prints_each_pool_at_exit(script, tmp_path):
    ran = child(["--report", "--conf", "backend:sim,initial_pool_size:4MiB", str(script)],
                tmp_path)
    assert ran.returncode == 0, ran.stderr
    report = ran.stderr.split("mempool run: device 0 pool at exit\n", 1)[1]
    # A sim pool's summary names the simulated device, and no GPU.
    assert "mempool memory summary, sim device 0" in report
    assert re.search(r"Reserved memory\s+\|\s+4096 KiB", report)


def test_import_mempool_auto_installs_for_python_c(tmp_path):
    code = ("import mempool.auto, mempool\n"
            "i = mempool.auto.installed\n"
            "print(i.source, i.conf, sorted(i.pools), i.pools[0] is mempool.default_pool(0))\n"
            "print(mempool.run.install_default() is i)\n")
    ran = child(["-c", code], tmp_path, {"MEMPOOL_CONF": "backend:sim,limit_mb:512"},
                python=())
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "MEMPOOL_CONF backend:sim,limit:512MiB [0] True\nTrue\n"
    assert ran.stderr.startswith("mempool: pool on sim device 0 (settings from MEMPOOL_CONF")


# --------------------------------------------------------------------------- in process


@pytest.fixture
def env(monkeypatch):
    for var in CONF_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(_conf_parse, "_warned", set())
    return monkeypatch


def test_pytorchs_variables_keep_what_pytorch_applies_under_the_pool(env):
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync,expandable_segments:true,"
                                          "pinned_use_cuda_host_register:True")
    env.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64,initial_pool_size_mb:64")
    with pytest.warns(cfg.ConfigWarning, match="PYTORCH_CUDA_ALLOC_CONF: backend, "
                                               "expandable_segments configure"):
        mrun._prepare_pytorch_env("PYTORCH_ALLOC_CONF")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "pinned_use_cuda_host_register:True"
    assert "PYTORCH_ALLOC_CONF" not in os.environ


def test_pytorch_settings_nothing_applies_are_warned_about(env):
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,pinned_num_register_threads:4")
    with pytest.warns(cfg.ConfigWarning, match=r"PYTORCH_CUDA_ALLOC_CONF: expandable_segments "
                                               r"configure PyTorch's CUDA allocator.*MEMPOOL_CONF"):
        mrun._prepare_pytorch_env("MEMPOOL_CONF")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "pinned_num_register_threads:4"


def test_conf_source_order(env):
    assert mrun._conf_source(None) == ("defaults", "")
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "a")
    assert mrun._conf_source(None) == ("PYTORCH_CUDA_ALLOC_CONF", "a")
    env.setenv("PYTORCH_ALLOC_CONF", "b")
    assert mrun._conf_source(None) == ("PYTORCH_ALLOC_CONF", "b")
    env.setenv("MEMPOOL_CONF", " ")               # empty counts as unset
    assert mrun._conf_source(None) == ("PYTORCH_ALLOC_CONF", "b")
    env.setenv("MEMPOOL_CONF", "c")
    assert mrun._conf_source(None) == ("MEMPOOL_CONF", "c")
    assert mrun._conf_source("") == ("--conf", "")
    with pytest.raises(TypeError, match="conf: a conf string is a str"):
        mrun._conf_source(b"limit:1")


def test_install_default_checks_its_flags():
    with pytest.raises(TypeError, match="torch must be True or False"):
        mrun.install_default(torch="yes")


def test_cupy_router_serves_each_device_from_its_own_pool(monkeypatch):
    import mempool

    class FakePool:
        def __init__(self, device):
            self.device = device

        def malloc(self, nbytes):
            return (self.device, nbytes)

    made = []
    monkeypatch.setattr(mempool, "default_pool", lambda d: made.append(d) or FakePool(d))

    class Runtime:
        device = 0

        def getDevice(self):
            return self.device

    rt = Runtime()
    router = mrun._CupyRouter(rt)
    assert router(512) == (0, 512)
    rt.device = 1
    assert router(1024) == (1, 1024)
    rt.device = 0
    assert router(256) == (0, 256)
    assert made == [0, 1]                         # each device's pool made once


def test_describe_names_source_settings_and_reasons():
    class P:
        backend = "cuda"
    line = mrun.Installed("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True", {0: P(), 1: P()},
                          {"torch": [0, 1]}, {"cupy": "CuPy is not installed"}).describe()
    assert line == ("pool on cuda device 0, 1 (settings from PYTORCH_CUDA_ALLOC_CONF: "
                    "expandable_segments:True); torch: hooked on device 0, 1; cupy: not hooked "
                    "(CuPy is not installed)")
    assert "\n" not in line
