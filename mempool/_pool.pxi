# The Pool: configuration, validation and errors around the C core. Everything here holds
# the GIL; the core below it never needs it (docs/architecture.md, "Note [Lock order]").
#
# Uses every part included before it (_core.pyx): argument checks (_common), the size policy
# (_policy), the CUDA upstream and its cudaMemPool (_cuda, _cudapool), CuPy's current stream
# (_streams), several devices (_peers), the device controls (_devices), Buffers (_buffer).
from libc.stdint cimport uintptr_t, uint64_t
from libc.stdlib cimport free as c_free

# Note [Blocking upstream calls] (the hooks are declared in _cdefs.pxd).
mp_set_blocking_hooks(mp_py_blocking_begin, mp_py_blocking_end)

import itertools as _itertools
import os as _os
import weakref as _weakref

from mempool import _config
from mempool._units import format_bytes as _fmt
from mempool._errors import InvariantError, OutOfMemoryError, PoolClosedError

cdef size_t _DEFAULT_GRANULARITY = _config.DEFAULT_GRANULARITY
_DEFAULT_CAPACITY = _config.DEFAULT_CAPACITY

#: True in the debug build (MEMPOOL_DEBUG=1 at build time: the C core's debug-only asserts
#: are on; mempool/_csrc/mp_assert.h, docs/reliability.md).
DEBUG_BUILD = bool(MP_DEBUG)
#: Core codes, for tests of the messages built from them.
_MP_EINVAL = MP_EINVAL

_STAT_FAMILIES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                  "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_POOLS = ("all", "small_pool", "large_pool")
# The options Pool.set_size_policy changes on a live pool.
_SIZE_POLICY = ("roundup_power2_divisions", "max_split_size", "garbage_collection_threshold")


# Every live Pool by its creation number, for exporters that watch all of them
# (mempool.prometheus): weak, so being watched keeps no pool alive. Written at creation only.
_live_pools = _weakref.WeakValueDictionary()
_pool_numbers = _itertools.count()


def live_pools():
    """``[(number, pool)]`` of every Pool of this process still alive, oldest first.

    ``number`` counts the pools made in this process from 0 and is never reused, so it
    names one pool for its life (the ``pool`` label of mempool.prometheus).
    """
    return sorted(_live_pools.items(), key=lambda item: item[0])


cdef size_t _or_unlimited(object value):
    return MP_UNLIMITED if value is None else <size_t>value


cdef object _limit_bytes(object limit, size_t capacity):
    """`limit` as normalized (bytes, a fraction of capacity, or None) in bytes or None. A
    fraction so small that it leaves no byte is refused: it would make a pool that can
    allocate nothing (per_process_memory_fraction:1e-300 did)."""
    if not isinstance(limit, float):
        return limit
    nbytes = int(limit * capacity)
    if nbytes == 0:
        raise ValueError(f"option 'limit': the fraction {limit!r} of capacity {capacity} bytes "
                         f"is less than one byte; accepted: a fraction in (0, 1] that leaves "
                         f"at least one byte, a size in bytes, or None")
    return nbytes


cdef object _unusable(Pool pool):
    """The error of a call on a Pool with no C pool: closed, or never initialised."""
    if pool._closed:
        return _closed_error(pool)
    return _not_initialised(pool)


cdef object _closed_error(Pool pool):
    return PoolClosedError(f"this Pool (backend {pool.backend!r}, device {pool.device_id}) is "
                           f"closed: it serves no call; make a new Pool (mempool.default_pool() "
                           f"makes a fresh default pool)")


cdef object _live_blocks_refusal(mp_pool *pool):
    """close()'s message when `pool` has live blocks (None when it has none): their count,
    their bytes and the first few addresses."""
    if mp_used_bytes(pool) == 0:
        return None
    cdef mp_layout lay
    if mp_layout_take(pool, &lay) != MP_OK:
        raise MemoryError("close: out of host memory")
    cdef size_t i, count = 0, nbytes = 0
    first = []
    try:
        for i in range(lay.nblocks):
            if lay.blocks[i].state == MP_BLOCK_ALLOCATED:
                count += 1
                nbytes += lay.blocks[i].nbytes
                first.append(lay.blocks[i].ptr)
    finally:
        mp_layout_free(&lay)
    if count == 0:
        return None
    first.sort()
    shown = ", ".join(f"{ptr:#x}" for ptr in first[:4]) + (", ..." if count > 4 else "")
    return (f"close: the pool has {count} live block(s) of {_fmt(nbytes, exact=True)} "
            f"({shown}); free them first, or close(force=True) to give them up")


# Note [Closing a pool]
#
# close() drops the Pool's reference on its C pool and leaves the Pool with none, so every
# method meets a NULL pool in its first check and raises PoolClosedError (the check every
# method makes already, for a Pool whose __init__ never ran: nothing is added to the hot
# path for it). The C pool is reference-counted: when the Pool held the last reference the
# core frees every segment, live blocks included, at once; Buffers, their DLPack tensors
# and device controls the caller kept hold their own references, so their memory stays
# valid (a consumer may still read it) and their deleters free into a pool that is still
# there, and the C pool goes with the last of them. CuPy's memory objects hold the Pool,
# not the C pool: their owner sees the NULL and frees nothing.
#
# A call that lets the GIL go inside the core (Note [Blocking upstream calls], and those in
# `with nogil`) is counted in `_in_core` while it is there, and close() refuses while the
# count is above zero: another thread closing then would free the pool under that call.
# The count moves with the GIL held, so a plain int does.

# Note [Hot address]
#
# A hot block comes back at the same address, and from Python an address is an int object:
# making one for each `alloc` and converting it back in `free` cost an allocation and a
# deallocation of the object each time (figures in bench/results/history.md). The Pool remembers
# the int object it returned from `alloc` or was given to `free` last, with its value
# (`_hot_address`). `alloc` returns that object again when the core hands out that address, and
# `free` of that very object skips the conversion. Exact ints only (`type(ptr) is int`), which
# are immutable, so the memo is never wrong, whatever happened to the block meanwhile; anything
# else takes the usual path and its checks. The memo starts as the int 0 (with value 0), never
# as None, so that `free(None)` is refused as a bad type like any other non-integer. The Pool's
# fields are touched only with the GIL held.

# Note [Pinned streams]
#
# The pool cannot tell a live stream handle from a destroyed one (asking the driver about a
# destroyed handle is itself the crash), and it does use handles long after the call that named
# them: the owner of a cached block gets an event recorded on it when another stream takes the
# block, and a cached segment is freed on its stream. Threads that make CuPy streams, allocate
# and free on them and return let CuPy destroy the streams with their objects, and the next
# thread's allocation may take one of their blocks: the event would go to a dead stream.
#
# So `Pool` keeps a reference to every stream *object* it is given (a CuPy stream, an object
# with `__cuda_stream__`, CuPy's current stream when `stream=None`), by handle, in
# `pinned_streams`: the object, and so its handle, lives as long as the pool may use it. The
# cost on the hot path is one identity compare with the stream pinned last. Handles 0, 1 and 2
# (the default streams) are never pinned, nor are raw ints, which the caller owns: for those,
# `forget_stream(handle)` before destroying the stream is the contract. `forget_stream`
# synchronizes the stream, hands its blocks and segments to the legacy stream, and only then
# drops the pinned object (dropping it first destroyed the stream before the synchronize: the
# second crash of those runs). An application that makes a stream per request keeps those
# streams until it calls `forget_stream`; that trade (a few stream objects against a crash) is
# deliberate.


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
            raise _closed_error(self)
        if self._pool != NULL:
            raise RuntimeError(f"Pool.__init__: this Pool is already initialised (backend "
                               f"{self.backend!r}, device {self.device_id}); a pool's "
                               f"configuration is fixed for its life: make a new Pool")
        given = dict(options)
        given.update(backend=backend, device=device, capacity=capacity)
        opts = _config.normalize(given)
        # Note [Set-up during a capture] (mp_cuda.c): a cuda Pool's driver calls in the
        # thread's relaxed capture mode, so that a CUDA graph captured meanwhile (the global
        # mode included) neither refuses them nor is broken by them.
        cdef int capture_mode = -1
        if _BACKENDS[opts["backend"]] == _CUDA:
            capture_mode = mp_cuda_relax_capture_mode()
        try:
            self._create(opts)
        finally:
            mp_cuda_restore_capture_mode(capture_mode)

    cdef int _create(self, dict opts) except -1:
        """__init__'s work once the options are normalized (not callable from Python: a
        Pool is made once)."""
        # Everything below works on locals; the Pool's fields are set only once the C pool
        # exists, so a failed __init__ leaves an uninitialised Pool, not a half-made one.
        backend_name = opts["backend"]
        cdef int device_id = opts["device"]
        cdef int kind = _BACKENDS[backend_name]
        granularity = opts["granularity"]
        cdef size_t gran = _DEFAULT_GRANULARITY if granularity is None else granularity
        if kind != _CUDA:
            opts["granularity"] = gran   # the page size in use, default resolved
        cdef mp_upstream up
        cdef int rc
        cuda_handle = None
        current = None
        if kind == _CUDA:
            cuda_handle = _make_cuda(&up, device_id, opts)
            if up.granularity:
                opts["granularity"] = up.granularity   # the page in use, default resolved
            try:
                current = _cuda_current_stream(device_id)
            except BaseException:
                up.destroy(up.ctx)
                raise
        else:
            cap = opts["capacity"] if opts["capacity"] is not None else _DEFAULT_CAPACITY[backend_name]
            if kind == _SIM:
                rc = mp_sim_upstream(&up, <size_t>cap, gran)
            else:
                rc = mp_host_upstream(&up, <size_t>cap, gran)
            if rc == MP_EINVAL:
                raise ValueError(f"option 'granularity' ({gran}) must be a positive multiple of "
                                 f"{'512' if kind == _SIM else 'the page size'}")
            if rc != MP_OK:
                raise MemoryError(f"could not create the {backend_name} device (error {rc})")
            if kind == _SIM:
                _sim_place(&up, device_id)   # several devices: mempool/_peers.pxi
            if opts["expandable_segments"] and gran > cap:
                up.destroy(up.ctx)
                raise ValueError(f"option 'granularity' ({gran} bytes) exceeds 'capacity' "
                                 f"({cap} bytes): no page of expandable segments would fit "
                                 f"the device; accepted: a page size up to the capacity")
        cdef size_t free_b = 0, total = 0
        cdef mp_config cfg
        cdef mp_pool *pool = NULL
        try:
            up.mem_info(up.ctx, &free_b, &total)
            limit = _limit_bytes(opts["limit"], total)
            opts["limit"] = limit
            mp_config_default(&cfg)
            for i, d in enumerate(opts["roundup_power2_divisions"]):
                cfg.roundup_divisions[i] = d
            cfg.max_split_size = _or_unlimited(opts["max_split_size"])
            cfg.cross_stream_reuse = 1 if opts["cross_stream_reuse"] else 0
            if opts["segment_rounding"] is None and kind == _CUDA \
                    and not opts["expandable_segments"]:
                # Note [The cudaMemPool's unit] (mempool/_cuda.py): the pool reserves what
                # the device holds for its segments; options report the rounding in use.
                from mempool import _cuda
                opts["segment_rounding"] = _cuda.segment_rounding_for(
                    _cuda.allocation_unit(device_id))
            cfg.segment_round = opts["segment_rounding"] or 0
            cfg.release_threshold = _or_unlimited(opts["release_threshold"])
            cfg.limit = _or_unlimited(limit)
            cfg.initial_pool_size = opts["initial_pool_size"]
            cfg.gc_threshold = opts["garbage_collection_threshold"]
            cfg.expandable_segments = 1 if opts["expandable_segments"] else 0
            cfg.max_map_size = opts["max_map_size"] or 0
            cfg.min_map_size = opts["min_map_size"] or 0
            cfg.capture_reuse = 1 if opts["graph_capture_record_stream_reuse"] else 0
            if cfg.expandable_segments and up.map == NULL:
                raise ValueError(f"expandable_segments is not supported by the {backend_name} "
                                 f"upstream")
        except BaseException:
            up.destroy(up.ctx)
            raise
        rc = mp_pool_create(&cfg, &up, &pool)
        if rc == MP_OK:
            self.backend = backend_name
            self.device_id = device_id
            self._kind = kind
            self.capacity = total
            self._cuda_handle = cuda_handle
            self._current = current
            self.options = opts
            self._pool = pool
            if kind == _CUDA:
                mp_cuda_bind_errors(mp_pool_upstream(pool))
            self._device = _make_device(pool, kind)
            self._number = next(_pool_numbers)
            _live_pools[self._number] = self
            return 0
        # mp_pool_create destroys the upstream only when reserving initial_pool_size failed
        # (it has made a pool by then); every earlier failure leaves it to us.
        if not (rc == MP_ENOMEM and cfg.initial_pool_size):
            up.destroy(up.ctx)
        if rc == MP_ENOMEM:
            raise OutOfMemoryError(
                f"initial_pool_size of {_fmt(cfg.initial_pool_size, exact=True)} could not be "
                f"reserved on {backend_name} device {device_id} (capacity {_fmt(total)})")
        raise ValueError(f"invalid pool configuration (error {rc})")

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
        if self._in_core:
            raise RuntimeError(f"close: {self._in_core} call(s) on this pool are under way in "
                               f"other threads; close it once they have returned")
        if 0 <= self.device_id < MP_TORCH_MAX_DEVICES \
                and mp_torch_registered(self.device_id) == self._pool:
            raise RuntimeError(f"close: the pool is PyTorch's allocator on device "
                               f"{self.device_id} (mempool.torch); unregister it first "
                               f"(mempool.torch.unregister({self.device_id}))")
        if not force:
            refusal = _live_blocks_refusal(self._pool)
            if refusal is not None:
                raise RuntimeError(refusal)
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
            raise _closed_error(self)
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
            raise self._forked_error()
        return 0

    cdef object _forked_error(self):
        # Note [Pools across fork] (mp_fork.c): a child may only drop what it inherited.
        return RuntimeError(f"this pool was created in process {mp_pool_inherited(self._pool)}; "
                            f"a forked child (process {_os.getpid()}) must create its own pool")

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
            raise _closed_error(self)
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
        if rc != MP_OK:
            raise self._alloc_error(rc, n, handle)
        return _buffer_wrap(block, dt, code, minor, dims, 0, False, self.backend,
                            self.device_id, handle)
    # ---- end sharing ----

    cdef object _pointer_error(self, int rc, str op, uintptr_t p):
        if rc == MP_EFORKED:
            return self._forked_error()
        return _pointer_error(rc, op, p)

    cdef object _alloc_error(self, int rc, size_t nbytes, uintptr_t stream):
        # One snapshot, taken under the pool's lock where the fallback chain gave up (mp_oom):
        # what is cached then is what no release could return (free blocks inside segments
        # that hold live ones), so "cached but no block big enough" means fragmentation.
        cdef mp_oom rec
        if rc == MP_EFORKED:
            return self._forked_error()
        if mp_oom_take(&rec) != MP_OK or rec.pool != self._pool or rec.nbytes != nbytes:
            mp_oom_snapshot(self._pool, rc, nbytes, stream, &rec)   # refused before the pool
        rec.code = rc   # what the caller was told, should a record disagree
        # Note [One OOM explainer] (core/mp_oom.c): the PyTorch glue explains its refusals
        # with the same rules and words.
        cdef char text[1024]
        backend = self.backend.encode()
        mp_oom_message(self._pool, &rec, backend, self.device_id, MP_OOM_WORDS_POOL, text,
                       sizeof(text))
        message = text.decode()
        if rc not in (MP_ENOMEM, MP_ELIMIT):
            return OutOfMemoryError(message)
        reserved, used, cached = rec.reserved_bytes, rec.used_bytes, rec.cached_bytes
        largest = rec.largest_free_block
        error = OutOfMemoryError(message)
        error.record = dict(nbytes=rec.nbytes, rounded=rec.rounded, reserved_bytes=reserved,
                            used_bytes=used, pending_bytes=rec.pending_bytes, cached_bytes=cached,
                            largest_free_block=largest, num_ooms=rec.num_ooms)
        return error

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
        self._give_back(0)

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
        self._give_back(k)

    cdef int _give_back(self, size_t keep) except -1:
        """After empty_cache or trim on cuda: the cudaMemPool gives the device what the pool
        freed, beyond `keep` bytes (Note [Giving back to the device], mp_release.c). The core
        waits for the device first, and only when a segment was freed since its last call;
        while the pool knows of a CUDA graph capture, which a sync would break, nothing is
        done (MP_EBUSY) and a later call gives it back (the core released nothing meanwhile
        either, Note [Graph capture])."""
        if self._kind != _CUDA:
            return 0
        cdef int rc = mp_give_back(self._pool, keep)
        if rc == MP_OK or rc == MP_EBUSY:
            return 0
        raise RuntimeError(
            f"giving the freed memory back to device {self.device_id} failed: "
            f"{_cuda_error_text(mp_cuda_last_error(mp_pool_upstream(self._pool)))}")

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
        unknown = [k for k in options if k not in _SIZE_POLICY]
        if unknown:
            raise TypeError(f"set_size_policy: unknown option {unknown[0]!r}; it changes "
                            f"{', '.join(_SIZE_POLICY)} (the other options are fixed when "
                            f"the pool is made, except limit and release_threshold: "
                            f"set_limit, set_release_threshold)")
        # The options not given stay as the core has them (self.options is the caller's to
        # read, and may have been changed since).
        cdef const mp_config *cfg = mp_pool_config(self._pool)
        cdef size_t divisions[MP_ROUNDUP_INTERVALS]
        for i in range(MP_ROUNDUP_INTERVALS):
            divisions[i] = cfg.roundup_divisions[i]
        given = dict(options)
        if cfg.expandable_segments and given.get("max_split_size") is not None:
            given["expandable_segments"] = True   # normalize warns and drops it, as at creation
        parsed = _config.normalize(given)   # a list of division counts, each checked
        if "roundup_power2_divisions" in options:
            for i in range(MP_ROUNDUP_INTERVALS):
                divisions[i] = parsed["roundup_power2_divisions"][i]
        max_split = (_or_unlimited(parsed["max_split_size"]) if "max_split_size" in options
                     else cfg.max_split_size)
        gc = (parsed["garbage_collection_threshold"] if "garbage_collection_threshold" in options
              else cfg.gc_threshold)
        rc = mp_set_size_policy(self._pool, divisions, max_split, gc)
        if rc != MP_OK:   # the checks above are the core's; a refusal here is a bug
            raise RuntimeError(f"set_size_policy: the pool refused the policy (code {rc})")
        self.options.update(
            roundup_power2_divisions=[divisions[i] for i in range(MP_ROUNDUP_INTERVALS)],
            max_split_size=None if max_split == MP_UNLIMITED else max_split,
            garbage_collection_threshold=gc)

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
        ``num_stream_syncs``, ``num_event_records``, ``num_stream_queries`` (upstream calls).
        """
        self._ready()
        cdef mp_stats st
        mp_get_stats(self._pool, &st)
        cdef mp_stat *families[9]
        families[0] = st.allocation
        families[1] = st.segment
        families[2] = st.active
        families[3] = st.inactive_split
        families[4] = st.allocated_bytes
        families[5] = st.reserved_bytes
        families[6] = st.active_bytes
        families[7] = st.inactive_split_bytes
        families[8] = st.requested_bytes
        out = {}
        cdef int f, k
        for f in range(9):
            for k in range(3):
                _put_stat(out, f"{_STAT_FAMILIES[f]}.{_STAT_POOLS[k]}", families[f][k])
        _put_stat(out, "oversize_allocations", st.oversize_allocations)
        _put_stat(out, "oversize_segments", st.oversize_segments)
        _put_stat(out, "mapped_bytes", st.mapped_bytes)
        _put_stat(out, "va_reserved_bytes", st.va_reserved_bytes)
        out["num_alloc_retries"] = st.num_alloc_retries
        out["num_ooms"] = st.num_ooms
        out["num_sync_all_streams"] = st.num_sync_all_streams
        out["num_device_alloc"] = st.num_device_alloc
        out["num_device_free"] = st.num_device_free
        out["num_cross_stream_reuse"] = st.num_cross_stream_reuse
        out["num_event_waits"] = st.num_event_waits
        out["num_streams"] = st.num_streams
        out["num_stream_syncs"] = st.num_stream_syncs
        out["num_event_records"] = st.num_event_records
        out["num_stream_queries"] = st.num_stream_queries
        # The core's own: a policy set from C (a private pool following its device's, Note
        # [Private pools follow the size policy]) reaches it and not self.options.
        cdef size_t mss = mp_pool_config(self._pool).max_split_size
        out["max_split_size"] = -1 if mss == MP_UNLIMITED else <int64_t>mss
        if self._kind == _CUDA:
            out.update(_cuda_stats(self._cuda_handle))
        return out

    def reset_peak_stats(self):
        self._ready()
        mp_reset_peak_stats(self._pool)

    def reset_accumulated_stats(self):
        self._ready()
        mp_reset_accumulated_stats(self._pool)

    def check_invariants(self):
        """Raise :class:`InvariantError` on any breach of the pool's structural invariants.

        No gap or overlap between blocks, every segment covered by its blocks, no two
        adjacent free blocks of one stream left unmerged, every free block in its stream's
        free list, and every counter equal to what the blocks add up to.
        """
        self._ready()
        cdef char msg[512]
        if mp_check_invariants(self._pool, msg, sizeof(msg)) != MP_OK:
            raise InvariantError(msg.decode())

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
        cdef mp_layout lay
        if mp_layout_take(self._pool, &lay) != MP_OK:
            raise MemoryError("layout: out of host memory")
        segments = []
        cdef size_t i, j
        cdef mp_segment_view *sv
        cdef mp_block_view *bv
        try:
            for i in range(lay.nsegments):
                sv = &lay.segments[i]
                blocks = []
                for j in range(sv.first_block, sv.first_block + sv.nblocks):
                    bv = &lay.blocks[j]
                    blocks.append({"address": bv.ptr, "size": bv.nbytes,
                                   "requested_size": bv.requested,
                                   "last_requested_size": bv.last_requested, "stream": bv.stream,
                                   "state": bv.state})
                maps = [(lay.maps[2 * j], lay.maps[2 * j + 1])
                        for j in range(sv.first_map, sv.first_map + sv.nmaps)]
                segments.append({"address": sv.ptr, "total_size": sv.nbytes,
                                 "mapped_size": sv.mapped_bytes, "maps": maps,
                                 "stream": sv.stream,
                                 "is_small": bool(sv.is_small),
                                 "is_expandable": bool(sv.is_expandable),
                                 "is_pinned": bool(sv.is_pinned), "blocks": blocks})
        finally:
            mp_layout_free(&lay)
        segments.sort(key=lambda s: s["address"])
        return segments

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
        if not isinstance(enabled, bool):
            raise TypeError(f"record_history: enabled must be True or False, got {enabled!r}")
        cdef size_t n = 0
        if enabled:
            if isinstance(max_entries, bool) or not isinstance(max_entries, int) or max_entries <= 0:
                raise ValueError(f"record_history: max_entries must be an int > 0 (the number of "
                                 f"events kept), got {max_entries!r}")
            if max_entries >= 2 ** 64:
                raise ValueError(f"record_history: max_entries={max_entries} is out of range "
                                 f"(below 2**64 accepted)")
            n = max_entries
        if mp_trace_enable(self._pool, n) != MP_OK:
            raise MemoryError(f"record_history: no host memory for {max_entries} entries")

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
        cdef mp_trace_entry *entries = NULL
        cdef size_t n = 0, i
        if mp_trace_take(self._pool, &entries, &n) != MP_OK:
            raise MemoryError("history: out of host memory")
        try:
            return [(TRACE_ACTIONS[entries[i].action], entries[i].ptr, entries[i].nbytes,
                     entries[i].stream, entries[i].time_ns) for i in range(n)]
        finally:
            c_free(entries)

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


def _pointer_error(int rc, str op, uintptr_t p):
    """The exception for core code `rc` from a call on pointer `p` (not alloc's codes)."""
    if rc == MP_EINTERIOR:
        return ValueError(f"{op}: {p:#x} points inside a live block of this pool, not at its "
                          f"start")
    if rc == MP_EDOUBLEFREE:
        return ValueError(f"{op}: {p:#x} is not live: it lies in free memory of this pool "
                          f"(already freed?)")
    if rc == MP_ENOMEM:
        return MemoryError(f"{op}: out of host memory for the pool's bookkeeping")
    if rc == MP_EINVAL:
        return ValueError(f"{op}: too many streams recorded for {p:#x}: at most "
                          f"{MP_MAX_RECORDED_STREAMS} streams besides its own may be "
                          f"recorded on one block")
    return ValueError(f"{op}: {p:#x} is not a live pointer of this pool "
                      f"(never allocated here, or freed and its segment released)")


cdef _put_stat(dict out, str prefix, mp_stat s):
    out[prefix + ".current"] = s.current
    out[prefix + ".peak"] = s.peak
    out[prefix + ".allocated"] = s.allocated
    out[prefix + ".freed"] = s.freed


# --------------------------------------------------------------------- the CuPy hook

cdef object _MemoryPointer = None     # cupy.cuda.MemoryPointer, looked up once
cdef object _UnownedMemory = None


@cython.no_gc_clear   # the block must be freed even when a collected cycle holds it
cdef class _Allocation:
    """Owner of a block handed to CuPy: frees it when CuPy's memory object dies.

    It keeps the Pool object alive with a plain reference (no atomic C refcount on this
    path: the hook runs at every cupy.empty), and the Pool keeps the C pool."""
    cdef Pool _owner
    cdef uintptr_t ptr

    def __dealloc__(self):
        # A force-closed pool has let its C pool go, and the block with it (Note [Closing
        # a pool]): there is nothing left to free.
        if self._owner is not None and self._owner._pool != NULL:
            mp_free(self._owner._pool, self.ptr, 0, 0)


cdef object _cupy_malloc(Pool pool, object nbytes):
    global _MemoryPointer, _UnownedMemory
    pool._ready()
    if _MemoryPointer is None:
        import cupy.cuda
        _MemoryPointer, _UnownedMemory = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    cdef size_t n = _as_nbytes(nbytes, "nbytes")
    if n == 0:
        # As CuPy's own pools: an empty allocation is a null pointer, freeing nothing.
        return _MemoryPointer(_UnownedMemory(0, 0, None, pool.device_id), 0)
    cdef uintptr_t s = 0
    pool._stream_of(None, &s)
    cdef uintptr_t ptr = 0
    pool._in_core += 1   # Note [Closing a pool]
    mp_py_mark(1)
    cdef int rc = mp_alloc(pool._pool, n, s, &ptr)
    mp_py_mark(0)
    pool._in_core -= 1
    if rc != MP_OK:
        raise pool._alloc_error(rc, n, s)
    cdef _Allocation owner = _Allocation.__new__(_Allocation)
    owner._owner = pool
    owner.ptr = ptr
    return _MemoryPointer(_UnownedMemory(ptr, n, owner, pool.device_id), 0)


def _share_limit(Pool member not None, Pool owner not None):
    """For tests of Note [Shared limit] (mp_release.c): make `member` count its reserved
    bytes against `owner`'s limit too, as the torch glue does with the private pools of a
    device (the pool of a CUDA graph or a MemPool, which needs CUDA). Raises ValueError
    where the core refuses (see mp_share_limit in mp_core.h)."""
    member._ready()
    owner._ready()
    cdef int rc = mp_share_limit(member._pool, owner._pool)
    if rc == MP_EBUSY:
        raise ValueError("member: it holds memory already; share a limit before the first "
                         "segment")
    if rc != MP_OK:
        raise ValueError("member: the same pool as owner, a member already, or a pool "
                         "whose limit others share; owner: not a member itself")
