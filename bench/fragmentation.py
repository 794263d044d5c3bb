"""Fragmentation benchmark: peak reserved / peak live for the shipped training traces.

    python bench/fragmentation.py                        # print the table
    python bench/fragmentation.py --out bench/results/fragmentation.json

Each trace in mempool/traces/ (a transformer with dynamic sequence lengths and a CNN with
variable resolution) is replayed on the simulated device, at GPU scale, under the settings
users reach for. The figure of merit is peak reserved bytes over peak live (requested)
bytes: 1.0 means the pool held nothing beyond what the program used at its peak.

Targets: at most 1.02 with expandable segments and 1.10 without. PyTorch's and CuPy's
figures for these traces, replayed on a GPU with the trace corpus (`python -m mempool replay
--corpus --backend cuda`), are in bench/results/<card>.json (BENCHMARKS.md); the table's footer
quotes them.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from bench.provenance import commit  # noqa: E402
from mempool.tools import replay as rp  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402
from mempool.cli.trace import TRACES_DIR  # noqa: E402

TRACES = ("transformer_train.jsonl.gz", "vision_train.jsonl.gz")
SETTINGS = [
    ("default", {}),
    ("roundup_power2_divisions:4", {"roundup_power2_divisions": 4}),
    ("roundup_power2_divisions:[256:1,512:2,>:8]",
     {"roundup_power2_divisions": "[256:1,512:2,>:8]"}),
    ("max_split_size:64MB", {"max_split_size": 64 << 20}),
    ("expandable_segments:True", {"expandable_segments": True}),
    # What backend="cuda" does by default on an H200: segments of whole cudaMemPool chunks
    # (Note [The cudaMemPool's unit]) and 8 MiB pages for expandable segments.
    ("segment_rounding:32MiB (cuda)", {"segment_rounding": "32MiB"}),
    ("expandable_segments:True,granularity:8MiB (cuda)",
     {"expandable_segments": True, "granularity": "8MiB"}),
]
TARGET_EXPANDABLE = 1.02
TARGET = 1.10


def target_for(options: dict) -> float:
    return TARGET_EXPANDABLE if options.get("expandable_segments") else TARGET


def run(traces=TRACES, settings=SETTINGS, capacity=None) -> list:
    """Replay every trace under every setting; one dict per (trace, setting)."""
    extra = {} if capacity is None else {"capacity": capacity}
    rows = []
    for name in traces:
        path = name if os.path.exists(name) else os.path.join(TRACES_DIR, name)
        prep = rp.prepare(mtrace.load(path))
        for label, options in settings:
            row = {"trace": os.path.basename(path), "setting": label, "options": options,
                   "target": target_for(options)}
            try:
                r = rp.replay(prep, conf=dict(options), backend="sim", check=True, **extra)
            except (NotImplementedError, ValueError) as e:
                if not options:
                    raise
                row["skipped"] = f"{type(e).__name__}: {e}"
                rows.append(row)
                continue
            row.update(events=r.events, peak_live_bytes=r.peak_live_bytes,
                       peak_reserved_bytes=r.peak_reserved_bytes,
                       peak_allocated_bytes=r.peak_allocated_bytes, ratio=r.ratio,
                       num_ooms=r.num_ooms, num_device_alloc=r.num_device_alloc,
                       num_device_free=r.num_device_free, ns_per_event=r.ns_per_event,
                       calls_per_step=r.calls_per_step,
                       meets_target=r.ratio <= row["target"] and r.num_ooms == 0)
            rows.append(row)
    return rows


def _later(row) -> str:
    steps = row.get("calls_per_step")
    return "-" if not steps else str(max(steps[3:], default=0))


def table(rows: list) -> str:
    gib = float(1 << 30)
    lines = [f"{'trace':<27} {'setting':<48} {'live GiB':>8} {'reserved':>8} "
             f"{'res/live':>8} {'target':>6} {'ok':>3} {'upstream':>8} {'later':>5} "
             f"{'ns/ev':>6}"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"{r['trace']:<27} {r['setting']:<48} skipped: {r['skipped']}")
            continue
        lines.append(
            f"{r['trace']:<27} {r['setting']:<48} {r['peak_live_bytes'] / gib:>8.3f} "
            f"{r['peak_reserved_bytes'] / gib:>8.3f} {r['ratio']:>8.3f} "
            f"{r['target']:>6.2f} {'yes' if r['meets_target'] else 'NO':>3} "
            f"{r['num_device_alloc'] + r['num_device_free']:>8} {_later(r):>5} "
            f"{r['ns_per_event']:>6.0f}")
    lines.append("")
    lines.append("upstream: segment allocs and frees (expandable: page maps and unmaps); later: "
                 "the most upstream calls in one step after the first three")
    measured = _gpu_results()
    for trace in dict.fromkeys(r["trace"] for r in rows):
        got = [r for r in measured if r.get("trace") == trace and "ratio" in r
               and not r["allocator"].startswith("mempool")]
        if got:
            lines.append(f"on a GPU, {trace}: " + ", ".join(
                f"{r['allocator']} {r['ratio']:.3f}" for r in got))
    return "\n".join(lines)


def _gpu_results() -> list:
    """The device's replays of these traces in the corpus table of each card's
    bench/results/<card>.json (bench/render_benchmarks.py), as rows of trace, allocator and
    peak reserved / peak live."""
    from bench.collect_results import CORPUS_RATIO_TABLE
    rows = []
    for path in sorted(glob.glob(os.path.join(HERE, "results", "*.json"))):
        try:
            with open(path) as f:
                figures = json.load(f).get("figures", [])
        except (OSError, ValueError):
            continue
        for fig in figures:
            trace = fig.get("row", "").split(" (")[0] + ".jsonl.gz"
            if fig.get("table") == CORPUS_RATIO_TABLE and trace in TRACES:
                rows.append({"trace": trace, "allocator": fig["column"], "ratio": fig["median"]})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="*", default=list(TRACES),
                    help="trace files (default: the shipped transformer and vision traces)")
    ap.add_argument("--capacity", default=None,
                    help="simulated device size (default: the pool's own default)")
    ap.add_argument("--out", default=None,
                    help="also write the results as JSON to this file (e.g. under bench/results/)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args.traces, capacity=args.capacity)
    print(table(rows))
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"commit": commit(), "python": platform.python_version(),
                       "machine": platform.machine(), "backend": "sim", "rows": rows},
                      f, indent=2)
            f.write("\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
