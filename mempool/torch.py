"""PyTorch on a mempool pool: the pluggable allocator, MemPools, and DLPack hand-off.

Three ways to share one pool with PyTorch, from most to least invasive:

``install(pool)`` / ``install_all(pools)``
    Make the pool (one per device) PyTorch's CUDA allocator for the whole process. Every CUDA
    tensor then comes from the pool and PyTorch keeps no cache of its own. Must run before
    PyTorch touches CUDA. By default this is mempool's full allocator: a C++ class compiled
    once per PyTorch build against its headers (:mod:`mempool.torch_build`) that answers every
    call PyTorch makes of an allocator: ``memory_allocated``/``memory_stats``/
    ``memory_summary``/``reset_peak_memory_stats`` report the pool, out of memory raises
    ``torch.OutOfMemoryError`` with the pool's explanation, cuDNN benchmark's ``cacheInfo``,
    ``torch.cuda.graph`` and ``torch.compile(mode="reduce-overhead")`` with graph-private
    pools, ``MemPool``/``use_mem_pool``, ``_record_memory_history``/``_snapshot`` in
    PyTorch's format, ``empty_cache``, ``set_per_process_memory_fraction``,
    ``Tensor.record_stream``. ``allocator="pluggable"`` (or a machine with no C++ compiler,
    with a warning) uses PyTorch's ``CUDAPluggableAllocator`` instead, which forwards only
    allocation and free: see docs/sharing.md for what it lacks.
``mem_pool(pool)``
    A ``torch.cuda.MemPool`` whose segments come from the pool, for
    ``with torch.cuda.use_mem_pool(mp): ...``. PyTorch's caching allocator still caches
    inside the MemPool (its reserved bytes are the pool's used bytes); allocations outside
    the context use PyTorch's default allocator. Out-of-memory raises as usual. Works at any
    time, also after PyTorch initialised CUDA.
``torch.from_dlpack(pool.empty(...))``
    Zero-copy hand-off of single buffers (see :class:`mempool.Buffer`).

Several GPUs: each pool serves only its own device, and PyTorch's ``device`` argument picks
the pool; an allocation on a device with no pool is refused (a NULL, with a line on stderr
naming the device), never served from another device's memory. See docs/multigpu.md.

The entry points PyTorch calls are C functions of the ``mempool._core`` extension (the
shared object at ``mempool._core.__file__``); they never take the GIL. This module imports
torch only when one of its functions is called.
"""
from __future__ import annotations

import pathlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from mempool import _core, _torch_settings
from mempool._errors import require_open as _require_open

if TYPE_CHECKING:
    from mempool._core import Pool

_HOOKS = ("record_stream", "reset", "memory_fraction", "base_alloc")
_SETTERS = {
    "record_stream": "set_record_stream_fn",
    "reset": "set_reset_fn",
    "memory_fraction": "set_memory_fraction_fn",
    "base_alloc": "set_base_alloc_fn",
}
_installed = None   # what install() made PyTorch's allocator: a Glue or a CUDAPluggableAllocator


def library_path() -> str:
    """Path of the shared object holding the entry points (``mempool._core.__file__``)."""
    return _core.__file__


def entry_points() -> dict[str, int]:
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


def _check_pool(pool: object) -> None:
    if not isinstance(pool, _core.Pool):
        raise TypeError(f"pool: expected a mempool.Pool, got {type(pool).__name__}")
    _require_open(pool, "pool")
    if pool.backend != "cuda":
        raise ValueError(f"pool: PyTorch needs device memory; this pool's backend is "
                         f"{pool.backend!r} (use Pool(backend='cuda'))")


def register(pool: Pool) -> None:
    """Route PyTorch's allocations on ``pool.device_id`` to `pool` (one pool per device;
    the allocator serves every registered device)."""
    _check_pool(pool)
    _core._torch_register(pool.device_id, pool)


def routed_devices() -> tuple[int, ...]:
    """The devices whose PyTorch allocations reach a pool (registered), ascending."""
    return tuple(d for d in range(_core.TORCH_MAX_DEVICES) if _core._torch_is_registered(d))


def _pools_by_device(pools):
    """{device: pool} from a mapping or an iterable of pools, checked; registers nothing."""
    if isinstance(pools, _core.Pool):
        pools = [pools]
    if hasattr(pools, "items"):
        out = {}
        for key, pool in pools.items():
            if isinstance(key, bool) or not hasattr(key, "__index__"):
                raise TypeError(f"pools: keys must be int device indices, got "
                                f"{type(key).__name__} {key!r}")
            device = _core._torch_check_device(key)
            if not isinstance(pool, _core.Pool):
                raise TypeError(f"pools[{device}]: expected a mempool.Pool, got "
                                f"{type(pool).__name__}")
            if pool.device_id != device:
                raise ValueError(
                    f"pools[{device}]: this pool allocates on device {pool.device_id}, so it "
                    f"cannot serve device {device} (PyTorch would get device "
                    f"{pool.device_id}'s memory for device {device}'s tensors); register it "
                    f"under {pool.device_id}, or make Pool(backend='cuda', device={device})")
            out[device] = pool
    else:
        out = {}
        for i, pool in enumerate(pools):
            if not isinstance(pool, _core.Pool):
                raise TypeError(f"pools[{i}]: expected a mempool.Pool, got "
                                f"{type(pool).__name__}")
            if pool.device_id in out and out[pool.device_id] is not pool:
                raise ValueError(f"pools: two pools for device {pool.device_id}; one pool "
                                 f"per device")
            out[pool.device_id] = pool
    if not out:
        raise ValueError("pools: no pools given; pass one mempool.Pool per device")
    for device, pool in out.items():
        if pool.backend != "cuda":
            raise ValueError(f"pools[{device}]: PyTorch needs device memory; this pool's "
                             f"backend is {pool.backend!r} (use Pool(backend='cuda'))")
    return dict(sorted(out.items()))


def install_all(pools: Iterable[Pool] | None = None, peer_access: bool = True) -> Any:
    """Make mempool PyTorch's CUDA allocator on several devices, one pool per device.

    Parameters
    ----------
    pools : mapping of int to mempool.Pool, or iterable of mempool.Pool, optional
        Each device's pool: ``{0: pool0, 1: pool1}`` or ``[pool0, pool1]`` (each pool
        serves its own ``device_id``). Default: ``mempool.default_pool(d)`` for every device
        PyTorch sees (``MEMPOOL_CONF`` applies), for a process that drives all its GPUs. A
        process per GPU (DDP) installs only its own device's pool, with :func:`install`:
        a pool holds its device's primary context, so pools on every device would cost
        each process a context per GPU.
    peer_access : bool
        Grant each pool's device access to every other pool's memory where the two devices
        have a peer path (``Pool.enable_peer_access``). PyTorch, once it sees a peer path,
        runs cross-device copies that are not a plain memcpy as a kernel on one GPU that
        reaches the other's memory, and its pluggable allocator enables only the contexts'
        peer access, which does not reach pool memory. Grants are made once installed and
        are not revoked.

    Returns
    -------
    torch.cuda.memory.CUDAPluggableAllocator

    Notes
    -----
    An allocation on a device without a pool is refused (PyTorch gets NULL; a line on
    stderr names the device): no pool serves another device. Every argument is checked
    before anything is registered.

    Raises
    ------
    TypeError
        A value is not a ``mempool.Pool``, or a key not an int device index.
    ValueError
        A pool keyed under a device other than its own, two pools for one device, no pools,
        a pool not of backend ``cuda``, or a device PyTorch does not see.
    RuntimeError
        As :func:`install`.
    """
    if not isinstance(peer_access, bool):
        raise TypeError(f"peer_access must be True or False, got {peer_access!r}")
    if pools is None:
        torch = _torch_cuda()
        from mempool import default_pool
        pools = [default_pool(d) for d in range(torch.cuda.device_count())]
        if not pools:
            raise RuntimeError("install_all: PyTorch sees no CUDA device")
    by_device = _pools_by_device(pools)
    torch = _torch_cuda()
    count = torch.cuda.device_count()   # does not initialise CUDA
    for device in by_device:
        if device >= count:
            raise ValueError(f"pools[{device}]: PyTorch sees {count} CUDA device(s), so "
                             f"there is no device {device}")
    alloc = install(*by_device.values())
    if peer_access:                     # once installed: a refused install grants nothing
        from mempool import _cuda
        for owner, pool in by_device.items():
            for peer in by_device:
                if peer != owner and _cuda.can_access_peer(peer, owner):
                    pool.enable_peer_access(peer)
    return alloc


def unregister(device: int) -> None:
    """Stop routing `device`. RuntimeError while PyTorch still holds blocks there."""
    _core._torch_unregister(device)


def allocator(pool: Pool, *more_pools: Pool) -> Any:
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


_pluggable_allocator = allocator   # install()'s own `allocator` argument shadows it


class Glue:
    """mempool's C++ allocator, installed as PyTorch's (returned by :func:`install`).

    Attributes
    ----------
    path : pathlib.Path
        The compiled library (cached per PyTorch build).
    """

    def __init__(self, path: pathlib.Path, library: Any) -> None:
        self.path = path
        self._library = library

    def __repr__(self) -> str:
        return f"<mempool.torch.Glue {self.path}>"


def build(force: bool = False) -> pathlib.Path:
    """Compile mempool's C++ PyTorch allocator for the PyTorch imported here, or find it in
    the cache; returns the library's path. Raises :class:`mempool.torch_build.BuildError`."""
    _torch_cuda()
    from mempool import torch_build
    return torch_build.build(force=force)


def _load_glue(path):
    """Load the built glue at `path` and make it PyTorch's allocator; returns a Glue."""
    import ctypes
    torch = _torch_cuda()
    library = ctypes.CDLL(str(path))
    install_fn = library.mempool_torch_glue_install
    install_fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    install_fn.restype = ctypes.c_int
    err = ctypes.create_string_buffer(1024)
    rc = install_fn(_core._torch_api_address(), torch.cuda.device_count(), err, len(err))
    if rc != 0:
        raise RuntimeError(f"install: {err.value.decode(errors='replace')}")
    return Glue(path, library)


def install(pool: Pool, *more_pools: Pool, allocator: str = "auto") -> Any:
    """Make `pool` PyTorch's CUDA allocator for this process (see the module docstring).

    Parameters
    ----------
    pool, *more_pools : mempool.Pool
        ``cuda`` pools, one per device.
    allocator : {"auto", "full", "pluggable"}
        ``"full"``: mempool's C++ allocator (built on first use, cached). ``"pluggable"``:
        PyTorch's CUDAPluggableAllocator over the pool's C entry points (allocation and
        free only). ``"auto"``: the full one, or the pluggable one with a warning saying why
        when it cannot be built (no C++ compiler or no CUDA headers).

    Returns the installed :class:`Glue` or ``CUDAPluggableAllocator``. Calling it again with
    the same pools is a no-op; once installed, pools for devices that have none are added
    (as :func:`register`).

    Raises
    ------
    RuntimeError
        PyTorch already initialised CUDA (its default allocator is in use and cannot be
        swapped), another allocator is installed, or mempool is installed with another pool
        on one of the pools' devices.
    ValueError
        `allocator` is not one of the three.
    """
    global _installed
    if allocator not in ("auto", "full", "pluggable"):
        raise ValueError(f"allocator must be 'auto', 'full' or 'pluggable', got {allocator!r}")
    torch = _torch_cuda()
    pools = (pool,) + more_pools
    if _installed is not None:
        _pools_by_device(pools)         # checked before anything is registered
        taken = [p.device_id for p in pools if _core._torch_is_registered(p.device_id)
                 and not _core._torch_is_registered(p.device_id, p)]
        if taken:
            raise RuntimeError(f"install: mempool is already PyTorch's allocator, with other "
                               f"pools on device(s) {taken}; an installed pool is not "
                               f"replaced (unregister(device) first, once PyTorch holds none "
                               f"of its blocks)")
        for p in pools:
            register(p)                 # the entry points route by the table: no reinstall
        return _installed
    if torch.cuda.is_initialized():
        raise RuntimeError("install: PyTorch has already initialised CUDA, so its caching "
                           "allocator is in use and cannot be swapped; call "
                           "mempool.torch.install(pool) before the first CUDA tensor, or use "
                           "mempool.torch.mem_pool(pool) with torch.cuda.use_mem_pool")
    if allocator != "pluggable":
        from mempool.torch_build import BuildError
        for p in pools:
            _check_pool(p)
        devices = [p.device_id for p in pools]
        if len(set(devices)) != len(devices):
            raise ValueError(f"pool: one pool per device, got devices {devices}")
        try:
            path = build()
        except BuildError as exc:
            if allocator == "full":
                raise
            import warnings
            warnings.warn(f"mempool.torch.install: using PyTorch's pluggable allocator, "
                          f"which forwards only allocation and free (memory_stats, "
                          f"cudnn.benchmark, CUDA graphs and torch.OutOfMemoryError need "
                          f"mempool's full allocator), because {exc}", RuntimeWarning,
                          stacklevel=2)
        else:
            for p in pools:
                register(p)
            _installed = _load_glue(path)
            _torch_settings.guard_torch(torch, _core._torch_registered_pools)
            return _installed
    alloc = _pluggable_allocator(pool, *more_pools)
    try:
        torch.cuda.memory.change_current_allocator(alloc)
    except RuntimeError as exc:
        raise RuntimeError(f"install: PyTorch refused the allocator ({exc}); another "
                           f"allocator is already in use") from None
    _installed = alloc
    _torch_settings.guard_torch(torch, _core._torch_registered_pools, switch_kind=False)
    return alloc


def mem_pool(pool: Pool, use_on_oom: bool = False) -> Any:
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


def from_pool(pool: Pool, shape: int | tuple[int, ...], dtype: Any = "float32",
              stream: Any = None) -> Any:
    """A torch tensor on `pool`'s memory, through a zero-copy DLPack hand-off.

    `dtype` is a NumPy-style dtype or a ``torch.dtype``; `stream` the stream the tensor is
    used on (default: PyTorch's current stream on a cuda pool).
    """
    from mempool._errors import require_instance
    require_instance(pool, _core.Pool, "pool")
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


def counters(device: int = 0) -> dict[str, int]:
    """{"live_blocks", "failed_allocs"} of PyTorch's allocations through mempool on
    `device` (failed_allocs counts the NULLs returned for want of memory)."""
    return _core._torch_counters(device)
