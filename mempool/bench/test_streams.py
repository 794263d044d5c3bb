"""Streams: allocation spread over several streams, and blocks used on a second stream.

- ``spread``: pair i allocates on stream i mod k (k = 2, 4, 8) and frees on the block's own
  stream. k = 2 is free-on-one, allocate-on-the-other ping-pong. A pool that reuses across
  streams hands the one cached block from stream to stream through an event wait; one that
  does not (PyTorch, CuPy, mempool with ``cross_stream_reuse=False``) keeps a block per stream.
  extra_info keeps the reserved bytes after the loop, so the memory side of that trade shows.
- ``record_stream``: every block is allocated on stream A, declared used on stream B
  (mempool ``record_stream``, PyTorch ``Tensor.record_stream``), then freed: the free must wait
  for B's event before the block is reused.
"""
import pytest

from .benchkit import GPU_MARKS, ROUNDS, SIZES, measure, require_gpu
from .contenders import new_pool, torch_cuda

NBYTES = SIZES["64 KiB"]
STREAM_COUNTS = [2, 4, 8]


def _sim_streams(pool, k):
    # Sim stream handles are plain non-zero integers.
    return list(range(1, k + 1))


def _cupy_streams(k):
    import cupy

    return [cupy.cuda.Stream(non_blocking=True) for _ in range(k)]


class StreamBench:
    """An allocator that allocates on a given stream: a loop builder plus reporting."""

    def __init__(self, loop, *, info=None, close=None, check=None):
        self.loop = loop          # loop(plan) -> callable(pairs); plan: stream per pair
        self.info = info or (lambda pairs_run: {})   # info(pairs run in all) -> dict
        self.close = close or (lambda: None)
        self.check = check or (lambda: None)


def mempool_spread(backend, cross_stream_reuse=True):
    pool = new_pool(backend, cross_stream_reuse=cross_stream_reuse)
    keep = []

    def streams(k):
        if backend == "sim":
            return _sim_streams(pool, k)
        keep[:] = _cupy_streams(k)
        return [s.ptr for s in keep]

    alloc, free = pool.alloc, pool.free
    before = pool.stats()

    def loop(plan):
        def run(pairs):
            for s in plan:
                free(alloc(NBYTES, s))
        return run

    def info(pairs_run):
        stats = pool.stats()
        reuses = stats["num_cross_stream_reuse"] - before["num_cross_stream_reuse"]
        return {"reserved_bytes": pool.reserved_bytes(),
                "cross_stream_reuses_per_pair": reuses / pairs_run}

    bench = StreamBench(loop, info=info, close=pool.empty_cache,
                        check=lambda: pool.check_invariants())
    bench.streams = streams
    return bench


def torch_spread():
    torch = torch_cuda()
    keep = []
    alloc, free = torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete
    dev = torch.cuda.current_device()

    def streams(k):
        keep[:] = [torch.cuda.Stream() for _ in range(k)]
        return [s.cuda_stream for s in keep]

    def loop(plan):
        def run(pairs):
            for s in plan:
                free(alloc(NBYTES, dev, s))
        return run

    bench = StreamBench(loop, info=lambda _: {"reserved_bytes": torch.cuda.memory_reserved()},
                        close=torch.cuda.empty_cache)
    bench.streams = streams
    return bench


def cupy_spread():
    require_gpu()
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    pool = cupy.cuda.MemoryPool()
    malloc = pool.malloc

    def streams(k):
        return _cupy_streams(k)

    def loop(plan):
        # CuPy's pool allocates on the current stream: switching it is part of the cost.
        uses = [s.use for s in plan]

        def run(pairs):
            for use in uses:
                use()
                malloc(NBYTES)
            cupy.cuda.Stream.null.use()
        return run

    def close():
        cupy.cuda.Stream.null.use()
        pool.free_all_blocks()

    bench = StreamBench(loop, info=lambda _: {"reserved_bytes": pool.total_bytes()}, close=close)
    bench.streams = streams
    return bench


def malloc_async_spread():
    require_gpu()
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    rt = cupy.cuda.runtime
    handle = rt.deviceGetDefaultMemPool(cupy.cuda.Device().id)
    attr = rt.cudaMemPoolAttrReleaseThreshold
    previous = rt.memPoolGetAttribute(handle, attr)
    rt.memPoolSetAttribute(handle, attr, (1 << 64) - 1)
    keep = []
    malloc_async, free_async = rt.mallocAsync, rt.freeAsync

    def streams(k):
        keep[:] = _cupy_streams(k)
        return [s.ptr for s in keep]

    def loop(plan):
        def run(pairs):
            for s in plan:
                free_async(malloc_async(NBYTES, s), s)
        return run

    def close():
        rt.deviceSynchronize()
        rt.memPoolSetAttribute(handle, attr, previous)
        rt.memPoolTrimTo(handle, 0)

    bench = StreamBench(loop, close=close, info=lambda _: {
        "reserved_bytes": rt.memPoolGetAttribute(handle, rt.cudaMemPoolAttrReservedMemCurrent)})
    bench.streams = streams
    return bench


SPREAD = [
    ("mempool-sim", "mempool alloc/free (sim)", lambda: mempool_spread("sim"), False, 1),
    ("mempool-sim-noreuse", "mempool (sim), cross_stream_reuse=False",
     lambda: mempool_spread("sim", False), False, None),
    ("mempool-cuda", "mempool alloc/free (cuda)", lambda: mempool_spread("cuda"), True, 0),
    ("mempool-cuda-noreuse", "mempool (cuda), cross_stream_reuse=False",
     lambda: mempool_spread("cuda", False), True, None),
    ("torch-caching", "torch caching_allocator_alloc + delete", torch_spread, True, None),
    ("cupy-pool", "CuPy MemoryPool.malloc + del (Stream.use)", cupy_spread, True, None),
    ("cudaMallocAsync-max", "cudaMallocAsync, release threshold max", malloc_async_spread,
     True, None),
]


@pytest.mark.parametrize("k", STREAM_COUNTS, ids=[f"{k}streams" for k in STREAM_COUNTS])
@pytest.mark.parametrize("cid,label,factory,gpu,ref", [
    pytest.param(*row, id=row[0], marks=GPU_MARKS if row[3] else ()) for row in SPREAD])
def test_spread(benchmark, pairs, k, cid, label, factory, gpu, ref):
    bench = factory()
    try:
        streams = bench.streams(k)
        plan = [streams[i % k] for i in range(pairs)]
        column = f"{k} streams" + (" (ping-pong)" if k == 2 else "")
        measure(benchmark, bench.loop(plan), pairs, section="streams", row=label,
                column=column, order=k, ref=ref, nbytes=NBYTES)
        pairs_run = pairs * (1 if benchmark.disabled else ROUNDS + 1)   # warm-up included
        benchmark.extra_info.update(bench.info(pairs_run))
        bench.check()
    finally:
        bench.close()


def mempool_record_stream(backend):
    pool = new_pool(backend)
    # The stream objects must outlive the pool's use of them: close() drops them.
    keep = [] if backend == "sim" else _cupy_streams(2)
    a, b = _sim_streams(pool, 2) if backend == "sim" else (s.ptr for s in keep)
    alloc, record, free = pool.alloc, pool.record_stream, pool.free

    def run(pairs):
        for _ in range(pairs):
            ptr = alloc(NBYTES, a)
            record(ptr, b)
            free(ptr)

    def close():
        pool.empty_cache()
        keep.clear()
    return run, (lambda: {"reserved_bytes": pool.reserved_bytes()}), close


def torch_record_stream():
    torch = torch_cuda()
    keep = [torch.cuda.Stream(), torch.cuda.Stream()]
    a, b = keep
    empty, uint8 = torch.empty, torch.uint8

    def run(pairs):
        with torch.cuda.stream(a):
            for _ in range(pairs):
                empty(NBYTES, dtype=uint8, device="cuda").record_stream(b)

    def close():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        keep.clear()
    return run, (lambda: {"reserved_bytes": torch.cuda.memory_reserved()}), close


RECORD = [
    ("mempool-sim", "mempool alloc/record_stream/free (sim)",
     lambda: mempool_record_stream("sim"), False, 1),
    ("mempool-cuda", "mempool alloc/record_stream/free (cuda)",
     lambda: mempool_record_stream("cuda"), True, 0),
    ("torch-empty", "torch.empty + Tensor.record_stream", torch_record_stream, True, None),
]


@pytest.mark.parametrize("cid,label,factory,gpu,ref", [
    pytest.param(*row, id=row[0], marks=GPU_MARKS if row[3] else ()) for row in RECORD])
def test_record_stream(benchmark, pairs, cid, label, factory, gpu, ref):
    run, info, close = factory()
    try:
        measure(benchmark, run, pairs, section="streams", row=label,
                column="used on a 2nd stream", order=100, ref=ref, nbytes=NBYTES)
        benchmark.extra_info.update(info())
    finally:
        close()
