"""Does a recorded run replay on sim to what the device held?

    python bench/replay_check.py OUTDIR/workloads.json [SNAPSHOT_DIR]

For every row of `bench/torch_workloads.py --snapshot` run under one of mempool's allocators,
replays the row's snapshot on the simulated device with that allocator's options and cuda's
defaults where the options say nothing (expandable segments' 8 MiB page, the default path's
32 MiB segment rounding) and prints the device's peak reserved bytes
(`torch.cuda.max_memory_reserved()` of that process: the pool's own, not its cudaMemPool's)
beside the replay's, with the program's empty_cache calls the snapshot shows
(docs/traces.md). The two should be equal to the byte; a difference means the replay is not
the device's run, and a study on sim of that run would not hold on the device.
SNAPSHOT_DIR defaults to the JSON file's directory. Prints; asserts nothing.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mempool.tools import replay as mreplay  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402
from torch_workloads import MEMPOOL_OPTIONS  # noqa: E402  (stdlib only at import)

# cuda's defaults that sim's differ from (mempool/_config.py): the page of expandable
# segments, and the default path's segment rounding (Note [The cudaMemPool's unit]).
CUDA_PAGE = "8MiB"
CUDA_SEGMENT_ROUNDING = "32MiB"


def sim_options(allocator: str) -> dict:
    """The Pool options of `allocator` for a replay on sim that behaves as cuda's pool."""
    options = dict(MEMPOOL_OPTIONS[allocator])
    if options.get("expandable_segments"):
        options.setdefault("granularity", CUDA_PAGE)
    else:
        options.setdefault("segment_rounding", CUDA_SEGMENT_ROUNDING)
    return options


def check(rows, snapshot_dir):
    """One dict per mempool row that has a snapshot."""
    out = []
    for row in rows:
        allocator, snap = row.get("allocator"), row.get("snapshot")
        if not snap or allocator not in MEMPOOL_OPTIONS:
            continue
        events = mtrace.from_torch_snapshot(os.path.join(snapshot_dir, snap))
        r = mreplay.replay(events, conf=sim_options(allocator))
        device = row.get("peak_reserved")
        out.append({"workload": row.get("workload"), "allocator": allocator, "snapshot": snap,
                    "device_peak_reserved": device, "sim_peak_reserved": r.peak_reserved_bytes,
                    "empty_cache_calls": r.empty_cache_calls,
                    "equal": device == r.peak_reserved_bytes})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workloads_json")
    ap.add_argument("snapshot_dir", nargs="?")
    args = ap.parse_args(argv)
    with open(args.workloads_json) as f:
        rows = json.load(f)["rows"]
    results = check(rows, args.snapshot_dir or os.path.dirname(args.workloads_json))
    if not results:
        print("no mempool row with a snapshot")
    for c in results:
        diff = c["sim_peak_reserved"] - (c["device_peak_reserved"] or 0)
        print(f"{c['workload']} {c['allocator']}: device {c['device_peak_reserved']:,} bytes, "
              f"sim {c['sim_peak_reserved']:,} ({diff:+,}; {c['empty_cache_calls']} "
              f"empty_cache calls): {'equal' if c['equal'] else 'NOT the device run'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
