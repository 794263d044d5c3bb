# The Pool class: its fields and life (creation, close), the streams it is given (Note
# [Pinned streams], in _streams.pxi), allocate and free (the hot paths, Note [Hot
# address]), and the methods of every other concern, each checking that the pool is usable
# and delegating with the C pool to the part that does the work: _pool_create, _pool_errors,
# _share, _pool_retention, _pool_observe, _peers, _buffer (before this part) and _cupy_hook
# (after it: its owner object holds a Pool). A cdef class is written in one place, so the
# methods and their docstrings are all here. Everything here holds the GIL; the core below
# it never needs it (docs/architecture.md, "Note [Lock order]").
#
# Uses every part included before it (_core.pyx), and _cupy_malloc of _cupy_hook.pxi.
from libc.stdint cimport uintptr_t

# Note [Blocking upstream calls] (the hooks are declared in _cdefs.pxd).
mp_set_blocking_hooks(mp_py_blocking_begin, mp_py_blocking_end)

from mempool import _config

#: True in the debug build (MEMPOOL_DEBUG=1 at build time: the C core's debug-only asserts
#: are on; mempool/_csrc/mp_assert.h, docs/reliability.md).
DEBUG_BUILD = bool(MP_DEBUG)


cdef object _unusable(Pool pool):
    """The error of a call on a Pool with no C pool: closed, or never initialised."""
    if pool._closed:
        return _closed_error(pool.backend, pool.device_id)
    return _not_initialised(pool)


# Note [Closing a pool]
#
# close() drops the Pool's reference on its C pool and leaves the Pool with none, so every method
# meets a NULL pool in its first check and raises PoolClosedError (the check every method makes
# already, for a Pool whose __init__ never ran: nothing is added to the hot path for it). The C
# pool is reference-counted: when the Pool held the last reference the core frees every segment,
# live blocks included, at once; Buffers, their DLPack tensors and device controls the caller kept
# hold their own references, so their memory stays valid (a consumer may still read it) and their
# deleters free into a pool that is still there, and the C pool goes with the last of them. CuPy's
# memory objects hold the Pool, not the C pool: their owner sees the NULL and frees nothing.
#
# A call that lets the GIL go inside the core (Note [Blocking upstream calls], and those in
# `with nogil`) is counted in `_in_core` while it is there, and close() refuses while the
# count is above zero: another thread closing then would free the pool under that call.
# The count moves with the GIL held, so a plain int does.

# Note [Hot address]
#
# A hot block comes back at the same address, and from Python an address is an int object: making
# one for each `alloc` and converting it back in `free` cost an allocation and a deallocation of
# the object each time. The Pool remembers the int object it returned from `alloc` or was given to
# `free` last, with its value (`_hot_address`). `alloc` returns that object again when the core
# hands out that address, and `free` of that very object skips the conversion. Exact ints only
# (`type(ptr) is int`), which are immutable, so the memo is never wrong, whatever happened to the
# block meanwhile; anything else takes the usual path and its checks. The memo starts as the int 0
# (with value 0), never as None, so that `free(None)` is refused as a bad type like any other
# non-integer. The Pool's fields are touched only with the GIL held.

cdef class Pool:
    """Pool(backend='cuda', device=0, capacity=None, **options)
--

A stream-ordered device memory pool.

    Parameters
    ----------
    backend : {"cuda", "sim", "host"}, default "cuda"
        Where segments come from: a ``cudaMemPool`` on a real GPU, a simulated device with
        fake addresses, or host memory. The default is ``"cuda"`` on every machine: without
        CuPy and a CUDA device, ``Pool()`` raises ``RuntimeError``. (:func:`mempool.default_pool`
        is the one that falls back to ``"sim"`` when no GPU is usable.)
    device : int
        The device the pool allocates on.
    capacity : int or str, optional
        Device memory the pool sees. Defaults: the GPU's memory; 80 GiB on ``sim``; 4 GiB on
        ``host``.
    **options
        See ``docs/options.md``: ``roundup_power2_divisions``, ``max_split_size``,
        ``cross_stream_reuse``, ``release_threshold``, ``limit``, ``initial_pool_size``,
        ``garbage_collection_threshold``, ``expandable_segments``, ``granularity`` (the page
        of expandable segments), and for ``cuda`` ``pool_handle`` and the ``reuse_*`` policies.

    Notes
    -----
    Streams: a block allocated on stream S may be used on S at once; freed, it serves S's
    next allocation at once. Use on other streams must be declared with
    :meth:`record_stream`. See docs/architecture.md, "The stream contract".

    Closing: :meth:`close` gives the memory back and makes every later call raise
    :class:`~mempool.PoolClosedError`; it refuses while blocks are live unless
    ``force=True``. ``with Pool(...) as pool:`` closes at the end of the block (by force only
    when an exception ends it). See docs/production.md, "Closing a pool".
    """

    cdef mp_pool *_pool
    cdef int _kind
    cdef readonly str backend
    cdef readonly int device_id
    cdef readonly size_t capacity
    cdef readonly dict options
    cdef object _device              # the device control (SimDevice, HostDevice; None on cuda)
    cdef object _cuda_handle
    # Note [Pinned streams]: every stream object the pool is given (a CuPy stream, an
    # object with __cuda_stream__, CuPy's current stream) is kept alive while the pool may
    # still call the driver with its handle (events for cross-stream reuse, freeing cached
    # segments on it): a destroyed handle reaching the driver crashes it. Raw ints are the
    # caller's to keep valid. forget_stream() lets go of one.
    cdef dict _pinned_streams        # handle -> the stream object
    cdef object _last_pinned         # the object pinned last: the common case, one compare
    cdef uintptr_t _last_pinned_handle
    cdef _CurrentStream _current     # cuda: CuPy's current stream (Note [Current stream])
    # Note [Hot address]: the int object of the address alloc returned or free was given
    # last, and its value. A hot block comes back at the same address, so alloc hands out the
    # same object again instead of making one, and free of that object needs no conversion.
    cdef object _hot_address
    cdef uintptr_t _hot_address_value
    # Closed, and calls in the core (Note [Closing a pool]):
    cdef bint _closed
    cdef int _in_core                # calls under way that may have let the GIL go
    cdef object _number              # the key in _live_pools
    cdef _Sharing _sharing           # blocks exported (_share.pxi); None before the first
    cdef object __weakref__

    def __cinit__(self, *args, **kwargs):
        self._pool = NULL
        self._pinned_streams = {}
        # Note [Hot address]: always an exact int and its value, so that no other argument
        # (None above all) can match it by identity.
        self._hot_address = 0
        self._hot_address_value = 0

    def __init__(self, backend="cuda", device=0, capacity=None, **options):
        # A second __init__ is refused rather than made transactional: swapping the C pool
        # under a live Pool would strand every Buffer, CuPy allocation and device control
        # made from the first one, and a re-init that half failed left backend and options
        # describing another device than the one in use.
        if self._closed:
            raise _closed_error(self.backend, self.device_id)
        if self._pool != NULL:
            raise RuntimeError(f"Pool.__init__: this Pool is already initialised (backend "
                               f"{self.backend!r}, device {self.device_id}); a pool's "
                               f"configuration is fixed for its life: make a new Pool")
        given = dict(options)
        given.update(backend=backend, device=device, capacity=capacity)
        opts = _config.normalize(given)
        # The fields are set only once the C pool exists: a failed __init__ leaves an
        # uninitialised Pool, not a half-made one.
        cdef mp_pool *pool = NULL
        total, cuda_handle, current = _pool_create(opts, &pool)
        self.backend = opts["backend"]
        self.device_id = opts["device"]
        self._kind = _BACKENDS[self.backend]
        self.capacity = total
        self._cuda_handle = cuda_handle
        self._current = current
        self.options = opts
        self._pool = pool
        self._device = _make_device(pool, self._kind)
        self._number = next(_pool_numbers)
        _live_pools[self._number] = self

    def __dealloc__(self):
        if self._pool != NULL:
            # Buffers handed out may still hold references: the C pool lives until they go.
            mp_pool_release(self._pool)
            self._pool = NULL

    # ------------------------------------------------------------------ closing

    @property
    def closed(self):
        """True once :meth:`close` has run."""
        return bool(self._closed)

    def close(self, force=False):
        """Give the pool's memory back to the upstream; every later call then raises
        :class:`~mempool.PoolClosedError`. Closing a closed pool does nothing.

        With live blocks (allocated and not freed: addresses from :meth:`alloc`, CuPy memory
        from :meth:`malloc`, :class:`Buffer` objects from :meth:`empty`) it raises
        ``RuntimeError`` naming them and changes nothing, unless ``force=True``: then those
        blocks are given up with the rest, and their addresses must not be used again. A
        ``Buffer`` (and any DLPack tensor made from one) keeps its memory valid until it is
        released, as a consumer may still read it: the pool's memory goes upstream when the
        last of them goes. CuPy memory of a force-closed pool frees nothing when CuPy drops
        it. Refused, whatever ``force``, while the pool is PyTorch's allocator
        (``mempool.torch``; unregister it first) or while another thread is inside a call on
        it (Note [Closing a pool]).
        """
        if not isinstance(force, bool):
            raise TypeError(f"close: 'force' must be True or False, got "
                            f"{type(force).__name__} {force!r}")
        if self._closed:
            return
        self._ready()
        _share_collect(self._pool, self._sharing)   # exported blocks consumers let go
        refusal = _close_refusal(self._pool, self.device_id, self._in_core, force)
        if refusal is not None:
            raise refusal
        if self._sharing is not None:
            self._sharing.close()   # no consumer joins from now on (the ledger is unlinked)
        # What other holders of the C pool (Buffers, device controls kept by the caller)
        # would keep cached goes now; the pool's own reference goes last.
        mp_empty_cache(self._pool)
        cdef mp_pool *pool = self._pool
        self._pool = NULL
        self._closed = True
        self._device = None
        _live_pools.pop(self._number, None)
        mp_pool_release(pool)

    def __enter__(self):
        self._ready()
        return self

    def __exit__(self, exc_type, exc, tb):
        """Close: ``close()`` when the block ends normally (so live blocks left behind raise,
        and the pool stays open), ``close(force=True)`` when an exception leaves it (blocks
        the interrupted code held are given up, and that exception propagates)."""
        self.close(force=exc_type is not None)
        return False

    @property
    def device(self):
        """The device control: a :class:`SimDevice` (``sim``), a :class:`HostDevice`
        (``host``), or None (``cuda``, and a Pool whose __init__ never ran)."""
        if self._closed:
            raise _closed_error(self.backend, self.device_id)
        return self._device

    @classmethod
    def from_conf(cls, conf, **overrides):
        """Build a pool from a ``PYTORCH_CUDA_ALLOC_CONF``-style string.

        ``Pool.from_conf("backend:sim,release_threshold:2GB,max_split_size_mb:64")``;
        keyword arguments override keys of the string.
        """
        options = _config.parse_conf(conf)
        options.update(overrides)
        return cls(**options)

    # ------------------------------------------------------------------ allocate / free

    cdef inline int _ready(self) except -1:
        """Refuse a Pool whose __init__ never ran (Pool.__new__, or a subclass that did not
        call the base's __init__): its C pool is NULL, which the core would dereference."""
        if self._pool == NULL:
            raise _unusable(self)
        if mp_pool_inherited(self._pool):
            raise _forked_error(self._pool)
        return 0

    cdef inline int _stream_of(self, object stream, uintptr_t *out) except -1:
        if stream is None:
            if self._kind != _CUDA:
                out[0] = 0
                return 0
            stream = self._current.find(self.device_id, out)
            if stream is None:            # the same stream as last time: pinned already
                return 0
            if stream is not self._last_pinned:
                self._pin_stream(stream, out[0])
            return 0
        elif type(stream) is int:
            out[0] = PyLong_AsSize_t(stream_handle(stream))
            return 0
        if stream is self._last_pinned:
            # The object named last: its handle is known (a stream object's handle is fixed
            # for its life), which saves reading it again on every call.
            out[0] = self._last_pinned_handle
            return 0
        out[0] = PyLong_AsSize_t(stream_handle(stream))
        self._pin_stream(stream, out[0])
        return 0

    cdef int _pin_stream(self, object stream, uintptr_t handle) except -1:
        """Note [Pinned streams]. Handles 0, 1 and 2 name default streams: never destroyed."""
        if handle > 2 and handle not in self._pinned_streams:
            self._pinned_streams[handle] = stream
        self._last_pinned = stream
        self._last_pinned_handle = handle
        return 0

    cdef tuple _pins(self):
        return (len(self._pinned_streams), self._last_pinned, self._last_pinned_handle)

    cdef int _restore_pins(self, tuple saved, uintptr_t handle) except -1:
        """Take back the pin a refused call's stream argument made (bad input changes
        nothing, and a stream object named only by a refused call is not kept alive)."""
        if len(self._pinned_streams) > saved[0]:
            self._pinned_streams.pop(handle, None)
        self._last_pinned = saved[1]
        self._last_pinned_handle = saved[2]
        return 0

    @property
    def _current_stream_lookup(self):
        """cuda: the lookup of CuPy's current stream (Note [Current stream]); else None."""
        return self._current

    @property
    def pinned_streams(self):
        """The stream objects this pool keeps alive, by handle (Note [Pinned streams])."""
        if self._closed:
            raise _closed_error(self.backend, self.device_id)
        return dict(self._pinned_streams)

    def alloc(self, nbytes, stream=None):
        """Allocate ``nbytes`` on ``stream`` (None: the current stream) and return the address.

        A request of 0 bytes returns a distinct valid pointer of the smallest block (512 B).
        Raises :class:`OutOfMemoryError` when the device or ``limit`` refuses.
        """
        if self._pool == NULL:
            raise _unusable(self)
        cdef size_t n = _as_nbytes(nbytes, "nbytes")
        cdef uintptr_t s = 0
        cdef uintptr_t ptr = 0
        if stream is not None or self._kind == _CUDA:
            self._stream_of(stream, &s)
        self._in_core += 1   # Note [Closing a pool]
        mp_py_mark(1)
        cdef int rc = mp_alloc(self._pool, n, s, &ptr)
        mp_py_mark(0)
        self._in_core -= 1
        if rc != MP_OK and _share_collect(self._pool, self._sharing):   # blocks consumers let go
            rc = mp_alloc(self._pool, n, s, &ptr)
        if rc != MP_OK:
            raise self._alloc_error(rc, n, s)
        if ptr == self._hot_address_value:
            return self._hot_address
        address = PyLong_FromSize_t(ptr)
        self._hot_address = address
        self._hot_address_value = ptr
        return address

    def free(self, ptr, stream=None):
        """Return a block to the pool.

        ``stream``: where the block was last used (None: the stream it was allocated on).
        The block then serves that stream at once and other streams after an event.
        """
        if self._pool == NULL:
            raise _unusable(self)
        cdef uintptr_t p
        if ptr is self._hot_address:
            p = self._hot_address_value
        else:
            p = _as_pointer(ptr)
            if type(ptr) is int:
                self._hot_address = ptr
                self._hot_address_value = p
        cdef uintptr_t s = 0
        cdef int has_stream = stream is not None
        saved = None
        if has_stream:
            saved = self._pins()
            self._stream_of(stream, &s)
        if self._sharing is not None and _share_pinned_free(self._sharing, p, s, has_stream):
            return   # exported: freed once its consumers let go (collect_shared)
        self._in_core += 1   # Note [Closing a pool]
        mp_py_mark(1)
        cdef int rc = mp_free(self._pool, p, s, has_stream)
        mp_py_mark(0)
        self._in_core -= 1
        if rc != MP_OK:
            if has_stream:
                self._restore_pins(saved, s)
            raise self._pointer_error(rc, "free", p)

    def record_stream(self, ptr, stream):
        """Declare that the live block at ``ptr`` is also used on ``stream``.

        When it is freed, the block waits for the work queued on ``stream`` until then
        before it can be handed out again (no host sync; events are polled lazily).
        """
        self._ready()
        cdef uintptr_t p = _as_pointer(ptr)
        cdef uintptr_t s = 0
        saved = self._pins()
        self._stream_of(stream, &s)
        cdef int rc = mp_record_stream(self._pool, p, s)
        if rc != MP_OK:
            self._restore_pins(saved, s)
            raise self._pointer_error(rc, "record_stream", p)

    def forget_stream(self, stream):
        """Let go of a stream: call it before destroying a raw stream handle the pool has
        used, or to let a stream object the pool keeps alive go.

        Waits for the stream's queued work, then moves every block and segment the pool
        keeps on it to the legacy default stream, so the pool never calls the driver with
        the dead handle (freeing a cached segment on a destroyed stream crashes the
        driver), and drops the pool's reference to the stream object. Stream objects
        (CuPy streams, ``__cuda_stream__`` objects) need no call: the pool keeps them alive
        while it may use their handles (``pinned_streams``). At the pool's own end no call is
        needed either: it synchronizes the device and frees everything on the legacy stream.
        """
        self._ready()
        cdef uintptr_t s = 0
        self._stream_of(stream, &s)
        self._in_core += 1   # Note [Closing a pool]
        mp_py_mark(1)
        cdef int rc = mp_forget_stream(self._pool, s)
        mp_py_mark(0)
        self._in_core -= 1
        if rc == MP_EBUSY:   # nothing changed: the stream stays pinned (Note [Graph capture])
            raise RuntimeError(f"forget_stream: stream {s:#x} cannot be synchronized while a "
                               f"CUDA graph capture is under way; call it after the capture")
        # Only now may the stream object go: the call above synchronized its handle.
        self._pinned_streams.pop(s, None)
        self._last_pinned = None
        if self._current is not None:
            self._current.forget()
        if rc == MP_ENOMEM:
            raise MemoryError("forget_stream: out of host memory")
        if rc != MP_OK:
            raise RuntimeError(f"forget_stream: synchronizing stream {s:#x} failed (error {rc})")

    def block_info(self, ptr):
        """``(nbytes, requested_nbytes, stream)`` of the live block at ``ptr``."""
        self._ready()
        cdef size_t nbytes = 0, requested = 0
        cdef uintptr_t s = 0
        cdef int rc = mp_block_info(self._pool, _as_pointer(ptr), &nbytes, &requested, &s)
        if rc != MP_OK:
            raise ValueError(f"block_info: {ptr:#x} is not a live block of this pool")
        return nbytes, requested, s

    def malloc(self, nbytes):
        """The CuPy allocator hook: ``cupy.cuda.set_allocator(pool.malloc)``.

        Returns a ``cupy.cuda.MemoryPointer`` on CuPy's current stream; when its last
        reference dies the block returns to the pool on that stream.
        """
        self._ready()
        return _cupy_malloc(self, nbytes)

    def use(self):
        """Context manager: CuPy allocates from this pool inside the ``with`` block (the same
        as :func:`mempool.cupy.use`, which it returns)."""
        self._ready()
        from mempool import cupy
        return cupy.use(self)

    # ---- sharing (mempool/_buffer.pxi) ----
    def empty(self, shape, dtype="float32", stream=None):
        """A new, uninitialised :class:`Buffer` of ``shape`` and ``dtype`` on ``stream``,
        for zero-copy hand-off through DLPack (``torch.from_dlpack(pool.empty(...))``).

        Parameters
        ----------
        shape : int or tuple of int
        dtype : dtype-like
            Anything ``numpy.dtype`` accepts that DLPack can describe (see Buffer).
        stream : optional
            The stream the memory is allocated on and written on: an int handle or a CuPy,
            PyTorch or ``__cuda_stream__`` stream (None: the current stream, as :meth:`alloc`).

        Returns
        -------
        Buffer

        Raises
        ------
        OutOfMemoryError
            The pool cannot serve the request.
        """
        self._ready()
        dims, dt, code, minor, nbytes = _buffer_request(shape, dtype)
        cdef uintptr_t handle = 0
        self._stream_of(stream, &handle)   # after the checks: a refused call pins no stream
        cdef size_t n = nbytes
        cdef mp_dl_block *block = NULL
        cdef int rc
        self._in_core += 1   # Note [Closing a pool]
        with nogil:
            rc = mp_dl_block_new(self._pool, n, handle, &block)
        self._in_core -= 1
        if rc != MP_OK and _share_collect(self._pool, self._sharing):   # blocks consumers let go
            rc = mp_dl_block_new(self._pool, n, handle, &block)
        if rc != MP_OK:
            raise self._alloc_error(rc, n, handle)
        return _buffer_wrap(block, dt, code, minor, dims, 0, False, self.backend,
                            self.device_id, handle)
    # ---- end sharing ----

    cdef object _pointer_error(self, int rc, str op, uintptr_t p):
        if rc == MP_EFORKED:
            return _forked_error(self._pool)
        return _pointer_error(rc, op, p)

    cdef object _alloc_error(self, int rc, size_t nbytes, uintptr_t stream):
        return _oom_error(self._pool, rc, nbytes, stream, self.backend, self.device_id)

    # ---- several devices (mempool/_peers.pxi, docs/multigpu.md) ----
    def enable_peer_access(self, peer_device):
        """Let device ``peer_device`` read and write this pool's memory.

        Covers every block, those handed out already and those to come: on ``cuda`` the
        cudaMemPool's access (``cudaMemPoolSetAccess``) and, with expandable segments, every
        mapped page and every page mapped later (``cuMemSetAccess``); ``sim`` records the
        same. Without it a kernel on another device faults on this memory. Enabling twice is
        a no-op; access is not revoked for the pool's life.

        Raises
        ------
        TypeError
            ``peer_device`` is not an int.
        ValueError
            It is negative, the pool's own device, or not a device of this machine (or of the
            simulated ones); or the backend is ``host``.
        RuntimeError
            The driver refused (no peer path between the devices, or a driver error).
        """
        self._ready()
        self._in_core += 1   # Note [Closing a pool]: the driver is called without the GIL
        try:
            _enable_peer_access(self._pool, self._kind, self.device_id, peer_device)
        finally:
            self._in_core -= 1

    def peer_devices(self):
        """The devices granted access by :meth:`enable_peer_access`, ascending (a tuple)."""
        self._ready()
        return _peer_devices(self._pool, self._kind)

    def access_devices(self, ptr):
        """The devices that may read and write all of the live block at ``ptr``, ascending.

        Asked of the driver on ``cuda`` (``cuMemGetAccess`` for expandable pages,
        ``cuMemPoolGetAccess`` otherwise); what ``sim`` recorded; ``()`` on ``host``.
        """
        self._ready()
        self._in_core += 1   # Note [Closing a pool]: the driver is called without the GIL
        try:
            return _access_devices(self._pool, self._kind, ptr)
        finally:
            self._in_core -= 1
    # ---- end several devices ----

    # ------------------------------------------------------------------ retention

    def empty_cache(self):
        """Release every segment that nothing uses back to the upstream.

        Blocks freed while other streams still use them (see :meth:`record_stream`) first
        wait for just those streams (a host sync of each, counted in
        ``stats()["num_sync_all_streams"]``), as ``torch.cuda.empty_cache()`` waits on its
        outstanding events; no other stream is synchronized. Segments whose free blocks
        belong to several streams are freed in stream order after an event wait, without a
        host sync. The ``initial_pool_size`` segment stays: it is kept for the pool's life.
        On ``cuda`` the cudaMemPool is then trimmed, so that the device gets back what the
        pool gave: after a device sync when the pool freed a segment since the last such
        call (with nothing freed there is no sync), and not while the pool knows of a CUDA
        graph capture, which a sync would break. Raises RuntimeError, naming the driver's
        error, when that sync or the trim fails (a kernel's earlier fault, say).
        """
        self._ready()
        self._in_core += 1   # Note [Closing a pool]
        mp_py_mark(1)
        mp_empty_cache(self._pool)
        mp_py_mark(0)
        self._in_core -= 1
        _give_back(self._pool, self._kind, self.device_id, 0)

    def trim(self, keep=0):
        """Release idle segments, longest unused first, until at most ``keep`` bytes are cached.

        ``keep``: bytes, an int or a size string (``"512MiB"``). Whole segments go, so
        cached memory may end below ``keep``; it ends above it when the rest is not
        releasable (free blocks of segments that hold live ones, the ``initial_pool_size``
        segment). Unlike :meth:`empty_cache`, trim waits for no stream of the pool:
        pending frees whose streams have not finished stay cached. On ``cuda`` the
        cudaMemPool is then trimmed to ``keep``, so that it gives back what the pool did, as
        :meth:`empty_cache` trims it.
        """
        self._ready()
        cdef size_t k = _as_nbytes(_config.parse_size(keep, "keep"), "keep")
        self._in_core += 1   # Note [Closing a pool]
        mp_py_mark(1)
        mp_trim(self._pool, k)
        mp_py_mark(0)
        self._in_core -= 1
        _give_back(self._pool, self._kind, self.device_id, k)

    def set_limit(self, limit):
        """Change ``limit`` (bytes, a fraction of capacity, or None) on a live pool."""
        self._ready()
        value = _limit_bytes(_config.normalize({"limit": limit})["limit"], self.capacity)
        mp_set_limit(self._pool, _or_unlimited(value))
        self.options["limit"] = value

    def set_release_threshold(self, threshold):
        """Change ``release_threshold`` (bytes or None) on a live pool."""
        self._ready()
        value = _config.normalize({"release_threshold": threshold})["release_threshold"]
        mp_set_release_threshold(self._pool, _or_unlimited(value))
        self.options["release_threshold"] = value
        if self._kind == _CUDA:
            _cuda_set_release_threshold(self._cuda_handle, self.options["pool_handle"], value)

    def set_size_policy(self, **options):
        """Change ``roundup_power2_divisions``, ``max_split_size`` and
        ``garbage_collection_threshold`` on a live pool, as PyTorch's
        ``torch.cuda.memory._set_allocator_settings`` does for its allocator.

        Each keyword given replaces that option, with the values ``Pool(...)`` accepts; the
        others stay. A change applies from the next request on: blocks and segments already
        made keep their sizes (Note [Size policy at run time] in mempool/_csrc/core/mp_core.c).
        On an expandable pool ``max_split_size`` is ignored with a ``ConfigWarning``, as when
        the pool is made. Every value is checked before any is applied: a bad one raises
        ``ValueError`` (an unknown keyword ``TypeError``) and changes nothing.
        """
        self._ready()
        self.options.update(_set_size_policy(self._pool, options))   # _pool_retention.pxi

    def set_capture_reuse(self, enabled):
        """Turn ``graph_capture_record_stream_reuse`` on or off from the next free on (as
        ``torch.cuda.memory._set_allocator_settings`` does for PyTorch's allocator): during
        a CUDA graph capture, a block freed with recorded streams is reused within the
        capture once the capture's own order puts all its uses first (Note [Capture reuse]).
        ``enabled`` must be a bool; anything else raises ``TypeError`` and changes
        nothing."""
        self._ready()
        if not isinstance(enabled, bool):
            raise TypeError(f"set_capture_reuse: 'enabled' must be True or False, got "
                            f"{type(enabled).__name__} {enabled!r}")
        mp_set_capture_reuse(self._pool, 1 if enabled else 0)
        self.options["graph_capture_record_stream_reuse"] = enabled

    # ------------------------------------------------------------------ observability

    def used_bytes(self):
        """Bytes in allocated blocks (rounded sizes)."""
        self._ready()
        return mp_used_bytes(self._pool)

    def cached_bytes(self):
        """Bytes reserved but in no live or pending block: free for the next request."""
        self._ready()
        return mp_cached_bytes(self._pool)

    def reserved_bytes(self):
        """Bytes the pool holds from the device (mapped bytes for expandable segments)."""
        self._ready()
        return mp_reserved_bytes(self._pool)

    def largest_free_block(self):
        self._ready()
        return mp_largest_free_block(self._pool)

    def stats(self):
        """Counters under the key names of ``torch.cuda.memory_stats()``.

        Families ``allocation``, ``segment``, ``active``, ``inactive_split``,
        ``allocated_bytes``, ``reserved_bytes``, ``active_bytes``, ``inactive_split_bytes``,
        ``requested_bytes`` (each ``.all/.small_pool/.large_pool`` x
        ``.current/.peak/.allocated/.freed``), ``oversize_allocations``,
        ``oversize_segments``, ``num_alloc_retries``, ``num_ooms``, ``num_sync_all_streams``,
        ``num_device_alloc``, ``num_device_free``, ``max_split_size``; and mempool's own
        ``mapped_bytes``, ``va_reserved_bytes``, ``num_cross_stream_reuse``,
        ``num_event_waits``, ``num_streams`` (streams the pool keeps state for now),
        ``num_stream_syncs``, ``num_event_records``, ``num_stream_queries`` (upstream calls),
        ``num_ahead_maps``, ``num_behind_unmaps`` (the mapper's, docs/expandable.md).
        """
        self._ready()
        return _pool_stats(self._pool, self._kind, self._cuda_handle)

    def reset_peak_stats(self):
        self._ready()
        mp_reset_peak_stats(self._pool)

    def reset_accumulated_stats(self):
        self._ready()
        mp_reset_accumulated_stats(self._pool)

    def _mapper_wait_idle(self):   # for tests and benchmarks (Note [Mapper])
        self._ready()
        _mapper_wait_idle(self._pool)

    def check_invariants(self):
        """Raise :class:`InvariantError` on any breach of the pool's structural invariants.

        No gap or overlap between blocks, every segment covered by its blocks, no two
        adjacent free blocks of one stream left unmerged, every free block in its stream's
        free list, and every counter equal to what the blocks add up to.
        """
        self._ready()
        _check_invariants(self._pool)

    def layout(self):
        """The segments and their blocks, copied under the pool lock.

        A list of dicts ``{address, total_size, mapped_size, maps, stream, is_small,
        is_expandable, is_pinned, blocks: [{address, size, requested_size,
        last_requested_size, stream, state}]}`` with ``state`` one of ``MP_BLOCK_*`` (0 free,
        1 allocated, 2 pending, 3 unmapped). ``requested_size`` is 0 for a free block;
        ``last_requested_size`` is the size last requested of it, kept once it is free (a free
        block merged from several keeps that of the block freed last), which PyTorch's
        snapshot shows as a free block's ``requested_size``.
        ``maps`` lists the physical allocations mapped in an expandable segment as
        ``(address, size)`` in address order, each released only whole (empty for others).
        """
        self._ready()
        return _pool_layout(self._pool)

    def record_history(self, enabled=True, max_entries=100_000):
        """Record allocator events for :meth:`history` and :meth:`snapshot`; off by default.

        Parameters
        ----------
        enabled : bool
            True starts recording into a fresh, empty ring of the last ``max_entries``
            events (as ``torch.cuda.memory._record_memory_history(max_entries=N)``); False
            stops recording and drops what was recorded. While off, recording costs one
            branch per event.
        max_entries : int
            Ring size (> 0); older events are overwritten. Each entry takes 40 bytes.
        """
        self._ready()
        _record_history(self._pool, enabled, max_entries)

    def history(self):
        """The recorded events, oldest first: ``(action, ptr, nbytes, stream, time_ns)``.

        ``action`` is one of ``alloc``, ``free_requested`` (the free call),
        ``free_completed`` (the block is reusable: at once, or once the streams it was
        recorded on pass the free), ``segment_alloc``, ``segment_free``, ``oom``,
        ``segment_map``, ``segment_unmap`` (expandable segments), ``empty_cache`` (a call
        of :meth:`empty_cache`, before what it released; no PyTorch action), ``trim`` (a
        call of :meth:`trim`, likewise; its ``nbytes`` is ``keep``). As in PyTorch's trace,
        ``nbytes`` is the requested size for alloc and free entries (the block's rounded
        size is in :meth:`layout`), the segment's or range's size for segment entries, and
        the refused request for ``oom``, whose ``ptr`` holds the bytes the device reported
        free. ``time_ns`` is CLOCK_MONOTONIC. Empty unless :meth:`record_history` is on.
        """
        self._ready()
        return _pool_history(self._pool)

    def save_trace(self, path):
        """Save the recorded history as a trace file (JSON lines) for ``mempool replay``."""
        self._ready()
        from mempool.tools import trace
        return trace.save_trace(self, path)

    def summary(self, abbreviated=False):
        """A text report in the layout of ``torch.cuda.memory_summary()``."""
        self._ready()
        from mempool.tools import report
        return report.summary(self.stats(), device=self.device_id, abbreviated=abbreviated,
                              backend=self.backend)

    def snapshot(self):
        """The pool in the format of ``torch.cuda.memory._snapshot()``."""
        self._ready()
        from mempool.tools import report
        return report.snapshot(self.layout(), self.history(), device=self.device_id)

    # ------------------------------------------------------------------ other processes

    def export(self, buffer_or_ptr):
        """A :class:`SharedHandle` of a block for another process (docs/sharing.md, "Other
        processes"): waits for the block's stream, then keeps the block from reuse, even
        once freed here, until every consumer released it (:meth:`collect_shared`).
        Needs ``ipc`` on (``Pool(..., ipc=True)``)."""
        self._ready()
        if not self.options["ipc"]:
            raise RuntimeError(f"export: this {self.backend!r} pool was made without sharing; "
                               f"create it with ipc=True to export blocks")
        if self._sharing is None:
            self._sharing = _Sharing()
        return _share_export(self._pool, self.backend, self._sharing, buffer_or_ptr)

    def import_(self, handle):
        """A :class:`Buffer` over the memory of `handle` (a :class:`SharedHandle` from
        :meth:`export`, in this process or another, of a pool of this backend); the producer
        may reuse it once this Buffer, its views and DLPack exports are all gone."""
        self._ready()
        return _share_import(self._pool, self.backend, self.device_id, handle)

    def collect_shared(self):
        """Give back the exported blocks whose consumers all released them (or died);
        returns how many. Export and an allocation about to fail run it too."""
        self._ready()
        return _share_collect(self._pool, self._sharing)

    def __repr__(self):
        if self._closed:
            return f"<mempool.Pool backend={self.backend!r} device={self.device_id} closed>"
        if self._pool == NULL:
            return f"<mempool.Pool uninitialised>"
        return (f"<mempool.Pool backend={self.backend!r} device={self.device_id} "
                f"reserved={mp_reserved_bytes(self._pool)} used={mp_used_bytes(self._pool)}>")

    # ------------------------------------------------------------------ internals for tests

    def _round_size(self, nbytes):
        self._ready()
        return mp_round_size(mp_pool_config(self._pool), _as_nbytes(nbytes, "nbytes"))
