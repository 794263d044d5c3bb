"""Numba's own CUDA tests, run under Numba's memory manager and under mempool's, side by side.

    python bench/numba_own_tests.py OUTDIR [--suite numba.cuda.tests.cudadrv] [--timeout S]

numba-cuda ships its tests with the package (numba.cuda.tests). The suite runs twice with
Numba's own runner (python -m numba.runtests -v SUITE), each time in a process of its own:
as it is, and with NUMBA_CUDA_MEMORY_MANAGER=mempool.numba, every line of the tests
unchanged. The script then prints, per test, what differs: passed under Numba's manager and
not under mempool's (what a user moving to the pool would meet), and the reverse, with the
error or the skip's reason. A test that fails or skips under both says nothing about the
pool. Writes OUTDIR/numba-own-tests.json and each run's log; exits 1 when a run ran no
test, or when the run under mempool was not on mempool's manager.

Both runs have tests/data/numpy_compat on their path (see NUMPY_COMPAT). The runs are
serial: Numba's parallel runner (-m) stops at a test of numba-cuda's whose subtests hold
local functions it cannot pickle. numba.cuda.testing imports `filecheck`; a
machine without it collects no test (carry its wheel, as bench/gpu_run.sh does for .whl/).
"""
import argparse
import json
import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
MANAGERS = {"numba": {}, "mempool": {"NUMBA_CUDA_MEMORY_MANAGER": "mempool.numba"}}
# numba-cuda 0.x types np.row_stack, which NumPy 2.5 removed: without this alias on the
# path (tests/data/numpy_compat/sitecustomize.py) every test that compiles a kernel fails
# under both managers alike. Both runs get it.
NUMPY_COMPAT = os.path.join(ROOT, "tests", "data", "numpy_compat")

# unittest's verbose line: "test_x (package.module.Class.test_x) ... ok"; a subtest adds its
# parameters in parentheses after the id. The outcome may come on a later line when the
# test printed something first.
_TEST_LINE = re.compile(r"^(\w+) \(([\w.]+)\)(?: \(.*\))? \.\.\. ?(.*)$")
_OUTCOME = re.compile(r"^(ok|ERROR|FAIL|skipped(?: .*)?|expected failure|unexpected success)$")
# The header of a failure's report: "ERROR: test_x (package.module.Class.test_x)".
_REPORT = re.compile(r"^(ERROR|FAIL): (\w+) \(([\w.]+)\)")

# Which manager the run's processes get, asked the way Numba asks (its first context).
PROBE = """
from numba import cuda
print("MANAGER", type(cuda.current_context().memory_manager).__name__)
"""


def outcome_of(text):
    """'passed', 'failed' or 'skipped' for unittest's word, with a skip's reason."""
    if text == "ok" or text == "expected failure":
        return "passed", ""
    if text.startswith("skipped"):
        return "skipped", text[len("skipped"):].strip().strip("'\"")
    return "failed", ""


def parse_log(text):
    """{test id: (outcome, message)} from a verbose unittest log. A test whose subtests
    differ takes its worst outcome (failed over skipped over passed); a failure's message
    is the last line of its report (the exception)."""
    rank = {"passed": 0, "skipped": 1, "failed": 2}
    out = {}
    pending = None
    for line in text.splitlines():
        m = _TEST_LINE.match(line)
        if m:
            pending = m.group(2)
            word = m.group(3).strip()
            if not _OUTCOME.match(word):
                continue   # its outcome comes on a later line
        elif pending and _OUTCOME.match(line.strip()):
            word = line.strip()
        else:
            continue
        outcome = outcome_of(word)
        if pending not in out or rank[outcome[0]] > rank[out[pending][0]]:
            out[pending] = outcome
        pending = None
    for test, message in failure_messages(text).items():
        if test in out and out[test][0] == "failed":
            out[test] = ("failed", message)
        elif test not in out:   # a module that did not import: unittest's _FailedTest
            out[test] = ("failed", message)
    return out


def failure_messages(text):
    """{test id: the last line of its ERROR/FAIL report (the exception)}. unittest writes
    each report between lines of '=', its header and traceback apart by a line of '-'; the
    last report ends at the '-' line before "Ran N tests"."""
    messages = {}
    for chunk in re.split(r"^={20,}$", text, flags=re.M):
        lines = chunk.strip("\n").splitlines()
        m = _REPORT.match(lines[0]) if lines else None
        if not m:
            continue
        body = []
        for line in lines[2:]:          # after the header and its '-' line
            if re.match(r"^-{20,}$", line):
                break
            body.append(line)
        last = [b.strip() for b in body if b.strip()]
        messages.setdefault(m.group(3), last[-1][:300] if last else "")
    return messages


def compare(runs):
    """The tests whose outcome differs between the two runs, as rows of (test, numba's
    outcome and message, mempool's outcome and message)."""
    a, b = runs["numba"], runs["mempool"]
    rows = []
    for test in sorted(set(a) | set(b)):
        x, y = a.get(test, ("absent", "")), b.get(test, ("absent", ""))
        if x[0] != y[0]:
            rows.append((test, x, y))
    return rows


def run(name, suite, outdir, timeout):
    env = dict(os.environ, **MANAGERS[name])
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, NUMPY_COMPAT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True,
                           text=True, timeout=300)
    manager = next((line.split()[1] for line in probe.stdout.splitlines()
                    if line.startswith("MANAGER ")), None)
    log = os.path.join(outdir, f"numba-own-{name}.log")
    try:
        proc = subprocess.run([sys.executable, "-m", "numba.runtests", "-v", suite], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, cwd=outdir)
        text, status = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        text = e.stdout or ""
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        status = "timeout"
    with open(log, "w") as f:
        f.write(text)
    ran = re.findall(r"^Ran (\d+) tests? in", text, re.M)
    return {"manager": manager, "probe_error": probe.stderr[-2000:] if manager is None else "",
            "status": status, "ran": int(ran[-1]) if ran else 0, "tests": parse_log(text)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("outdir")
    ap.add_argument("--suite", default="numba.cuda.tests.cudadrv")
    ap.add_argument("--timeout", type=float, default=300, help="seconds for each run (300)")
    args = ap.parse_args(argv)
    os.makedirs(args.outdir, exist_ok=True)
    results = {name: run(name, args.suite, args.outdir, args.timeout) for name in MANAGERS}
    rows = compare({name: r["tests"] for name, r in results.items()})
    with open(os.path.join(args.outdir, "numba-own-tests.json"), "w") as f:
        json.dump({"suite": args.suite, "runs": results,
                   "differ": [{"test": t, "numba": list(x), "mempool": list(y)}
                              for t, x, y in rows]}, f, indent=1)
    for name, r in results.items():
        counts = {k: sum(1 for o, _ in r["tests"].values() if o == k)
                  for k in ("passed", "failed", "skipped")}
        print(f"{name}: manager {r['manager']}, exit {r['status']}, ran {r['ran']}: "
              f"{counts['passed']} passed, {counts['failed']} failed, "
              f"{counts['skipped']} skipped")
    print(f"{len(rows)} tests differ")
    for test, x, y in rows:
        print(f"  {test}: under Numba's manager {x[0]}{': ' + x[1] if x[1] else ''}; "
              f"under mempool's {y[0]}{': ' + y[1] if y[1] else ''}")
    bad = [name for name, r in results.items() if r["ran"] == 0]
    if bad:
        print(f"no test ran under {', '.join(bad)}", file=sys.stderr)
    if results["mempool"]["manager"] != "MempoolNumbaManager":
        print(f"the run under mempool had manager {results['mempool']['manager']!r}: "
              f"{results['mempool']['probe_error']}", file=sys.stderr)
        return 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
