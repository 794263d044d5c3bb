"""Numba on a mempool pool: an External Memory Management (EMM) plugin.

Every Numba device array (``cuda.device_array``, ``to_device``, ``device_array_like``,
kernel outputs that Numba allocates) then takes its memory from a pool, next to CuPy and
PyTorch. Install it before Numba creates its CUDA context, either way::

    NUMBA_CUDA_MEMORY_MANAGER=mempool.numba python app.py

    import mempool.numba
    mempool.numba.install()            # numba.cuda.set_memory_manager(MempoolNumbaManager)

The pool of device ``d`` is the one given to :func:`use` (or :func:`install`) for ``d``, and
otherwise ``mempool.default_pool(d)`` (built from ``MEMPOOL_CONF``).

Streams. The EMM interface gives ``memalloc`` no stream, so a block is allocated on Numba's
default stream (the legacy one, or the per-thread one under
``NUMBA_CUDA_PER_THREAD_DEFAULT_STREAM=1``) unless a :func:`stream` scope names another, and
it is freed on the stream it was allocated on: the pool hands it to that stream's next
allocation at once and to other streams only after an event (docs/architecture.md, Note
[Stream reuse]). :func:`device_array` and :func:`to_device` allocate on the array's own
stream, so the array is freed in that stream's order with no synchronization; an array used
on further streams declares them with :func:`record_stream`.

``defer_cleanup``: inside ``with numba.cuda.defer_cleanup():`` no block goes back to the
pool; the frees are held and made when the outermost such block ends (for memory that
work queued on other streams may still read).

IPC: ``array.get_ipc_handle()`` needs memory that ``cuIpcGetMemHandle`` can export. A
pool's memory comes from a ``cudaMemPool`` (or VMM mappings with expandable segments) made
without an export handle type, which the legacy IPC API refuses; the plugin asks the driver
and turns its refusal, and any request on a ``sim`` or ``host`` pool, into an
:class:`IpcNotSupportedError` that says why.

This module imports Numba only when the manager class is first used.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mempool._core import Pool

__all__ = ["MempoolNumbaManager", "IpcNotSupportedError", "install", "use", "pool_for",
           "stream", "device_array", "to_device", "record_stream", "memory_info"]

_INSTALL_HINT = "mempool.numba needs Numba's CUDA target (pip install numba-cuda)"

_pools = {}                       # device -> the Pool given to use(); guarded by _pools_lock
_pools_lock = threading.Lock()
_scope = threading.local()        # .stream: the allocation stream of this thread's scope
_manager_class = None             # built on first use (Numba imported then)


class IpcNotSupportedError(RuntimeError):
    """The pool's memory cannot be exported through CUDA IPC (the message says why)."""


def _numba_driver():
    from mempool._optional import require
    return require("numba.cuda.cudadrv.driver", _INSTALL_HINT)


def __getattr__(name: str) -> Any:
    # Numba looks the plugin up as the module attribute _numba_memory_manager after
    # importing the module named by NUMBA_CUDA_MEMORY_MANAGER; building the class here, on
    # that first look-up, keeps `import mempool.numba` free of Numba.
    if name in ("MempoolNumbaManager", "_numba_memory_manager"):
        return _build_manager_class()
    raise AttributeError(f"module 'mempool.numba' has no attribute {name!r}")


# ------------------------------------------------------------------ choosing the pool


def use(pool: Pool) -> Pool:
    """Make `pool` the pool of Numba's allocations on ``pool.device_id`` (process-wide).

    Blocks allocated earlier stay with the pool they came from and go back to it. Returns
    the pool.
    """
    from mempool import Pool
    if not isinstance(pool, Pool):
        raise TypeError(f"pool: expected a mempool.Pool, got {type(pool).__name__}")
    with _pools_lock:
        _pools[pool.device_id] = pool
    return pool


def pool_for(device: int = 0) -> Pool:
    """The pool Numba's allocations on `device` come from: the one given to :func:`use`,
    else ``mempool.default_pool(device)``."""
    with _pools_lock:
        pool = _pools.get(device)
    if pool is None:
        import mempool
        pool = mempool.default_pool(device)
    return pool


def install(pool: Pool | None = None) -> type:
    """Make mempool Numba's memory manager (``numba.cuda.set_memory_manager``), with `pool`
    for its device when given (:func:`use`). Returns the manager class.

    Call it before Numba's first CUDA operation: Numba fixes a context's manager when it
    creates the context.

    Raises
    ------
    RuntimeError
        Numba has already chosen another memory manager (its own, for a context it made,
        or another plugin).
    """
    driver = _numba_driver()
    cls = _build_manager_class()
    current = getattr(driver, "_memory_manager", None)
    if current is not None and current is not cls:
        name = f"{current.__module__}.{current.__qualname__}"
        raise RuntimeError(
            f"install: Numba already uses the memory manager {name}, for contexts made "
            f"before this call; install mempool before Numba's first CUDA operation, or set "
            f"NUMBA_CUDA_MEMORY_MANAGER=mempool.numba in the environment")
    if pool is not None:
        use(pool)
    import numba.cuda
    numba.cuda.set_memory_manager(cls)
    return cls


# ------------------------------------------------------------------ streams


_default_handle = None          # Numba's default stream as a pool handle, read once


def _default_stream():
    """Numba's default stream as a pool handle: 2 (per-thread) or 0 (legacy). Numba reads
    its configuration at import, so the answer is fixed for the process."""
    global _default_handle
    if _default_handle is None:
        try:
            from numba.cuda.core import config
        except ImportError:         # Numba's built-in CUDA target keeps its config here
            from numba.core import config
        _default_handle = 2 if getattr(config, "CUDA_PER_THREAD_DEFAULT_STREAM", 0) else 0
    return _default_handle


class _StreamRef:
    """A Numba stream as the pool sees it (``__cuda_stream__``), holding the stream object
    so that the pool keeps it alive while it may use its handle (Note [Pinned streams])."""

    __slots__ = ("stream", "handle")

    def __init__(self, stream, handle):
        self.stream = stream
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def _as_pool_stream(s):
    """A stream argument for the pool: an int handle, or an object that keeps it alive."""
    if s is None:
        return None
    if type(s) is int:
        if s < 0 or s >= 2 ** 64:
            raise ValueError(f"stream must be a handle in [0, 2**64), got {s}")
        return s
    if isinstance(s, bool):
        raise TypeError("stream must be a Numba or CuPy stream, an object with "
                        "__cuda_stream__, or an int handle; got bool")
    if hasattr(s, "__cuda_stream__") or hasattr(s, "ptr") or hasattr(s, "cuda_stream"):
        return s                        # the pool reads and pins it
    handle = getattr(s, "handle", None)  # a Numba stream of a release without __cuda_stream__
    if handle is not None:
        value = getattr(handle, "value", handle)   # ctypes c_void_p or a binding handle
        return _StreamRef(s, int(value or 0))
    raise TypeError(f"stream must be a Numba or CuPy stream, an object with __cuda_stream__, "
                    f"or an int handle; got {type(s).__name__}")


def stream(s: Any) -> contextlib.AbstractContextManager[None]:
    """``with mempool.numba.stream(s):`` Numba's allocations in this thread are made on
    stream `s` (and freed on it). ``0`` or ``None``: Numba's default stream."""
    return _on_stream(s)


@contextlib.contextmanager
def _on_stream(s):
    value = None if s is None or (type(s) is int and s == 0) else _as_pool_stream(s)
    previous = getattr(_scope, "stream", None)
    _scope.stream = value
    try:
        yield
    finally:
        _scope.stream = previous


def device_array(shape: Any, dtype: Any = float, strides: Any = None, order: str = "C",
                 stream: Any = 0) -> Any:
    """``numba.cuda.device_array`` whose block is allocated on `stream`, and so freed in
    that stream's order when the array goes."""
    import numba.cuda
    with _on_stream(stream):
        return numba.cuda.device_array(shape, dtype=dtype, strides=strides, order=order,
                                       stream=stream)


def to_device(obj: Any, stream: Any = 0, copy: bool = True, to: Any = None) -> Any:
    """``numba.cuda.to_device`` whose block is allocated on `stream` (see
    :func:`device_array`)."""
    import numba.cuda
    with _on_stream(stream):
        return numba.cuda.to_device(obj, stream=stream, copy=copy, to=to)


def record_stream(array: Any, stream: Any) -> None:
    """Declare that `array`'s memory (a Numba device array, or anything with
    ``__cuda_array_interface__`` on a pool block) is also used on `stream`: when it is
    freed, the pool waits for that stream's work queued until then before reusing it."""
    if stream is None:
        raise TypeError("stream: name the stream the array is used on (a Numba or CuPy "
                        "stream, an object with __cuda_stream__, or an int handle), not None")
    iface = getattr(array, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(f"array: expected a device array (__cuda_array_interface__), got "
                        f"{type(array).__name__}")
    ptr = iface["data"][0]
    owner = _owning_pool(ptr)
    if owner is None:
        raise ValueError(f"array: {ptr:#x} is not the start of a live block of a pool Numba "
                         f"allocates from (a view into an array, or memory from elsewhere)")
    owner.record_stream(ptr, _as_pool_stream(stream))


def _owning_pool(ptr):
    with _pools_lock:
        candidates = list(_pools.values())
    import mempool
    with mempool._default_lock:
        defaults = list(mempool._default_pools.values())
    candidates += [pool for pool in defaults if pool not in candidates]
    for pool in candidates:
        try:
            pool.block_info(ptr)
        except ValueError:
            continue
        return pool
    return None


# ------------------------------------------------------------------ memory info


def memory_info(pool: Pool, device_free: int | None = None) -> tuple[int, int]:
    """``(free, total)`` bytes as the pool sees them, for ``get_memory_info``.

    ``total`` is the pool's ``limit`` when it has one, else the device's capacity. ``free``
    is what the pool could still hand out: its cached bytes plus what the device has free
    (`device_free`; asked of the sim or host device when None), and no more than the limit
    leaves.
    """
    options = pool.options
    limit = options.get("limit")
    total = pool.capacity if limit is None else min(limit, pool.capacity)
    cached = pool.cached_bytes()
    if device_free is None:
        device = pool.device
        if pool.backend == "cuda" or not hasattr(device, "used_bytes"):
            raise ValueError("memory_info: give device_free for a cuda pool (the driver's "
                             "free memory, cuMemGetInfo)")
        device_free = device.capacity - device.used_bytes
    free = device_free + cached
    if limit is not None:
        free = min(free, max(0, limit - pool.reserved_bytes()) + cached)
    return max(0, min(free, total)), total


# ------------------------------------------------------------------ held frees


class _HeldFrees:
    """The frees of one manager, held while a ``defer_cleanup`` block is active (any
    thread: Numba's own deferral is per context too). `_depth` and `_held` are guarded by
    `_lock`, re-entrant because a free is a finalizer that the garbage collector may run
    inside this very class, while its thread holds the lock."""

    def __init__(self):
        self._lock = threading.RLock()
        self._depth = 0
        self._held = []

    def free(self, pool, ptr):
        with self._lock:
            if self._depth:
                self._held.append((pool, ptr))
                return
        pool.free(ptr)

    def enter(self):
        with self._lock:
            self._depth += 1

    def exit(self):
        with self._lock:
            self._depth -= 1
            if self._depth:
                return
            held, self._held = self._held, []
        for pool, ptr in held:
            pool.free(ptr)

    def flush(self):
        with self._lock:
            held, self._held = self._held, []
        for pool, ptr in held:
            pool.free(ptr)

    @property
    def held(self):
        with self._lock:
            return len(self._held)


def _context_device(context):
    """The ordinal of the device of a Numba context. A context Numba makes holds its Device
    (``.id``); one built around a handle someone else retained, as ``driver.Context(dev,
    handle)`` with the driver's own ``CUdevice`` (how Numba's tests attach a primary
    context another library made), holds that ``CUdevice``, whose ``int()`` is the
    ordinal."""
    device = context.device
    for value in (getattr(device, "id", None), device):
        if value is None or isinstance(value, bool) or callable(value):
            continue
        try:
            return int(value)
        except (TypeError, ValueError):
            continue
    raise TypeError(f"mempool.numba: cannot tell the device of Numba context {context!r}: its "
                    f"device is a {type(device).__name__}, with no integer id (expected a "
                    f"numba Device or a CUdevice)")


def _finalizer(allocations, held, pool, ptr):
    def free():
        allocations.pop(ptr, None)
        held.free(pool, ptr)
    return free


# ------------------------------------------------------------------ the manager


def _build_manager_class():
    global _manager_class
    if _manager_class is not None:
        return _manager_class
    driver = _numba_driver()
    import weakref

    class MempoolNumbaManager(driver.GetIpcHandleMixin, driver.HostOnlyCUDAMemoryManager):
        """Numba's device memory from a mempool pool (see :mod:`mempool.numba`).

        Host memory (pinned, mapped) stays Numba's own, as ``HostOnlyCUDAMemoryManager``
        does it.
        """

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._held = _HeldFrees()

        @property
        def interface_version(self):
            return 1

        def initialize(self):
            # Numba calls this when the context is made current; resolving the pool here
            # makes a bad MEMPOOL_CONF fail at the first CUDA operation, not mid-run.
            self._pool()

        def _pool(self):
            pool = pool_for(_context_device(self.context))
            if pool.backend != "cuda" and isinstance(self.context, driver.Context):
                raise ValueError(
                    f"mempool.numba: the pool of device {pool.device_id} has backend "
                    f"{pool.backend!r}, whose memory a CUDA kernel cannot use; give Numba a "
                    f"Pool(backend='cuda') (mempool.numba.use, or MEMPOOL_CONF)")
            return pool

        def memalloc(self, size):
            pool = self._pool()
            s = getattr(_scope, "stream", None)
            ptr = pool.alloc(size, stream=_default_stream() if s is None else s)
            # As Numba's own manager: an AutoFreePointer kept in `allocations` and handed
            # out as an owned reference, so that views of the array keep the block alive
            # and the block is freed when the last of them goes.
            mem = driver.AutoFreePointer(
                weakref.proxy(self.context), ctypes.c_void_p(ptr), size,
                finalizer=_finalizer(self.allocations, self._held, pool, ptr))
            self.allocations[ptr] = mem
            return mem.own()

        def get_memory_info(self):
            pool = self._pool()
            device_free = None
            if pool.backend == "cuda":
                # Numba's own answer (cuMemGetInfo), through its manager: the driver call's
                # spelling differs between Numba's ctypes and cuda-python bindings.
                device_free = int(driver.NumbaCUDAMemoryManager.get_memory_info(self).free)
            free, total = memory_info(pool, device_free)
            return driver.MemoryInfo(free=free, total=total)

        def get_ipc_handle(self, memory):
            pool = self._pool()
            if pool.backend != "cuda":
                what = ("simulated addresses" if pool.backend == "sim" else "host memory")
                raise IpcNotSupportedError(
                    f"get_ipc_handle: the pool of device {pool.device_id} ({pool.backend!r}) "
                    f"holds {what}, which CUDA IPC cannot export")
            try:
                return super().get_ipc_handle(memory)
            except Exception as exc:
                raise IpcNotSupportedError(
                    f"get_ipc_handle: CUDA IPC (cuIpcGetMemHandle) cannot export this "
                    f"array: mempool's memory comes from a cudaMemPool "
                    f"(cuMemAllocFromPoolAsync) or, with expandable_segments, from "
                    f"cuMemCreate mappings, made without an export handle type, and the "
                    f"legacy IPC API exports neither (the driver said: {exc}). Copy the data "
                    f"to memory allocated outside the pool to share it") from exc

        def reset(self):
            # Numba's reset frees every allocation of the context; held frees go too.
            super().reset()
            self._held.flush()

        @contextlib.contextmanager
        def defer_cleanup(self):
            with super().defer_cleanup():      # Numba's host allocations
                self._held.enter()
                try:
                    yield
                finally:
                    self._held.exit()

    MempoolNumbaManager.__module__ = __name__
    MempoolNumbaManager.__qualname__ = "MempoolNumbaManager"
    _manager_class = MempoolNumbaManager
    globals()["MempoolNumbaManager"] = MempoolNumbaManager
    globals()["_numba_memory_manager"] = MempoolNumbaManager
    return MempoolNumbaManager
