"""PyTorch's own CUDA tests, run under PyTorch's allocator and under mempool, side by side.

    python bench/torch_own_tests.py TEST_FILE OUTDIR [--select EXPR] [--timeout S | --budget S]
                                    [--baseline JSON] [-- PYTEST_ARGS]

TEST_FILE is a test file of PyTorch's repository (test/test_cuda.py; PyTorch's wheels do
not ship their tests), of the version installed or near it. It runs twice in pytest, each
time in a process of its own: as it is, and under ``python -m mempool run`` (mempool's pool
as PyTorch's CUDA allocator, every line of the tests unchanged). Each run writes a JUnit
file; the script then prints, per test, what differs: passed under PyTorch and not under
mempool (what a user moving to the pool would meet), and the reverse. A test that fails or
skips under both says nothing about the pool. Writes OUTDIR/own-tests.json; exits 1 when a
run collected no test (the file did not import), 0 otherwise.

A test that fails with a CUDA error that stays with the process (an illegal address) makes
every later test fail with it: those later tests run again, each alone in a process, within
another --timeout, and their outcomes alone are the ones compared (listed in the output).

A file newer than the installed PyTorch may import names the release lacks: both runs load
own_tests_compat.py, which gives such names the same stand-ins in both (listed in the
output and in own-tests.json).

--select is pytest's -k expression (default: every test). --baseline FILE takes the run under
PyTorch's allocator from an earlier own-tests.json of the same file, selection and machine:
that run does not depend on mempool's code, and skipping it halves the time.
"""
import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RUNS = {"pytorch": [], "mempool": ["-m", "mempool", "run"]}


def outcomes(junit_path):
    """{test id: (outcome, first line of its message)} from a JUnit file."""
    out = {}
    try:
        root = ET.parse(junit_path).getroot()
    except (ET.ParseError, OSError) as e:
        return {"<run>": ("unreadable", str(e))}
    for case in root.iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                outcome = "skipped" if tag == "skipped" else "failed"
                text = node.get("message") or node.text or ""
                message = text.strip().splitlines()[0][:300] if text.strip() else ""
                break
        out[name] = (outcome, message)
    return out


VERBOSE_LINE = re.compile(r"^(\S+?\.py)::(?:(\S+?)::)?(\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)")


def outcomes_from_log(log_path):
    """What pytest -v printed, for a run cut before it wrote its JUnit file: {test id:
    (outcome, "")}, in the ids outcomes() gives (class::name; the module dropped)."""
    kinds = {"PASSED": "passed", "XPASS": "passed", "SKIPPED": "skipped", "XFAIL": "skipped"}
    out = {}
    with open(log_path, errors="replace") as f:
        for line in f:
            m = VERBOSE_LINE.match(line)
            if m:
                module = m.group(1).rsplit("/", 1)[-1].removesuffix(".py")
                owner = f"{module}.{m.group(2)}" if m.group(2) else module
                out[f"{owner}::{m.group(3)}"] = (kinds.get(m.group(4), "failed"), "")
    return out


def run(name, test_file, outdir, select, timeout, extra, rerun_budget=None):
    """One run of the file under allocator `name`, within `timeout` seconds; the tests that
    failed after a sticky CUDA error then run again alone within rerun_budget() seconds
    (default: `timeout` again)."""
    junit = os.path.join(outdir, f"own-tests-{name}.junit.xml")
    log = os.path.join(outdir, f"own-tests-{name}.log")
    # -v: a run that crashes or is cut at its limit writes no JUnit file; its log still
    # says how far it got. pytest-timeout, where installed, cuts a test that hangs.
    cut = ["--timeout", "90"] if importlib.util.find_spec("pytest_timeout") else []
    compat = os.path.join(outdir, f"own-tests-{name}.compat.json")
    # own_tests_compat.py: names a test file newer than the installed PyTorch imports and
    # the release lacks get the same stand-ins in both runs, so that the file collects.
    cmd = [sys.executable, *RUNS[name], "-m", "pytest", test_file, "-p", "no:cacheprovider",
           "-p", "own_tests_compat", "-v", "-rfE", "--junitxml", junit, *cut,
           *(["-k", select] if select else []), *extra]
    env = dict(os.environ, OWN_TESTS_COMPAT_REPORT=compat)
    if name == "mempool":
        # The tests' multiprocessing children run the pool too, as PyTorch's own settings
        # reach them through the environment (docs/sharing.md, "Zero-code adoption").
        env["MEMPOOL_CHILDREN"] = "1"
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    env.pop("MEMPOOL_CONF", None)
    # The run starts in another folder (below): relative entries of PYTHONPATH would move,
    # and a mempool found through the current folder would be lost. The children import
    # the mempool this script would.
    paths = [HERE] + [os.path.abspath(p) for p in env.get("PYTHONPATH", "").split(os.pathsep)
                      if p]
    spec = importlib.util.find_spec("mempool")
    if spec is not None and spec.origin:
        paths.insert(0, os.path.dirname(os.path.dirname(spec.origin)))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    # PyTorch's test runner looks for its repository around the file; the tests run from
    # the file's folder, as PyTorch's CI runs them.
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                                cwd=os.path.dirname(os.path.abspath(test_file)) or ".",
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    tests = outcomes(junit)
    if "<run>" in tests:     # no JUnit file: cut at its limit, or the process crashed
        tests = outcomes_from_log(log) or tests
    try:
        with open(compat) as f:
            stand_ins = json.load(f)
    except (OSError, ValueError):
        stand_ins = None
    result = {"cmd": cmd, "rc": rc, "tests": tests, "stand_ins": stand_ins,
              "collected": collected(tests, log)}
    budget = rerun_budget() if rerun_budget else timeout
    rerun_after_sticky_error(result, name, test_file, outdir, env, budget, cut)
    return result


def run_limits(name, left):
    """Under --budget, (the run's limit, the share of what is then left for its reruns) when
    the run of `name` starts with `left` seconds of the budget to go. PyTorch's run comes
    first and takes at most half, so a slow first run cannot starve the pool's; its reruns
    take at most a third of what it leaves. The pool's run comes last and may take all but a
    fifth, which its reruns keep: time a quick run leaves goes to the next one."""
    if name == "pytorch":
        return left / 2, 1 / 3
    return left * 4 / 5, 1.0


# A failed kernel launch that leaves the process's CUDA context unusable: every test after
# it fails with the same error, whatever it does. (In the first run of PyTorch's own tests
# under the pool, one such failure took the 47 tests after it.)
STICKY_CUDA_ERRORS = ("illegal memory access", "an illegal instruction",
                      "unspecified launch failure", "misaligned address",
                      "device-side assert triggered")


def sticky(message):
    return any(e in message for e in STICKY_CUDA_ERRORS)


def node_id(test_file, test):
    """pytest's id of a test named as outcomes() names it (dotted module path, the class if
    any, "::", the test)."""
    owner, name = test.split("::", 1)
    last = owner.rsplit(".", 1)[-1]
    module = os.path.splitext(os.path.basename(test_file))[0]
    return f"{test_file}::{name}" if last == module else f"{test_file}::{last}::{name}"


def rerun_after_sticky_error(result, name, test_file, outdir, env, budget, cut):
    """After the first test that failed with an error that stays with the CUDA context, run
    each later test that failed with such an error again, alone in a process of its own, so
    that one failure costs one test. The first stays as it was: it may be the culprit.
    Marks result["rerun_alone"] {test: outcome alone}; stops when `budget` seconds are up."""
    failed = [t for t, (o, m) in result["tests"].items() if o == "failed" and sticky(m)]
    result["rerun_alone"] = {}
    if len(failed) < 2:
        return
    result["first_sticky_error"] = failed[0]
    deadline = time.monotonic() + budget
    junit = os.path.join(outdir, f"own-tests-{name}.alone.junit.xml")
    log = os.path.join(outdir, f"own-tests-{name}.alone.log")
    with open(log, "w") as f:
        for test in failed[1:]:
            left = deadline - time.monotonic()
            if left < 10:
                break
            cmd = [sys.executable, *RUNS[name], "-m", "pytest", node_id(test_file, test),
                   "-p", "no:cacheprovider", "-p", "own_tests_compat", "-v", "-rfE",
                   "--junitxml", junit, *cut]
            f.write(f"=== {test}\n")
            f.flush()
            try:
                subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env,
                               cwd=os.path.dirname(test_file) or ".", timeout=min(left, 300))
            except subprocess.TimeoutExpired:
                continue
            alone = outcomes(junit)
            if test in alone:
                result["tests"][test] = alone[test]
                result["rerun_alone"][test] = alone[test][0]


def collected(tests, log_path):
    """Whether the file's tests were collected: pytest stops a run whose file does not
    import with "error during collection", and then no test ran under either allocator."""
    try:
        with open(log_path, errors="replace") as f:
            text = f.read()
    except OSError:
        text = ""
    if "error during collection" in text or "errors during collection" in text:
        return False
    return any(t != "<run>" for t in tests)


def short_id(test, module):
    """`test` named from its module on (`test_cuda.TestCuda::test_x`): a JUnit file names
    it from the folder the run started in (`.external.pytorch.test_cuda.TestCuda::...`), a
    log read after a cut run (outcomes_from_log) from its module, and a baseline may come
    from a run of either kind."""
    owner, sep, name = test.partition("::")
    parts = owner.split(".")
    if module in parts:
        parts = parts[len(parts) - 1 - parts[::-1].index(module):]
    return ".".join(parts) + sep + name


def compare(runs, module):
    base, pool = ({short_id(t, module): v for t, v in runs[name]["tests"].items()}
                  for name in ("pytorch", "mempool"))
    counts = {name: {k: sum(1 for o, _ in r["tests"].values() if o == k)
                     for k in ("passed", "failed", "skipped")} for name, r in runs.items()}

    def why(t):
        outcome, message = pool.get(t, ("not run", ""))
        return f"{outcome}: {message}" if message else outcome

    only_pytorch = {t: why(t) for t, (o, _) in base.items()
                    if o == "passed" and pool.get(t, ("",))[0] != "passed"}
    only_mempool = sorted(t for t, (o, _) in pool.items()
                          if o == "passed" and base.get(t, ("",))[0] != "passed")
    return {"counts": counts, "passed_under_pytorch_only": only_pytorch,
            "passed_under_mempool_only": only_mempool}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    extra = []
    if "--" in argv:
        argv, extra = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file")
    ap.add_argument("outdir")
    ap.add_argument("--select", default="")
    ap.add_argument("--timeout", type=int, default=1200, help="seconds for each of the two runs")
    ap.add_argument("--budget", type=int, default=None,
                    help="seconds for the whole comparison instead: each run's limit is set "
                         "when it starts (run_limits), so time a quick run leaves goes to "
                         "the next")
    ap.add_argument("--baseline", metavar="OWN_TESTS_JSON",
                    help="take the run under PyTorch's allocator from this earlier "
                         "own-tests.json (same file, selection and machine) instead of "
                         "running it again: it does not depend on mempool's code")
    args = ap.parse_args(argv)
    if not os.path.isfile(args.test_file):
        ap.error(f"test_file: no file {args.test_file!r} (PyTorch's test/test_cuda.py, say)")
    baseline = None
    if args.baseline:
        try:
            with open(args.baseline) as f:
                baseline = json.load(f)["runs"]["pytorch"]
            baseline["tests"] = {t: tuple(v) for t, v in baseline["tests"].items()}
            # Keys a file from before these were recorded lacks.
            baseline.setdefault("stand_ins", None)
            baseline.setdefault("collected", any(t != "<run>" for t in baseline["tests"]))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            ap.error(f"--baseline: {args.baseline!r} is not an own-tests.json with a "
                     f"run under PyTorch's allocator ({e})")
        baseline["from"] = os.path.abspath(args.baseline)
    if args.budget is not None and args.budget <= 0:
        ap.error(f"--budget: {args.budget} is not a positive number of seconds")
    os.makedirs(args.outdir, exist_ok=True)
    deadline = time.monotonic() + args.budget if args.budget is not None else None
    runs = {}
    for name in RUNS:
        if name == "pytorch" and baseline:
            runs[name] = baseline
            continue
        timeout, rerun_budget = args.timeout, None
        if deadline is not None:
            limit, rerun_share = run_limits(name, deadline - time.monotonic())
            timeout = max(1, int(limit))
            rerun_budget = (lambda share=rerun_share:
                            max(0, int((deadline - time.monotonic()) * share)))
        runs[name] = run(name, os.path.abspath(args.test_file), args.outdir, args.select,
                         timeout, extra, rerun_budget)
    module = os.path.splitext(os.path.basename(args.test_file))[0]
    result = {"file": os.path.basename(args.test_file), "select": args.select, "runs": runs,
              **compare(runs, module)}
    with open(os.path.join(args.outdir, "own-tests.json"), "w") as f:
        json.dump(result, f, indent=1)
    for name, c in result["counts"].items():
        origin = f", from {runs[name]['from']}" if runs[name].get("from") else ""
        print(f"{name}: {c['passed']} passed, {c['failed']} failed, {c['skipped']} skipped "
              f"(exit status {runs[name]['rc']}{origin})")
    stand_ins = runs["pytorch"]["stand_ins"] or {}
    for path, entries in stand_ins.items():
        for e in entries:
            what = (f"module {e['module']} does not import" if e["name"] is None
                    else f"{e['module']}.{e['name']}: {e['stand_in']}")
            print(f"  not in this PyTorch, in both runs: {what}")
    stopped = [name for name, r in runs.items() if not r["collected"]]
    for name in stopped:
        print(f"{name}: the file's tests were not collected (see own-tests-{name}.log)")
    print(f"passed under PyTorch's allocator, not under mempool: "
          f"{len(result['passed_under_pytorch_only'])}")
    for t, why in sorted(result["passed_under_pytorch_only"].items()):
        print(f"  {t}: {why}")
    print(f"passed under mempool, not under PyTorch's allocator: "
          f"{len(result['passed_under_mempool_only'])}")
    for t in result["passed_under_mempool_only"]:
        print(f"  {t}")
    for name, r in runs.items():
        if r.get("rerun_alone"):
            alone = list(r["rerun_alone"].values())
            print(f"{name}: after {r['first_sticky_error']} failed with a CUDA error that "
                  f"stays with the process, {len(alone)} tests that failed with it ran again "
                  f"alone: {alone.count('passed')} passed, {alone.count('failed')} failed, "
                  f"{alone.count('skipped')} skipped (own-tests-{name}.alone.log)")
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
