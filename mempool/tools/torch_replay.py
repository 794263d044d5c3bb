"""Replay a trace through PyTorch's caching allocator, in this process.

PyTorch reads ``PYTORCH_CUDA_ALLOC_CONF`` once, when CUDA starts, so each of its settings is
replayed in a process of its own: ``python -m mempool replay --compare`` and ``--corpus``
run :func:`replay` in a child of mempool.tools.corpus_processes with the variable set, and
bench/fragmentation_gpu.py in a worker of its own. Every alloc and free of
the trace goes through ``torch.cuda.caching_allocator_alloc``/``_delete`` against device
memory (no kernels), on one CUDA stream per stream of the trace, and the result has the
figures ``mempool.tools.replay`` reports for mempool's own replays: peak reserved / peak live,
ns per event, and the upstream calls per training step (PyTorch's ``num_device_alloc`` +
``num_device_free``; with expandable segments, its page maps and unmaps).

The trace's empty_cache calls are replayed as ``torch.cuda.empty_cache()``, and so are its
trims to 0 (they give back every cached byte). PyTorch has no trim to N bytes: a trim that
keeps some is skipped, and the result counts it in ``trims_skipped``.
"""
from __future__ import annotations

import time

from mempool.tools import replay as rp
from mempool.tools import trace as mtrace

__all__ = ["replay"]


def replay(trace) -> dict:
    """Replay in this process through PyTorch's caching allocator (its conf from the env).

    `trace` is a trace file or what :func:`mempool.tools.replay.prepare` takes. The cache is
    emptied before and after, so that several replays in one process (one per batch size in
    bench/largest_batch.py) each start from an empty allocator, as a fresh process would.
    """
    import torch

    prep = rp.prepare(mtrace.load_any(trace) if isinstance(trace, str) else trace)
    streams = [None] + [torch.cuda.Stream() for _ in prep.streams[1:]]
    alloc, delete = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    ptrs = [0] * prep.nslots
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    ooms = 0
    # Upstream calls per training step: the allocator's device allocs and frees (with
    # expandable segments, its page maps and unmaps), read between steps, outside the timing.
    starts = set(prep.step_ops or ())
    # The program's empty_cache calls and trims to 0 come before these ops: checked with the
    # step starts, one lookup per op for both.
    empties = set(rp.emptying_ops(prep))
    marks_at = starts | empties
    marks = []
    elapsed = 0
    t0 = time.perf_counter_ns()
    for i, (slot, n, s) in enumerate(prep.ops):
        if i in marks_at:
            if i in starts:
                elapsed += time.perf_counter_ns() - t0
                st = torch.cuda.memory_stats()
                marks.append(st.get("num_device_alloc", 0) + st.get("num_device_free", 0))
                t0 = time.perf_counter_ns()
            if i in empties:       # in the step it begins, as the replay on the pool counts it
                torch.cuda.empty_cache()
        if n:
            try:
                ptrs[slot] = alloc(n, 0, streams[s])
            except torch.OutOfMemoryError:
                ooms += 1
        elif ptrs[slot]:
            delete(ptrs[slot])
            ptrs[slot] = 0
    elapsed += time.perf_counter_ns() - t0
    st = torch.cuda.memory_stats()
    marks.append(st.get("num_device_alloc", 0) + st.get("num_device_free", 0))
    for p in ptrs:                     # a trace cut short leaves buffers live
        if p:
            delete(p)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return {"peak_reserved_bytes": st["reserved_bytes.all.peak"],
            "peak_allocated_bytes": st["allocated_bytes.all.peak"],
            "peak_live_bytes": prep.peak_live_bytes, "num_ooms": ooms,
            "ns_per_event": elapsed / len(prep.ops),
            "ratio": st["reserved_bytes.all.peak"] / prep.peak_live_bytes,
            "num_device_alloc": st.get("num_device_alloc"),
            "num_device_free": st.get("num_device_free"),
            "calls_per_step": [b - a for a, b in zip(marks, marks[1:])] if starts else None,
            "trims_skipped": rp.partial_trims(prep)}

