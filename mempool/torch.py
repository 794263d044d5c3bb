"""PyTorch on a mempool pool: the pluggable allocator, MemPools, and DLPack hand-off.

Three ways to share one pool with PyTorch, from most to least invasive:

``install(pool)``
    Make the pool PyTorch's CUDA allocator for the whole process
    (``torch.cuda.memory.change_current_allocator``). Every CUDA tensor then comes from the
    pool and PyTorch keeps no cache of its own. Must run before PyTorch touches CUDA.
    ``torch.cuda.empty_cache()`` releases the pool's cached memory,
    ``torch.cuda.set_per_process_memory_fraction(f)`` sets the pool's limit to f x capacity,
    ``Tensor.record_stream(s)`` declares a use on another stream. PyTorch's own
    ``memory_stats()`` is not available under a pluggable allocator: read ``pool.stats()``.
    Caveats: PyTorch does not check the pluggable allocator's result, so an out-of-memory
    returns a NULL tensor (mempool prints the reason on stderr) rather than raising
    ``torch.OutOfMemoryError``; set the pool's limit with headroom, or use ``mem_pool``.
    CUDA graph capture's private pools are not supported under a pluggable allocator.
``mem_pool(pool)``
    A ``torch.cuda.MemPool`` whose segments come from the pool, for
    ``with torch.cuda.use_mem_pool(mp): ...``. PyTorch's caching allocator still caches
    inside the MemPool (its reserved bytes are the pool's used bytes); allocations outside
    the context use PyTorch's default allocator. Out-of-memory raises as usual. Works at any
    time, also after PyTorch initialised CUDA.
``torch.from_dlpack(pool.empty(...))``
    Zero-copy hand-off of single buffers (see :class:`mempool.Buffer`).

The entry points PyTorch calls are C functions of the ``mempool._core`` extension (the
shared object at ``mempool._core.__file__``); they never take the GIL. This module imports
torch only when one of its functions is called.
"""
from mempool import _core

_HOOKS = ("record_stream", "reset", "memory_fraction", "base_alloc")
_SETTERS = {
    "record_stream": "set_record_stream_fn",
    "reset": "set_reset_fn",
    "memory_fraction": "set_memory_fraction_fn",
    "base_alloc": "set_base_alloc_fn",
}
_installed = None   # the CUDAPluggableAllocator given to change_current_allocator


def library_path():
    """Path of the shared object holding the entry points (``mempool._core.__file__``)."""
    return _core.__file__


def entry_points():
    """Addresses of the C entry points: {"alloc", "free", "record_stream", "reset",
    "memory_fraction", "base_alloc"} -> int."""
    return _core._torch_entry_points()


def _torch_cuda():
    try:
        import torch
    except ImportError:
        raise ImportError("mempool.torch needs PyTorch (pip install torch)") from None
    if not hasattr(torch._C, "_cuda_customAllocator"):
        raise RuntimeError("mempool.torch needs a CUDA build of PyTorch: this one "
                           f"({torch.__version__}) has no pluggable CUDA allocator")
    return torch


def _check_pool(pool):
    if not isinstance(pool, _core.Pool):
        raise TypeError(f"pool: expected a mempool.Pool, got {type(pool).__name__}")
    if pool.backend != "cuda":
        raise ValueError(f"pool: PyTorch needs device memory; this pool's backend is "
                         f"{pool.backend!r} (use Pool(backend='cuda'))")


def register(pool):
    """Route PyTorch's allocations on ``pool.device_id`` to `pool` (one pool per device;
    the allocator serves every registered device)."""
    _check_pool(pool)
    _core._torch_register(pool.device_id, pool)


def unregister(device):
    """Stop routing `device`. RuntimeError while PyTorch still holds blocks there."""
    _core._torch_unregister(device)


def allocator(pool, *more_pools):
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` over `pool` (and `more_pools`, one
    per device), with the record_stream, empty_cache, memory-fraction and base-allocation
    hooks set.

    Parameters
    ----------
    pool : mempool.Pool
        A ``cuda`` pool; registered for its device.

    Returns
    -------
    torch.cuda.memory.CUDAPluggableAllocator
    """
    torch = _torch_cuda()
    pools = (pool,) + more_pools
    for p in pools:
        _check_pool(p)
    devices = [p.device_id for p in pools]
    if len(set(devices)) != len(devices):
        raise ValueError(f"pool: one pool per device, got devices {devices}")
    for p in pools:
        register(p)
    alloc = torch.cuda.memory.CUDAPluggableAllocator(
        library_path(), "mempool_torch_alloc", "mempool_torch_free")
    addresses = entry_points()
    raw = alloc.allocator()
    for hook in _HOOKS:
        setter = getattr(raw, _SETTERS[hook], None)
        if setter is not None:   # each hook exists since torch 2.2
            setter(addresses[hook])
    return alloc


def install(pool, *more_pools):
    """Make `pool` PyTorch's CUDA allocator for this process (see the module docstring).

    Returns the ``CUDAPluggableAllocator``. Calling it again with the same pools is a no-op.

    Raises
    ------
    RuntimeError
        PyTorch already initialised CUDA (its default allocator is in use and cannot be
        swapped), or another pluggable allocator is installed.
    """
    global _installed
    torch = _torch_cuda()
    pools = (pool,) + more_pools
    if _installed is not None:
        if all(_core._torch_is_registered(p.device_id, p) for p in pools):
            return _installed
        raise RuntimeError("install: mempool is already PyTorch's allocator with other "
                           "pools; register(pool) adds a device, and an installed allocator "
                           "cannot be replaced")
    if torch.cuda.is_initialized():
        raise RuntimeError("install: PyTorch has already initialised CUDA, so its caching "
                           "allocator is in use and cannot be swapped; call "
                           "mempool.torch.install(pool) before the first CUDA tensor, or use "
                           "mempool.torch.mem_pool(pool) with torch.cuda.use_mem_pool")
    alloc = allocator(pool, *more_pools)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as exc:
        raise RuntimeError(f"install: PyTorch refused the allocator ({exc}); another "
                           f"allocator is already in use") from None
    _installed = alloc
    return alloc


def mem_pool(pool, use_on_oom=False):
    """A ``torch.cuda.MemPool`` backed by `pool`, for ``torch.cuda.use_mem_pool``.

    Parameters
    ----------
    pool : mempool.Pool
        A ``cuda`` pool; registered for its device.
    use_on_oom : bool
        Passed to MemPool: let allocations outside the context fall back to this pool
        when PyTorch's default allocator is out of memory.

    Returns
    -------
    torch.cuda.MemPool
    """
    torch = _torch_cuda()
    alloc = allocator(pool)
    return torch.cuda.MemPool(alloc.allocator(), use_on_oom=use_on_oom)


def from_pool(pool, shape, dtype="float32", stream=None):
    """A torch tensor on `pool`'s memory, through a zero-copy DLPack hand-off.

    `dtype` is a NumPy-style dtype or a ``torch.dtype``; `stream` the stream the tensor is
    used on (default: PyTorch's current stream on a cuda pool).
    """
    import torch
    if isinstance(dtype, torch.dtype):
        dtype = str(dtype).replace("torch.", "")
        if dtype.startswith(("bfloat16", "float8")):   # NumPy knows these through ml_dtypes
            import ml_dtypes
            dtype = getattr(ml_dtypes, dtype)
    if stream is None and pool.backend == "cuda":
        stream = torch.cuda.current_stream(pool.device_id)
    buf = pool.empty(shape, dtype, stream=stream)
    return torch.from_dlpack(buf)


def counters(device=0):
    """{"live_blocks", "failed_allocs"} of PyTorch's allocations through mempool on
    `device` (failed_allocs counts the NULLs returned for want of memory)."""
    return _core._torch_counters(device)
