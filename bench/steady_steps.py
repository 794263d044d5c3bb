"""Upstream calls per training step of a recorded GPT run, replayed on sim under any setting.

    python bench/steady_steps.py SNAPSHOT [--conf C ...] [--steps 30] [--warmup 16] [--order-seed 1]

SNAPSHOT is what `bench/torch_workloads.py --workloads gpt-bucketed --snapshot` (or
llama-bucketed, with the same --steps and --order-seed) recorded on a GPU (PyTorch's
snapshot format). A snapshot carries no step marks, so the steps are found
by the first tensor of each: its input ids, 8 x L int64, L as `gpt_lengths` planned them.
Each --conf is replayed on the simulated device, and the script prints peak reserved / peak
live, the physical allocations and unmaps of the whole run, and those of the timed steps
(after the warm-up) with their stream syncs: a steady state makes none.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from mempool.tools import replay as mreplay  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402
from torch_workloads import gpt_lengths  # noqa: E402  (stdlib only at import)

BATCH = 8               # sequences per GPT step (torch_workloads.run_gpt)
IDS_BYTES = 8 * BATCH   # bytes of input ids per token of L
MIN_STEP_EVENTS = 500   # a step makes far more events: a later match is the next step's


def step_starts(events, lengths):
    """Index of each step's first event: the allocation of its input ids. The first step's
    is the last such allocation before the first free (the model's parameters, some of
    the same size, all come before it; the first step's forward frees soon after); each
    later step's is the first at least MIN_STEP_EVENTS after the step before. Raises
    ValueError when not every step is found."""
    def ids(e, step):
        return e.action == "alloc" and e.nbytes == IDS_BYTES * lengths[step]

    first_free = next((i for i, e in enumerate(events) if e.action == "free"), len(events))
    first = [i for i in range(first_free) if ids(events[i], 0)] if lengths else []
    starts = first[-1:]
    for i in range(starts[0] + MIN_STEP_EVENTS if starts else len(events), len(events)):
        if len(starts) == len(lengths):
            break
        if i >= starts[-1] + MIN_STEP_EVENTS and ids(events[i], len(starts)):
            starts.append(i)
    if len(starts) != len(lengths):
        raise ValueError(f"found {len(starts)} of {len(lengths)} steps: is this a gpt-bucketed "
                         f"or llama-bucketed snapshot with these --steps, --warmup and "
                         f"--order-seed?")
    return starts


def summarize(events, conf, warmup):
    r = mreplay.replay(events, conf=conf)
    timed = r.steps[warmup:]   # r.setup: the model's parameters, before the first step
    total = lambda steps, key: sum(s.get(key, 0) for s in steps)  # noqa: E731
    return {"conf": conf, "ratio": r.ratio, "peak_reserved_bytes": r.peak_reserved_bytes,
            "device_alloc": r.num_device_alloc, "device_free": r.num_device_free,
            "timed_device_alloc": total(timed, "device_alloc"),
            "timed_device_free": total(timed, "device_free"),
            "timed_stream_syncs": total(timed, "stream_syncs"),
            "per_step": [{k: v for k, v in s.items() if v and k in
                          ("device_alloc", "device_free", "stream_syncs")}
                         for s in [r.setup, *r.steps]]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot")
    ap.add_argument("--conf", action="append",
                    help="a pool setting to replay under (repeatable; default: expandable "
                         "segments with cuda's 8 MiB pages, and cuda's default path)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps of the run (30)")
    ap.add_argument("--warmup", type=int, default=16, help="warm-up steps of the run (16)")
    ap.add_argument("--order-seed", type=int, default=1,
                    help="the run's --order-seed (1)")
    ap.add_argument("--per-step", action="store_true", help="also print each step's calls")
    args = ap.parse_args(argv)
    events = mtrace.load_any(args.snapshot)
    lengths = gpt_lengths(args.steps, args.warmup, bucketed=True, seed=args.order_seed)
    events.meta["step_starts"] = step_starts(events, lengths)
    confs = args.conf or ["expandable_segments:True,granularity:8MiB", "segment_rounding:32MiB"]
    print(f"{len(events)} events, {len(lengths)} steps ({args.warmup} warm-up)")
    for conf in confs:
        s = summarize(events, conf, args.warmup)
        print(f"{conf:60s} reserved/live {s['ratio']:.4f}  allocations {s['device_alloc']}, "
              f"unmaps/frees {s['device_free']}; timed steps: {s['timed_device_alloc']} / "
              f"{s['timed_device_free']}, syncs {s['timed_stream_syncs']}")
        if args.per_step:
            for i, calls in enumerate(s["per_step"]):
                label = "set-up" if i == 0 else f"step {i - 1} (L={lengths[i - 1]})"
                print(f"    {label:18s} {calls}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
