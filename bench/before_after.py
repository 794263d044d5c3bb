"""Two builds of mempool side by side on one GPU: allocate + free from Python, and
``torch.empty`` + drop under ``mempool.torch.install``, each in processes of its own.

    python bench/before_after.py BEFORE_TREE AFTER_TREE --out RESULT.json [--procs 6]

Each tree is a source checkout with its extension built in place. The processes of the two
trees are pinned to one CPU and interleaved (A B B A A B ...), so both see the same CPU at
nearly the same pace; each process's figure is the median of its rounds, and the table gives
the median and the worst over processes. A process imports mempool from its own tree only
(PYTHONPATH is that tree), so the two builds never meet in one interpreter.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

SIZES = (512, 64 << 10, 1 << 20, 64 << 20)

# Runs inside a child: allocate + free pairs on a cuda pool, median of ROUNDS rounds.
PAIR_CHILD = r"""
import json, statistics, sys, time
import mempool
rounds, pairs = int(sys.argv[1]), int(sys.argv[2])
sizes = [int(s) for s in sys.argv[3:]]
pool = mempool.Pool(backend="cuda", device=0)
alloc, free = pool.alloc, pool.free
out = {}
for nbytes in sizes:
    per_round = []
    for r in range(rounds + 1):
        t0 = time.perf_counter_ns()
        for _ in range(pairs):
            free(alloc(nbytes))
        if r:
            per_round.append((time.perf_counter_ns() - t0) / pairs)
    out[nbytes] = statistics.median(per_round)
print("RESULT " + json.dumps(out), flush=True)
"""


def run_child(tree, argv, cpu, timeout):
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    proc = subprocess.run([sys.executable, *argv], env=env, cwd=tree, capture_output=True,
                          text=True, timeout=timeout,
                          preexec_fn=lambda: os.sched_setaffinity(0, {cpu}))
    if proc.returncode != 0:
        raise RuntimeError(f"{tree}: {' '.join(argv[:2])} exit {proc.returncode}: "
                           f"{proc.stderr[-2000:]}")
    return proc.stdout


def pair_figures(tree, cpu, rounds, pairs):
    out = run_child(tree, ["-c", PAIR_CHILD, str(rounds), str(pairs), *map(str, SIZES)],
                    cpu, 300)
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    return {int(k): v for k, v in json.loads(line[len("RESULT "):]).items()}


def empty_figures(tree, cpu, rounds, pairs):
    child = os.path.join("mempool", "bench", "torch_empty_child.py")
    out = run_child(tree, [child, "mempool", str(rounds), str(pairs), *map(str, SIZES)],
                    cpu, 300)
    obj = json.loads(out.strip().splitlines()[-1])
    return {int(k): obj[str(k)]["ns_per_pair"] for k in SIZES}


def summarize(per_process):
    """{size: [ns per process]} -> {size: {"median": ., "worst": ., "n": .}}"""
    return {size: {"median": statistics.median(v), "worst": max(v), "n": len(v)}
            for size, v in per_process.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--out", required=True)
    ap.add_argument("--procs", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--pairs", type=int, default=2000)
    ap.add_argument("--cpu", type=int, default=None,
                    help="the CPU every process is pinned to (default: the last one allowed)")
    ap.add_argument("--skip-torch", action="store_true")
    ap.add_argument("--before-label", default="before",
                    help="what the earlier build is, e.g. its commit (kept in the JSON)")
    args = ap.parse_args(argv)
    cpu = args.cpu if args.cpu is not None else max(os.sched_getaffinity(0))
    trees = {"before": args.before, "after": args.after}
    measures = {"pair": pair_figures}
    if not args.skip_torch:
        measures["torch.empty"] = empty_figures
    raw = {m: {t: {s: [] for s in SIZES} for t in trees} for m in measures}
    for i in range(args.procs):
        order = list(trees) if i % 2 == 0 else list(trees)[::-1]
        for measure, fn in measures.items():
            for name in order:
                for size, ns in fn(trees[name], cpu, args.rounds, args.pairs).items():
                    raw[measure][name][size].append(ns)
    result = {m: {t: summarize(raw[m][t]) for t in trees} for m in measures}
    with open(args.out, "w") as f:
        json.dump({"raw": raw, "summary": result, "cpu": cpu, "procs": args.procs,
                   "before_commit": args.before_label}, f,
                  indent=1)
    print(f"{'measure':12} {'size':>9} {'before median/worst ns':>24} "
          f"{'after median/worst ns':>24} {'after/before':>12}")
    for m in measures:
        for size in SIZES:
            b, a = result[m]["before"][size], result[m]["after"][size]
            print(f"{m:12} {size:>9} {b['median']:>12.0f} / {b['worst']:<9.0f} "
                  f"{a['median']:>12.0f} / {a['worst']:<9.0f} {a['median'] / b['median']:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
