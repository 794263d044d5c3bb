"""The cache lines one allocate + free of the core touches when the caches are cold, and what
such a pair costs (Note [Hot lines] in mempool/_csrc/core/mp_internal.h).

    python bench/cold_lines.py [--sizes 512,65536,1048576,67108864] [--rounds 200]
                               [--procs 3] [--evict 4MiB] [--json FILE]

Builds bench/cold_pairs.c with the core's C sources (the flags of setup.py's release build)
on the host upstream, then for each size:

- lines, when valgrind is installed: cachegrind's first-level misses of a run whose rounds
  each empty the caches and make one pair, less those of the same run with no pair, per
  round. Exact and the same on any machine with the same compiler: the count a layout
  change moves.
- time: the median ns of a pair right after the caches were emptied (cold) and of the next
  one (warm), the median of --procs processes and the slowest stated. It depends on the
  machine's caches and how busy it is; on a shared host it moves by tens of percent.
"""
import argparse
import glob
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "mempool", "_csrc")
sys.path.insert(0, ROOT)

from mempool._config import parse_size  # noqa: E402


def build(outdir):
    if shutil.which("gcc") is None:
        sys.exit("cold_lines.py: gcc not found; it builds cold_pairs.c with the core's sources")
    exe = os.path.join(outdir, "cold_pairs")
    sources = [os.path.join(ROOT, "bench", "cold_pairs.c")]
    for layer in ("common", "core", "upstream"):
        sources += sorted(glob.glob(os.path.join(CSRC, layer, "*.c")))
    cmd = ["gcc", "-O3", "-g", "-std=gnu11", "-fno-semantic-interposition",
           *(f"-I{os.path.join(CSRC, layer)}" for layer in ("common", "core", "upstream")),
           *sources, "-o", exe, "-ldl", "-lpthread"]
    subprocess.run(cmd, check=True)
    return exe


def misses(exe, pairs, nbytes, rounds, evict):
    """cachegrind's (I1, D1) misses of one run."""
    with tempfile.NamedTemporaryFile() as out:
        run = subprocess.run(
            ["valgrind", "--tool=cachegrind", "--cache-sim=yes", f"--cachegrind-out-file={out.name}",
             exe, str(pairs), str(nbytes), str(rounds), str(evict)],
            capture_output=True, text=True, check=True)
    found = {}
    for key in ("I1", "D1"):
        m = re.search(rf"{key}\s+misses:\s+([\d,]+)", run.stderr)
        if not m:
            raise RuntimeError(f"cachegrind printed no {key} misses:\n{run.stderr[-2000:]}")
        found[key] = int(m.group(1).replace(",", ""))
    return found["I1"], found["D1"]


def lines_per_pair(exe, nbytes, rounds, evict):
    i0, d0 = misses(exe, 0, nbytes, rounds, evict)
    i1, d1 = misses(exe, 1, nbytes, rounds, evict)
    return {"code_lines": round((i1 - i0) / rounds, 1), "data_lines": round((d1 - d0) / rounds, 1)}


def times(exe, nbytes, rounds, evict, procs):
    runs = []
    for _ in range(procs):
        out = subprocess.run([exe, "1", str(nbytes), str(rounds), str(evict)],
                             capture_output=True, text=True, check=True).stdout
        runs.append(json.loads(out))
    cold = [r["cold_ns"] for r in runs]
    warm = [r["warm_ns"] for r in runs]
    return {"cold_ns": statistics.median(cold), "cold_ns_worst": max(cold),
            "warm_ns": statistics.median(warm), "warm_ns_worst": max(warm)}


def evict_bytes(text):
    try:
        return parse_size(text, "--evict")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="512,65536,1048576,67108864",
                    help="comma-separated request sizes in bytes")
    ap.add_argument("--rounds", type=int, default=200, help="cold pairs per run (lines)")
    ap.add_argument("--time-rounds", type=int, default=20000, help="cold pairs per process (time)")
    ap.add_argument("--procs", type=int, default=3, help="processes per size (time)")
    ap.add_argument("--evict", type=evict_bytes, default=4 << 20,
                    help="bytes touched between pairs (time; lines use 1 MiB, past cachegrind's L1)")
    ap.add_argument("--no-time", action="store_true", help="count lines only")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    try:
        sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    except ValueError as exc:
        ap.error(str(exc))
    if 0 in sizes:
        ap.error("--sizes: every size must be at least 1 byte")
    if args.rounds < 1 or args.time_rounds < 1 or args.procs < 1:
        ap.error("--rounds, --time-rounds and --procs take a positive count")
    have_valgrind = shutil.which("valgrind") is not None
    if not have_valgrind:
        print("valgrind not found: lines are not counted", file=sys.stderr)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        exe = build(tmp)
        for n in sizes:
            row = {"nbytes": n}
            if have_valgrind:
                row.update(lines_per_pair(exe, n, args.rounds, 1 << 20))
            if not args.no_time:
                row.update(times(exe, n, args.time_rounds, args.evict, args.procs))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"evict_bytes": args.evict, "procs": args.procs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
