"""The allocators the latency suite compares, each behind one small interface.

A contender is opened for one benchmark and closed after it. It gives loops that run a
number of allocate/free pairs (``fixed_loop``) or steps of a seeded mix with a fixed number
of blocks live (``mix_loop``); the loops are tight Python ``for`` loops over bound methods,
so every contender pays the same interpreter overhead as a user's code would.

Anything not installed, or needing a GPU that is absent, is skipped with the reason:
nothing here stands in for a missing allocator.
"""
import functools

import pytest

from .benchkit import SIM_CAPACITY, require_gpu


class Contender:
    """An opened allocator: ``alloc(nbytes) -> handle`` and ``free(handle)``.

    ``free`` is None when dropping the handle frees the block (CuPy ``MemoryPointer``,
    tensors, RMM buffers): the loops then just let go of the handle, as user code does.
    """

    def __init__(self, alloc, free=None, *, close=None, check=None, info=None, fixed=None,
                 mix=None):
        self.alloc = alloc
        self.free = free
        self._close = close
        self._check = check
        self._info = info
        self._fixed = fixed       # a compiled loop, fixed(nbytes) -> loop(pairs)
        self._mix = mix           # a compiled loop, mix(sizes, live) -> (loop, release)
        self._ring = None
        self._release_ring = None

    def fixed_loop(self, nbytes):
        """A callable running ``pairs`` allocate+free pairs of ``nbytes``."""
        if self._fixed is not None:
            return self._fixed(nbytes)
        alloc, free = self.alloc, self.free
        if free is None:
            def loop(pairs):
                for _ in range(pairs):
                    alloc(nbytes)
        else:
            def loop(pairs):
                for _ in range(pairs):
                    free(alloc(nbytes))
        return loop

    def mix_loop(self, sizes, live):
        """A callable running one step per entry of ``sizes`` with ``live`` blocks held.

        Step k allocates ``sizes[k]`` and frees the block allocated ``live`` steps before.
        The ring of live blocks is filled here and kept between calls, so each timed round
        sees the steady state; :meth:`release` frees it.
        """
        if self._mix is not None:
            loop, self._release_ring = self._mix(sizes, live)
            return loop
        alloc, free = self.alloc, self.free
        ring = self._ring = [alloc(sizes[k % len(sizes)]) for k in range(live)]
        plan = [(nbytes, k % live) for k, nbytes in enumerate(sizes)]
        if free is None:
            def loop(pairs):
                for nbytes, slot in plan:
                    ring[slot] = alloc(nbytes)
        else:
            def loop(pairs):
                for nbytes, slot in plan:
                    ptr = alloc(nbytes)
                    old = ring[slot]
                    ring[slot] = ptr
                    free(old)
        return loop

    def release(self):
        """Free the blocks a mix loop holds."""
        if self._release_ring is not None:
            release, self._release_ring = self._release_ring, None
            release()
        if self._ring is not None:
            ring, self._ring = self._ring, None
            if self.free is not None:
                for handle in ring:
                    self.free(handle)
            ring.clear()

    def check(self):
        """Assert that the allocator is back where it started (nothing leaked)."""
        if self._check is not None:
            self._check()

    def info(self):
        """Figures worth keeping beside the timing (e.g. reserved bytes)."""
        return dict(self._info()) if self._info is not None else {}

    def close(self):
        self.release()
        if self._close is not None:
            self._close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# ---------------------------------------------------------------------------------- mempool

def new_pool(backend, **options):
    """A fresh mempool.Pool on `backend` ("sim", "host" or "cuda")."""
    import mempool

    if backend == "cuda":
        require_gpu()
        return mempool.Pool(backend="cuda", device=0, **options)
    if backend == "sim":
        # Sim addresses are fake: a large capacity costs nothing and fits the 10^6-block runs.
        options.setdefault("capacity", SIM_CAPACITY)
    return mempool.Pool(backend=backend, **options)


def pool_check(pool):
    """A check that `pool` holds exactly the blocks it held when this was called."""
    base = pool.used_bytes()

    def check():
        pool.check_invariants()
        assert pool.used_bytes() == base, (
            f"{pool.used_bytes() - base} bytes still in use after the loop")
    return check


def pool_info(pool):
    return lambda: {"reserved_bytes": pool.reserved_bytes(), "cached_bytes": pool.cached_bytes()}


def pool_close(pool):
    def close():
        pool.empty_cache()
    return close


def mempool_raw(backend):
    pool = new_pool(backend)
    return Contender(pool.alloc, pool.free, check=pool_check(pool), info=pool_info(pool),
                     close=pool_close(pool))


def mempool_raw_on_stream():
    """``pool.alloc(n, stream)`` + ``pool.free(p)`` on a CuPy stream the caller names: no
    lookup of CuPy's current stream (the stream object named last costs one identity
    compare), which is what ``stream=None`` pays on a cuda pool."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    pool = new_pool("cuda")
    stream = cupy.cuda.Stream(non_blocking=True)
    alloc, free = pool.alloc, pool.free

    def fixed(nbytes):
        def loop(pairs):
            for _ in range(pairs):
                free(alloc(nbytes, stream))
        return loop

    def mix(sizes, live):
        pytest.skip("the stream-passed row has no mix variant")

    return Contender(alloc, free, fixed=fixed, mix=mix, check=pool_check(pool),
                     info=pool_info(pool), close=pool_close(pool))


def mempool_cloop(backend):
    """mp_alloc + mp_free in a compiled loop: the core's own cost, no interpreter."""
    import numpy as np
    from mempool import _core

    pool = new_pool(backend)

    def fixed(nbytes):
        return lambda pairs: _core.bench_core_roundtrips(pool, nbytes, pairs)

    def mix(sizes, live):
        arr = np.asarray(sizes, dtype=np.uint64)
        ring = np.zeros(live, dtype=np.uint64)

        def release():
            for slot in range(live):
                ptr, ring[slot] = int(ring[slot]), 0
                if ptr:
                    pool.free(ptr)
        return (lambda pairs: _core.bench_core_mix(pool, arr, ring)), release

    return Contender(pool.alloc, pool.free, fixed=fixed, mix=mix, check=pool_check(pool),
                     info=pool_info(pool), close=pool_close(pool))


def mempool_malloc(backend):
    """The CuPy hook: ``pool.malloc(n)`` returns a MemoryPointer; dropping it frees."""
    pytest.importorskip("cupy", reason="CuPy is not installed (the hook returns CuPy "
                                       "MemoryPointers)")
    pool = new_pool(backend)
    return Contender(pool.malloc, check=pool_check(pool), info=pool_info(pool),
                     close=pool_close(pool))


def mempool_cupy_empty(backend):
    """``cupy.empty`` with ``cupy.cuda.set_allocator(pool.malloc)``."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    pool = new_pool(backend)
    previous = cupy.cuda.get_allocator()
    cupy.cuda.set_allocator(pool.malloc)

    def close():
        cupy.cuda.set_allocator(previous)
        pool.empty_cache()
    return Contender(functools.partial(cupy.empty, dtype=cupy.uint8), check=pool_check(pool),
                     info=pool_info(pool), close=close)


def mempool_torch_entry(backend):
    """mempool's PyTorch pluggable-allocator entry points, called from a compiled loop.

    These are what PyTorch calls for every tensor under ``mempool.torch.install``; timing
    them through function pointers leaves PyTorch's own overhead out. On sim the pool is
    routed to its device number directly, as the entry points do not care what backs it.
    """
    from mempool import _core

    try:
        import mempool.torch as mtorch
    except ImportError as exc:
        pytest.skip(f"mempool.torch is not available: {exc}")
    addresses = mtorch.entry_points()
    pool = new_pool(backend)
    if backend == "cuda":
        mtorch.register(pool)
    else:
        _core._torch_register(pool.device_id, pool)
    alloc_fn, free_fn, device = addresses["alloc"], addresses["free"], pool.device_id

    def fixed(nbytes):
        return lambda pairs: _core.bench_fn_roundtrips(alloc_fn, free_fn, nbytes, pairs, device)

    def mix(sizes, live):
        pytest.skip("the function-pointer loop has no mix variant")

    def close():
        mtorch.unregister(device)
        pool.empty_cache()
    return Contender(pool.alloc, pool.free, fixed=fixed, mix=mix, check=pool_check(pool),
                     info=pool_info(pool), close=close)


def bare_call():
    """The floor: two calls of a cdef-class method per pair, in the shape ``free(alloc(n))``."""
    from mempool import _core

    call = _core.BareCall().call
    assert call(512) == 512
    return Contender(call, call)


def libc_cloop():
    """libc malloc/free behind the pluggable-allocator signatures, in the compiled loop."""
    from mempool import _core

    alloc_fn, free_fn = _core.bench_libc_fnptrs()

    def fixed(nbytes):
        return lambda pairs: _core.bench_fn_roundtrips(alloc_fn, free_fn, nbytes, pairs)

    def mix(sizes, live):
        pytest.skip("the function-pointer loop has no mix variant")
    return Contender(None, None, fixed=fixed, mix=mix)


# ------------------------------------------------------------------------------ CUDA runtime

def _cuda_runtime():
    require_gpu()
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    return cupy, cupy.cuda.runtime


def cuda_malloc():
    cupy, rt = _cuda_runtime()
    return Contender(rt.malloc, rt.free)


def cuda_malloc_async(threshold_max):
    """cudaMallocAsync/cudaFreeAsync on the device's default pool, on the null stream.

    With the release threshold at its maximum the pool keeps what is freed; at 0 with a
    stream sync after each free, the driver returns the memory every time.
    """
    cupy, rt = _cuda_runtime()
    dev = cupy.cuda.Device().id
    handle = rt.deviceGetDefaultMemPool(dev)
    attr = rt.cudaMemPoolAttrReleaseThreshold
    previous = rt.memPoolGetAttribute(handle, attr)
    rt.memPoolSetAttribute(handle, attr, (1 << 64) - 1 if threshold_max else 0)
    malloc_async, free_async, sync = rt.mallocAsync, rt.freeAsync, rt.streamSynchronize

    def alloc(nbytes):
        return malloc_async(nbytes, 0)

    if threshold_max:
        def free(ptr):
            free_async(ptr, 0)
    else:
        def free(ptr):
            free_async(ptr, 0)
            sync(0)

    def close():
        sync(0)
        rt.memPoolSetAttribute(handle, attr, previous)
        rt.memPoolTrimTo(handle, 0)

    def info():
        reserved = rt.memPoolGetAttribute(handle, rt.cudaMemPoolAttrReservedMemCurrent)
        return {"reserved_bytes": reserved}
    return Contender(alloc, free, close=close, info=info)


# ------------------------------------------------------------------------------------- CuPy

def cupy_memory_pool():
    cupy, _ = _cuda_runtime()
    pool = cupy.cuda.MemoryPool()

    def check():
        assert pool.used_bytes() == 0, f"{pool.used_bytes()} bytes still in use"
    return Contender(pool.malloc, check=check, close=pool.free_all_blocks,
                     info=lambda: {"reserved_bytes": pool.total_bytes()})


def cupy_memory_async_pool():
    cupy, _ = _cuda_runtime()
    pool = cupy.cuda.MemoryAsyncPool()
    return Contender(pool.malloc, close=pool.free_all_blocks)


def cupy_empty_default():
    cupy, _ = _cuda_runtime()
    previous = cupy.cuda.get_allocator()
    default = cupy.get_default_memory_pool()
    cupy.cuda.set_allocator(default.malloc)

    def close():
        cupy.cuda.set_allocator(previous)
        default.free_all_blocks()
    return Contender(functools.partial(cupy.empty, dtype=cupy.uint8), close=close,
                     info=lambda: {"reserved_bytes": default.total_bytes()})


# ---------------------------------------------------------------------------------- PyTorch

def torch_cuda():
    torch = pytest.importorskip("torch", reason="PyTorch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch sees no CUDA device (a CPU build, or no GPU)")
    return torch


def torch_check(torch):
    base = torch.cuda.memory_allocated()

    def check():
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == base, "PyTorch still holds blocks of the loop"
    return check


def torch_info(torch):
    return lambda: {"reserved_bytes": torch.cuda.memory_reserved()}


def torch_empty():
    torch = torch_cuda()
    alloc = functools.partial(torch.empty, dtype=torch.uint8, device="cuda")
    return Contender(alloc, check=torch_check(torch), info=torch_info(torch),
                     close=torch.cuda.empty_cache)


def torch_caching_allocator():
    torch = torch_cuda()
    return Contender(torch.cuda.caching_allocator_alloc, torch.cuda.caching_allocator_delete,
                     check=torch_check(torch), info=torch_info(torch),
                     close=torch.cuda.empty_cache)


# -------------------------------------------------------------------------------------- RMM

def _rmm():
    require_gpu()
    rmm = pytest.importorskip("rmm", reason="RMM is not installed")
    return rmm


def _rmm_buffer_contender(rmm, mr):
    """rmm.DeviceBuffer on `mr`: passed directly where DeviceBuffer takes ``mr``, else as
    the current device resource for the duration of the benchmark."""
    previous = None
    try:
        rmm.DeviceBuffer(size=512, mr=mr)

        def alloc(nbytes):
            return rmm.DeviceBuffer(size=nbytes, mr=mr)
    except TypeError:
        previous = rmm.mr.get_current_device_resource()
        rmm.mr.set_current_device_resource(mr)

        def alloc(nbytes):
            return rmm.DeviceBuffer(size=nbytes)

    def close():
        if previous is not None:
            rmm.mr.set_current_device_resource(previous)
    return Contender(alloc, close=close)


def rmm_pool_buffer():
    rmm = _rmm()
    mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=1 << 30)
    return _rmm_buffer_contender(rmm, mr)


def rmm_async_buffer():
    rmm = _rmm()
    return _rmm_buffer_contender(rmm, rmm.mr.CudaAsyncMemoryResource())


def rmm_pool_cupy_allocator():
    rmm = _rmm()
    try:
        from rmm.allocators.cupy import rmm_cupy_allocator
    except ImportError as exc:
        pytest.skip(f"rmm.allocators.cupy is not available: {exc}")
    mr = rmm.mr.PoolMemoryResource(rmm.mr.CudaMemoryResource(), initial_pool_size=1 << 30)
    previous = rmm.mr.get_current_device_resource()
    rmm.mr.set_current_device_resource(mr)
    return Contender(rmm_cupy_allocator,
                     close=lambda: rmm.mr.set_current_device_resource(previous))


# -------------------------------------------------------------------------------- registry

class Entry:
    """One row of the latency table: an id for pytest, a label for people, a factory."""

    def __init__(self, cid, label, factory, *, gpu=False, backend=None, ref=None):
        self.cid = cid
        self.label = label
        self.factory = factory
        self.gpu = gpu
        self.backend = backend
        self.ref = ref            # rank as the mempool reference of ratios (lower wins)

    def open(self):
        return self.factory()


P = functools.partial
LATENCY = [
    Entry("floor", "bare C-method call x2 (floor)", bare_call),
    Entry("mempool-sim", "mempool alloc/free (sim)", P(mempool_raw, "sim"), backend="sim", ref=1),
    Entry("mempool-host", "mempool alloc/free (host)", P(mempool_raw, "host"), backend="host"),
    Entry("mempool-cuda", "mempool alloc/free (cuda)", P(mempool_raw, "cuda"), gpu=True,
          backend="cuda", ref=0),
    Entry("mempool-cuda-stream", "mempool alloc/free (cuda, a CuPy stream passed)",
          mempool_raw_on_stream, gpu=True, backend="cuda"),
    Entry("cloop-sim", "mempool C loop (sim)", P(mempool_cloop, "sim"), backend="sim"),
    Entry("cloop-host", "mempool C loop (host)", P(mempool_cloop, "host"), backend="host"),
    Entry("cloop-cuda", "mempool C loop (cuda)", P(mempool_cloop, "cuda"), gpu=True,
          backend="cuda"),
    Entry("torchentry-sim", "mempool torch entry points, C loop (sim)",
          P(mempool_torch_entry, "sim"), backend="sim"),
    Entry("torchentry-cuda", "mempool torch entry points, C loop (cuda)",
          P(mempool_torch_entry, "cuda"), gpu=True, backend="cuda"),
    Entry("libc-cloop", "libc malloc/free, C loop (reference)", libc_cloop),
    Entry("mempool-malloc-sim", "mempool.malloc + del (sim)", P(mempool_malloc, "sim"),
          backend="sim"),
    Entry("mempool-malloc-cuda", "mempool.malloc + del (cuda)", P(mempool_malloc, "cuda"),
          gpu=True, backend="cuda"),
    Entry("mempool-cupy-empty", "cupy.empty on mempool (cuda)", P(mempool_cupy_empty, "cuda"),
          gpu=True, backend="cuda"),
    Entry("cudaMalloc", "cudaMalloc + cudaFree", cuda_malloc, gpu=True),
    Entry("cudaMallocAsync-max", "cudaMallocAsync, release threshold max",
          P(cuda_malloc_async, True), gpu=True),
    Entry("cudaMallocAsync-0-sync", "cudaMallocAsync, threshold 0 + stream sync",
          P(cuda_malloc_async, False), gpu=True),
    Entry("cupy-pool", "CuPy MemoryPool.malloc + del", cupy_memory_pool, gpu=True),
    Entry("cupy-async-pool", "CuPy MemoryAsyncPool.malloc + del", cupy_memory_async_pool,
          gpu=True),
    Entry("cupy-empty", "cupy.empty (default pool)", cupy_empty_default, gpu=True),
    Entry("torch-empty", "torch.empty (caching allocator)", torch_empty, gpu=True),
    Entry("torch-caching", "torch caching_allocator_alloc + delete", torch_caching_allocator,
          gpu=True),
    Entry("rmm-pool", "RMM PoolMemoryResource DeviceBuffer", rmm_pool_buffer, gpu=True),
    Entry("rmm-pool-cupy", "RMM pool via rmm_cupy_allocator", rmm_pool_cupy_allocator,
          gpu=True),
    Entry("rmm-async", "RMM CudaAsyncMemoryResource DeviceBuffer", rmm_async_buffer, gpu=True),
]
BY_ID = {e.cid: e for e in LATENCY}
