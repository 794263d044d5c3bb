"""The trace corpus on the device in lanes side by side: ``replay --corpus`` in one call.

    python bench/corpus_lanes.py OUT.json [--lanes 4] [--processes 6] [--backend cuda]
                                 [--corpus DIR] [--timeout S]

With six processes a cell, the corpus replays 5 columns x 11 traces x 6 processes, most of
it each process's start (a PyTorch, a CUDA context): one after another, longer than a call on
the device allows (docs/decisions.md). Here the traces are dealt round-robin into lanes,
each lane a ``python -m mempool replay --corpus LANE --processes N --json`` of its own,
pinned to its own CPUs (this process's set cut in equal parts), the lanes running at once;
within a lane each cell's processes still take turns with the other columns'
(mempool/tools/corpus_processes.py). The ratios are each process's own; the times are taken
with the other lanes running on the same device, so the output names its lanes, and the
figures' table says so (BENCHMARKS.md).

Writes OUT.json in the form of ``replay --corpus --json``: every lane's rows in the
manifest's order, the summary of both halves over all of them, and ``lanes`` (each lane's
traces, CPUs, exit status and seconds). Exits 1 when a lane failed (its traces are then
missing from the rows), 2 for bad arguments.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mempool.tools.corpus import _summary  # noqa: E402
from mempool.tools.corpus_processes import processes_error  # noqa: E402

DEFAULT_CORPUS = os.path.join(ROOT, "mempool", "traces", "corpus")


def deal(manifest: dict, lanes: int) -> list:
    """The manifest's traces dealt round-robin into `lanes` lists (empty lanes dropped)."""
    dealt = [manifest["traces"][i::lanes] for i in range(lanes)]
    return [traces for traces in dealt if traces]


def cpu_sets(lanes: int) -> list:
    """This process's CPUs cut into `lanes` consecutive parts of equal size (None each where
    the platform cannot pin, or there are fewer CPUs than lanes)."""
    if not hasattr(os, "sched_getaffinity"):
        return [None] * lanes
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // lanes
    if per == 0:
        return [None] * lanes
    return [set(cpus[i * per:(i + 1) * per]) for i in range(lanes)]


def write_lane(folder: str, corpus: str, manifest: dict, traces: list) -> None:
    """A corpus folder holding `traces` (copied beside a manifest that names only them)."""
    os.makedirs(folder)
    kept = []
    for trace in traces:
        name = os.path.basename(trace["file"])
        shutil.copy(os.path.join(corpus, trace["file"]), os.path.join(folder, name))
        kept.append(dict(trace, file=name))
    with open(os.path.join(folder, "manifest.json"), "w", encoding="utf-8") as f:
        json.dump(dict(manifest, traces=kept), f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the merged report (JSON)")
    ap.add_argument("--lanes", type=int, default=4, help="lanes side by side (default 4)")
    ap.add_argument("--processes", type=int, default=6,
                    help="processes per cell, as replay --processes (default 6)")
    ap.add_argument("--backend", default="cuda", choices=("cuda", "sim", "host"))
    ap.add_argument("--corpus", default=DEFAULT_CORPUS, help="the corpus folder (default: "
                    "the shipped mempool/traces/corpus)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds each lane may run (default: no limit)")
    args = ap.parse_args(argv)
    if not 1 <= args.lanes <= 64:
        ap.error(f"--lanes: expected a whole number from 1 to 64; got {args.lanes}")
    error = processes_error(args.processes)
    if error:
        ap.error(f"--processes: {error}")
    with open(os.path.join(args.corpus, "manifest.json"), encoding="utf-8") as f:
        manifest = json.load(f)
    dealt = deal(manifest, args.lanes)
    pins = cpu_sets(len(dealt))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    with tempfile.TemporaryDirectory(prefix="corpus-lanes-") as tmp:
        running = []
        for i, (traces, cpus) in enumerate(zip(dealt, pins)):
            folder = os.path.join(tmp, f"lane{i}")
            write_lane(folder, args.corpus, manifest, traces)
            cmd = [sys.executable, "-m", "mempool", "replay", "--corpus", folder,
                   "--backend", args.backend, "--processes", str(args.processes), "--json"]
            out = open(os.path.join(tmp, f"lane{i}.json"), "w+", encoding="utf-8")
            child = subprocess.Popen(
                cmd, stdout=out, env=env,
                preexec_fn=(lambda c=cpus: os.sched_setaffinity(0, c)) if cpus else None)
            running.append((i, traces, cpus, child, out, time.monotonic()))
        rows, lanes, first = [], [], None
        deadline = time.monotonic() + args.timeout if args.timeout else None
        for i, traces, cpus, child, out, started in running:
            try:
                rc = child.wait(timeout=max(0.0, deadline - time.monotonic())
                                if deadline else None)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
                rc = "timeout"
            out.seek(0)
            try:
                report = json.load(out)
            except ValueError:
                report = None
            out.close()
            lanes.append({"traces": [t["name"] for t in traces],
                          "cpus": sorted(cpus) if cpus else None, "rc": rc,
                          "seconds": round(time.monotonic() - started, 1)})
            if rc == 0 and report:
                rows += report["rows"]
                first = first or report
    if first is None:
        print("corpus lanes: no lane finished", file=sys.stderr)
        return 1
    order = {t["name"]: i for i, t in enumerate(manifest["traces"])}
    rows.sort(key=lambda r: order[r["name"]])
    merged = dict(first, directory=os.path.abspath(args.corpus), rows=rows,
                  summary=_summary(rows, first["columns"]), lanes=lanes)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(merged, f, indent=1)
    for lane in lanes:
        print(f"lane {', '.join(lane['traces'])}: CPUs {lane['cpus']}, exit {lane['rc']}, "
              f"{lane['seconds']} s")
    return 0 if all(lane["rc"] == 0 for lane in lanes) else 1


if __name__ == "__main__":
    sys.exit(main())
