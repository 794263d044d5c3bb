"""What a cudaMemPool holds on the device for the allocations it hands out.

    python bench/driver_granularity.py [--out FILE.json]

The default path takes each segment from a cudaMemPool with ``cuMemAllocFromPoolAsync``; the
driver backs those allocations with chunks of its own choosing, so the device may hold more
than the pool reserves (an earlier run (bench/results/ in git history): 1.084 / 1.119 of peak live on
the shipped traces against the pool's own 1.036 / 1.041). This probe measures the chunking
directly, on a fresh cudaMemPool per case that keeps every freed byte:

- *one allocation*: the device memory held for a single allocation of each size;
- *a run of allocations*: N allocations of one size in a row, and what the device holds
  after each (does the driver pack several into one chunk?);
- *free then grow*: an allocation freed, then a larger one on the same stream (does the
  driver reuse the freed chunk, or add one?).

Prints one table per case; ``--out`` writes them as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from mempool import _cuda  # noqa: E402

MiB = 1 << 20
SIZES_MIB = (1, 2, 3, 4, 6, 8, 12, 16, 20, 24, 30, 32, 34, 40, 48, 64, 96, 100, 128, 200, 256)


def _fresh_pool():
    handle, _ = _cuda.resolve_pool_handle("create", 0)
    _cuda.configure(handle, release_threshold=_cuda.KEEP_ALL)
    return handle


def _alloc(rt, handle, nbytes, stream):
    return int(_cuda._call("allocating", rt.mallocFromPoolAsync, nbytes, handle, stream))


def _held(handle):
    a = _cuda.attributes(handle)
    return a["reserved_current"], a["used_current"]


def one_allocation(rt, stream):
    rows = []
    for mib in SIZES_MIB:
        h = _fresh_pool()
        try:
            p = _alloc(rt, h, mib * MiB, stream)
            reserved, used = _held(h)
            rt.freeAsync(p, stream)
            rt.streamSynchronize(stream)
        finally:
            _cuda.destroy(h)
        rows.append({"size_mib": mib, "reserved_mib": reserved / MiB, "used_mib": used / MiB})
    return rows


def a_run_of_allocations(rt, stream, count=8):
    rows = []
    for mib in (2, 4, 6, 12, 20, 40):
        h = _fresh_pool()
        held = []
        ptrs = []
        try:
            for _ in range(count):
                ptrs.append(_alloc(rt, h, mib * MiB, stream))
                held.append(_held(h)[0] / MiB)
            for p in ptrs:
                rt.freeAsync(p, stream)
            rt.streamSynchronize(stream)
        finally:
            _cuda.destroy(h)
        rows.append({"size_mib": mib, "reserved_after_each_mib": held})
    return rows


def free_then_grow(rt, stream):
    rows = []
    for first, second in ((20, 40), (32, 64), (40, 60), (64, 96), (96, 128)):
        h = _fresh_pool()
        try:
            p = _alloc(rt, h, first * MiB, stream)
            rt.freeAsync(p, stream)
            q = _alloc(rt, h, second * MiB, stream)
            same_stream = _held(h)[0] / MiB
            rt.freeAsync(q, stream)
            rt.streamSynchronize(stream)
        finally:
            _cuda.destroy(h)
        rows.append({"first_mib": first, "second_mib": second,
                     "reserved_mib": same_stream})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the tables as JSON here")
    args = ap.parse_args(argv)
    if not _cuda.available():
        print("needs a CUDA device, CuPy and the CUDA driver", file=sys.stderr)
        return 2
    import cupy

    rt = cupy.cuda.runtime
    stream = cupy.cuda.Stream(non_blocking=True)
    s = stream.ptr
    result = {
        "one_allocation": one_allocation(rt, s),
        "a_run_of_allocations": a_run_of_allocations(rt, s),
        "free_then_grow": free_then_grow(rt, s),
    }
    print("one allocation on a fresh cudaMemPool: size -> device memory held (MiB)")
    for r in result["one_allocation"]:
        print(f"  {r['size_mib']:>5} -> {r['reserved_mib']:>8.1f}  (used {r['used_mib']:.1f})")
    print("eight allocations of one size: device memory held after each (MiB)")
    for r in result["a_run_of_allocations"]:
        held = " ".join(f"{x:g}" for x in r["reserved_after_each_mib"])
        print(f"  {r['size_mib']:>5}: {held}")
    print("free one, then a larger one on the same stream: device memory held (MiB)")
    for r in result["free_then_grow"]:
        print(f"  {r['first_mib']:>4} then {r['second_mib']:>4} -> {r['reserved_mib']:g}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
