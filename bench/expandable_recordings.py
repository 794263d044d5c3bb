"""Expandable segments on every recorded run and shipped trace, replayed on sim.

    python bench/expandable_recordings.py [--conf CONF] [--json OUT]

Replays, with cuda's 8 MiB pages (or CONF, a PyTorch-style string), each snapshot a GPU run
recorded under mempool's or PyTorch's expandable segments in tests/data/recordings/ (the program's
requests, whichever allocator served them; docs/traces.md) and the shipped traces, and
prints per input the peak reserved bytes, peak reserved / peak live, the physical
allocations, unmaps and stream syncs of the whole replay. A rule of the expandable core
(docs/expandable.md) is judged on all of them at once: a change that helps one recording
and costs another shows here. --json writes the rows.
"""
import argparse
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)

from mempool.tools import replay as mreplay  # noqa: E402
from mempool.tools import trace as mtrace  # noqa: E402
from mempool.cli.trace import TRACES_DIR  # noqa: E402

CUDA_PAGES = "expandable_segments:True,granularity:8MiB"
# One recording per program run: the allocator that served it does not change its requests.
RECORDINGS = ["snapshot-*.pickle.gz"]   # tests/data/recordings/: one per program run


def inputs():
    paths = []
    for pattern in RECORDINGS:
        paths += sorted(glob.glob(os.path.join(os.path.dirname(HERE), "tests", "data", "recordings", pattern)))
    return paths + sorted(glob.glob(os.path.join(TRACES_DIR, "*.jsonl*")))


def row(path, conf):
    r = mreplay.replay(mtrace.load_any(path), conf=conf)   # a snapshot pickle or a trace
    return {"input": os.path.basename(path), "peak_reserved": r.peak_reserved_bytes,
            "ratio": r.peak_reserved_bytes / r.peak_live_bytes,
            "physical_allocations": r.num_device_alloc, "unmaps": r.num_device_free,
            "stream_syncs": (r.upstream or {}).get("stream_syncs")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--conf", default=CUDA_PAGES)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = [row(p, args.conf) for p in inputs()]
    for r in rows:
        print(f"{r['input']:60s} {r['peak_reserved'] / 2**20:9,.0f} MiB  {r['ratio']:.4f}  "
              f"allocations {r['physical_allocations']}  unmaps {r['unmaps']}  "
              f"syncs {r['stream_syncs']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
