"""``python -m mempool run`` and ``import mempool.auto`` reach multiprocessing's "spawn" and
"forkserver" children: each installs the parent's default pools, with the parent's settings
and hooks, before anything the parent sent it is unpickled (mempool/_children.py). The
forkserver process itself makes no pool. ``MEMPOOL_CHILDREN=0`` leaves children alone.

Without a GPU the pools are ``sim`` ones and nothing is hooked; what is checked is that
mempool.run's install ran in the child, when, and with what."""
import json
import os

import pytest

from mempool import _children
from _support import child

# The child's argument records, when it is unpickled (before the target runs, as a CUDA
# tensor is rebuilt), whether mempool.run's install had run in that process.
SCRIPT = '''\
import json, multiprocessing, os, sys
AUTO
from server_probe import state


class Probe:
    seen = None

    def __getstate__(self):
        return {}

    def __setstate__(self, st):
        self.seen = state()


def target(probe, queue):
    import mempool.run
    import server_probe
    installed = mempool.run._installed
    queue.put({
        "at_unpickle": probe.seen,
        "installed": installed is not None,
        "source": installed and installed.source,
        "conf": installed and installed.conf,
        "skipped": installed and installed.skipped,
        "limit": installed and installed.pools[0].options["limit"],
        "server": server_probe.SERVER,
        "pid": os.getpid(), "parent": os.getppid(),
    })


if __name__ == "__main__":
    if os.environ.get("BREAK_CONF"):
        os.environ["MEMPOOL_CONF"] = os.environ["BREAK_CONF"]     # children read it
    ctx = multiprocessing.get_context(sys.argv[1])
    if sys.argv[2:]:
        ctx.set_forkserver_preload(sys.argv[2:])     # the user's list: mempool's is added
    queue = ctx.Queue()
    process = ctx.Process(target=target, args=(Probe(), queue))
    process.start()
    report = queue.get(timeout=120)
    process.join()
    report["exitcode"] = process.exitcode
    print(json.dumps(report))
'''

# Preloaded by the forkserver process (the script names it): a hook records that process's
# state just before each fork, which the forked child inherits. PROBE_AUTO: it imports
# mempool.auto, as a user's preloaded module (or the script, where the server preloads
# __main__) may.
PROBE = '''\
import os, sys
if os.environ.get("PROBE_AUTO"):
    import mempool.auto

SERVER = {}


def state():
    run = sys.modules.get("mempool.run")
    pools = sys.modules.get("mempool")
    return {"installed": run is not None and run._installed is not None,
            "pools": sorted(pools._default_pools) if pools is not None else []}


def _before_fork():
    SERVER.update(state(), pid=os.getpid())


os.register_at_fork(before=_before_fork)
'''

METHODS = ["spawn", "forkserver"]
# forkserver with its default preload list, and with a user's list (the probe): mempool's
# module is added to either.
STARTS = [["spawn"], ["forkserver"], ["forkserver", "server_probe"]]


def write_script(tmp_path, auto=False):
    (tmp_path / "server_probe.py").write_text(PROBE)
    path = tmp_path / "parent.py"
    path.write_text(SCRIPT.replace("AUTO", "import mempool.auto" if auto else ""))
    return path


@pytest.fixture
def script(tmp_path):
    return write_script(tmp_path)


def start(script, tmp_path, how, env=None, flags=(), python=("-m", "mempool", "run")):
    """Run the script with children on (MEMPOOL_CHILDREN=1 unless `env` says otherwise);
    its child's report and the parent's stderr."""
    env = {"MEMPOOL_CHILDREN": "1", **(env or {})}
    ran = child([*flags, str(script), *how], tmp_path, env, python=python)
    assert ran.returncode == 0, ran.stderr
    report = json.loads(ran.stdout.splitlines()[-1])
    assert report["exitcode"] == 0
    return report, ran.stderr


def children_lines(stderr):
    return [line for line in stderr.splitlines() if " child process " in line]


@pytest.mark.parametrize("how", STARTS, ids="-".join)
def test_a_child_installs_the_parents_pools_before_it_unpickles(script, tmp_path, how):
    report, stderr = start(script, tmp_path, how,
                           env={"MEMPOOL_CONF": "backend:sim,limit_mb:512"})
    # Installed before the argument was rebuilt, so before the target too.
    assert report["at_unpickle"] == {"installed": True, "pools": [0]}
    assert report["installed"]
    assert report["source"] == "MEMPOOL_CONF"
    assert report["conf"] == "backend:sim,limit:512MiB"
    assert report["limit"] == 512 << 20
    assert children_lines(stderr) == []        # quiet unless asked
    if "server_probe" in how:
        # The forkserver process (the child's parent) had neither installed nor made a pool.
        assert report["server"] == {"installed": False, "pools": [], "pid": report["parent"]}


@pytest.mark.parametrize("method", METHODS)
def test_the_parents_settings_and_hooks_travel(script, tmp_path, method):
    report, _ = start(script, tmp_path, [method],
                      flags=["--no-torch", "--conf", "backend:sim,limit_mb:256"])
    assert report["at_unpickle"]["installed"]
    # --conf reached the child through MEMPOOL_CONF, where install_default wrote it.
    assert report["source"] == "MEMPOOL_CONF"
    assert report["conf"] == "backend:sim,limit:256MiB"
    assert report["skipped"]["torch"] == "--no-torch"
    assert report["skipped"]["cupy"] != "--no-cupy"


@pytest.mark.parametrize("how", STARTS, ids="-".join)
def test_children_are_left_alone_unless_mempool_children_is_1(script, tmp_path, how):
    on, _ = start(script, tmp_path, how)
    assert on["at_unpickle"] == {"installed": True, "pools": [0]} and on["installed"]
    for off_env in ({"MEMPOOL_CHILDREN": "0"}, {"MEMPOOL_CHILDREN": ""}):
        off, stderr = start(script, tmp_path, how, env=off_env)
        assert off["at_unpickle"] == {"installed": False, "pools": []} and not off["installed"]
        assert stderr.startswith("mempool run: pool on ")      # the parent still installs


def test_verbose_children_say_what_they_installed_and_fork_adds_nothing(script, tmp_path):
    for method in METHODS:
        report, stderr = start(script, tmp_path, [method],
                               env={"MEMPOOL_CHILDREN": "verbose"})
        line, = children_lines(stderr)
        assert line.startswith(f"mempool: {method} child process {report['pid']}: pool on sim ")
    # A forked child has the parent's install already (its arguments are not pickled), and
    # no hook of mempool's runs in it.
    report, stderr = start(script, tmp_path, ["fork"], env={"MEMPOOL_CHILDREN": "verbose"})
    assert report["at_unpickle"] is None and report["installed"]
    assert children_lines(stderr) == []


@pytest.mark.parametrize("method", METHODS)
def test_a_child_whose_install_fails_says_so_and_runs_its_target(script, tmp_path, method):
    report, stderr = start(script, tmp_path, [method], env={"BREAK_CONF": "no_such_key:1"})
    assert not report["installed"] and report["at_unpickle"]["installed"] is False
    line, = children_lines(stderr)
    assert line.startswith(f"mempool: {method} child process {report['pid']}: could not "
                           "install the pool, so this child keeps the frameworks' own "
                           "allocators: ")
    assert "no_such_key" in line


NESTED = '''\
import multiprocessing, os, sys


def installed(queue):
    import mempool.run
    queue.put((os.getpid(), mempool.run._installed is not None))


def middle(queue):
    installed(queue)
    grandchild = multiprocessing.get_context(sys.argv[2]).Process(target=installed,
                                                                  args=(queue,))
    grandchild.start()
    grandchild.join()


if __name__ == "__main__":
    ctx = multiprocessing.get_context(sys.argv[1])
    queue = ctx.Queue()
    process = ctx.Process(target=middle, args=(queue,))
    process.start()
    print([queue.get(timeout=120)[1] for _ in range(2)])
    process.join()
'''


@pytest.mark.parametrize("first, second", [("spawn", "forkserver"), ("forkserver", "spawn")])
def test_a_childs_own_children_install_too(tmp_path, first, second):
    path = tmp_path / "nested.py"
    path.write_text(NESTED)
    ran = child([str(path), first, second], tmp_path, {"MEMPOOL_CHILDREN": "1"})
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == "[True, True]\n"


def test_a_bad_mempool_children_stops_before_the_script_runs(script, tmp_path):
    ran = child([str(script), "spawn"], tmp_path, {"MEMPOOL_CHILDREN": "sometimes"})
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr == ("mempool run: error: environment variable MEMPOOL_CHILDREN: "
                          "'sometimes' is not a setting; accepted: 0 (child processes keep "
                          "PyTorch's allocator; the default), 1 (spawn and forkserver children "
                          "install the same pools), verbose (and each says so on stderr)\n")


@pytest.mark.parametrize("how", STARTS, ids="-".join)
def test_mempool_auto_reaches_children_and_the_forkserver_makes_no_pool(tmp_path, how):
    """``import mempool.auto`` at the top of a plain ``python`` script. Where the forkserver
    preloads a module that imports it too, that process makes no pool; only the parent
    prints its line."""
    report, stderr = start(write_script(tmp_path, auto=True), tmp_path, how, python=(),
                           env={"MEMPOOL_CONF": "backend:sim,limit_mb:128", "PROBE_AUTO": "1"})
    assert report["at_unpickle"] == {"installed": True, "pools": [0]}
    assert report["conf"] == "backend:sim,limit:128MiB"
    if "server_probe" in how:
        assert report["server"] == {"installed": False, "pools": [], "pid": report["parent"]}
    line, = [line for line in stderr.splitlines() if line.startswith("mempool: ")]
    assert line.startswith("mempool: pool on sim device 0 (settings from MEMPOOL_CONF: "
                           "backend:sim,limit:128MiB); torch: not hooked (")


# --------------------------------------------------------------------------- in process


@pytest.mark.parametrize("value, expected", [("", "off"), ("1", "on"), (" 0 ", "off"),
                                             ("Verbose", "verbose")])
def test_mode_reads_mempool_children(monkeypatch, value, expected):
    monkeypatch.setenv("MEMPOOL_CHILDREN", value)
    assert _children.mode() == expected


def test_the_pytest_process_is_not_a_forkserver():
    assert not _children.in_forkserver()
