"""Several selections of PyTorch's own tests, each under both allocators, in one time budget.

    python bench/torch_own_tests_pairs.py OUTDIR [--budget S] [--pair NAME FILE SELECT]...
                                          [--baselines DIR]

Each pair is a test file of PyTorch's repository and a pytest -k expression; it runs through
bench/torch_own_tests.py (under PyTorch's allocator and under ``python -m mempool run``) and
writes OUTDIR/NAME/own-tests.json. Without --pair the pairs are PAIRS below, their files
under --tests (default .external/pytorch, where bench/gpu_run.sh expects them); a pair whose
file is missing is reported and skipped.

The budget is shared as the pairs run: each gets what is left divided by the pairs still to
run, so time a quick pair leaves goes to the ones after it. Within a pair, torch_own_tests.py
shares it as its runs go (its --budget): the run under PyTorch's allocator takes at most half,
the run under mempool most of what is left, and the tests run again alone after a CUDA error
that stays with the process the rest. With --baselines holding DIR/NAME/own-tests.json from an
earlier run of the same pair and machine, the run under PyTorch's allocator is taken from
there (it does not depend on mempool's code) and the pair's time goes to mempool's.

Writes OUTDIR/own-tests-pairs.json: for each pair its name, file, selection, seconds given
and exit status (bench/collect_results.py reads it with each pair's own-tests.json).
Exits 1 when no pair ran, or when one ran and collected no test.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# (name, file of PyTorch's test/ folder, -k expression). test_cuda.py's allocator tests:
# its memory statistics, snapshots, caps and out-of-memory paths, expandable segments and
# block splitting (test_max_split_expandable), CUDA graphs' private pools and torch.cuda.MemPool;
# then what crosses processes: test_multiprocessing.py's CUDA tests (tensors, storages and
# events through torch.multiprocessing; test_cuda.py holds no IPC case of its own).
MEMORY = ("memory or Memory or mem_get_info or caching_allocator or max_split or expandable "
          "or out_of_memory or allocator or snapshot or empty_cache")
PAIRS = (
    # TestCudaMallocAsync's half in a pair of its own: it builds a C++ extension
    # (test_cpp_memory_snapshot_pickle) and holds test_max_split_expandable, so a pair cut
    # at its time share loses only its own tests.
    ("cuda-memory", "test_cuda.py", f"not TestCudaMallocAsync and ({MEMORY})"),
    ("cuda-memory-async", "test_cuda.py", f"TestCudaMallocAsync and ({MEMORY})"),
    ("cuda-graphs", "test_cuda.py", "graph and not memory and not ipc"),
    ("cuda-mempool", "test_cuda.py", "MemPool or mempool or mem_pool"),
    ("multiprocessing-cuda", "test_multiprocessing.py", "cuda or event"),
)
# What one pair needs at the least to be worth starting: PyTorch's import and collection in
# each run.
MIN_SHARE = 60


def plan(pairs, budget, started, now):
    """Seconds for the next pair: what is left of the budget over the pairs still to run.
    torch_own_tests.py shares a pair's seconds between its runs as they go (--budget)."""
    left = budget - (now - started)
    return left / max(1, len(pairs))


def run_pair(name, test_file, select, outdir, baseline, share):
    folder = os.path.join(outdir, name)
    # The slack below is for writing and comparing after the runs.
    cmd = [sys.executable, os.path.join(HERE, "torch_own_tests.py"), test_file, folder,
           "--select", select, "--budget", str(max(1, int(share) - 10))]
    if baseline:
        cmd += ["--baseline", baseline]
    print(f"=== {name}: {os.path.basename(test_file)} -k {select!r} ({int(share)} s)",
          flush=True)
    # The child starts from bench/: it imports the mempool this script would (an installed
    # one, or the tree this script is in).
    spec = importlib.util.find_spec("mempool")
    found = os.path.dirname(os.path.dirname(spec.origin)) if spec and spec.origin else ROOT
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [found] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    try:
        rc = subprocess.run(cmd, timeout=share + 30, env=env).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    print(f"=== {name}: exit status {rc}", flush=True)
    return rc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--budget", type=int, default=1500,
                    help="seconds for every pair together (default 1500)")
    ap.add_argument("--pair", nargs=3, action="append", metavar=("NAME", "FILE", "SELECT"),
                    help="a pair to run instead of the default ones (repeatable)")
    ap.add_argument("--tests", default=os.path.join(ROOT, ".external", "pytorch"),
                    help="folder of PyTorch's test files for the default pairs")
    ap.add_argument("--only", default="",
                    help="comma-separated names of the default pairs to run (default: all)")
    ap.add_argument("--baselines", metavar="DIR",
                    help="an earlier run's OUTDIR: DIR/NAME/own-tests.json stands for the "
                         "pair's run under PyTorch's allocator")
    args = ap.parse_args(argv)
    if args.budget <= 0:
        ap.error(f"--budget: {args.budget} is not a positive number of seconds")
    if args.pair:
        pairs = [tuple(p) for p in args.pair]
    else:
        pairs = [(n, os.path.join(args.tests, f), s) for n, f, s in PAIRS]
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        unknown = sorted(set(wanted) - {n for n, _, _ in pairs})
        if unknown:
            ap.error(f"--only: no pair named {', '.join(unknown)} "
                     f"(pairs: {', '.join(n for n, _, _ in pairs)})")
        pairs = [p for p in pairs if p[0] in wanted]
    names = [n for n, _, _ in pairs]
    bad = [n for n in names if not n or os.sep in n or n.startswith(".") or names.count(n) > 1]
    if bad:
        ap.error(f"--pair: the name {bad[0]!r} is empty, a path or repeated; each NAME is a "
                 f"folder name of its own")
    os.makedirs(args.outdir, exist_ok=True)
    started = time.monotonic()
    done = []
    todo = list(pairs)
    while todo:
        name, test_file, select = todo[0]
        entry = {"name": name, "file": os.path.basename(test_file), "select": select}
        baseline = None
        if args.baselines:
            candidate = os.path.join(args.baselines, name, "own-tests.json")
            baseline = candidate if os.path.isfile(candidate) else None
        share = plan(todo, args.budget, started, time.monotonic())
        if not os.path.isfile(test_file):
            print(f"=== {name}: no file {test_file}: skipped", flush=True)
            entry.update(rc="no file", seconds=0)
        elif share < MIN_SHARE:
            print(f"=== {name}: {int(share)} s left, under {MIN_SHARE}: not started",
                  flush=True)
            entry.update(rc="no time", seconds=0)
        else:
            entry.update(seconds=int(share), baseline=baseline)
            entry["rc"] = run_pair(name, os.path.abspath(test_file), select, args.outdir,
                                   baseline, share)
        done.append(entry)
        todo.pop(0)
    with open(os.path.join(args.outdir, "own-tests-pairs.json"), "w") as f:
        json.dump({"pairs": done}, f, indent=1)
    ran = [e for e in done if isinstance(e["rc"], int)]
    statuses = ", ".join(f"{e['name']}: {e['rc']}" for e in done)
    print(f"own tests: {len(ran)} of {len(done)} pairs ran ({statuses})")
    return 0 if ran and all(e["rc"] == 0 for e in ran) else 1


if __name__ == "__main__":
    sys.exit(main())
