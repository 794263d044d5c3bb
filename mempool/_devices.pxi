# A test control, apart from the product's allocation paths (none uses it): pool.device, what
# tests and the demo do to the simulated and host devices (complete streams, inject failures,
# hold calls, read counters); the C side is upstream/mp_sim*.c and upstream/mp_host.c. Each
# holds a reference on the C pool (not on the Python Pool, so no reference cycle), which keeps
# the upstream alive. Uses _common.pxi; made from the C pool, never the Pool.
from libc.stdint cimport uint64_t, uintptr_t


cdef class _DeviceBase:
    cdef mp_pool *_pool
    cdef readonly str backend

    def __init__(self, *args, **kwargs):
        raise TypeError(f"mempool.{type(self).__name__} is made by its Pool: use pool.device")

    def __dealloc__(self):
        if self._pool != NULL:
            mp_pool_release(self._pool)

    cdef int _ready(self) except -1:
        """Refuse a device not made by a Pool (made with __new__): it has no upstream."""
        if self._pool == NULL:
            raise _not_initialised(self)
        return 0

    cdef mp_budget *_budget(self) except NULL:
        self._ready()   # a _DeviceBase is only ever made by __new__: this raises
        raise TypeError(f"{type(self).__name__} has no device budget")

    cdef void _lock(self):
        pass

    cdef void _unlock(self):
        pass

    def fail_next(self, n=1):
        """Make the next ``n`` upstream allocations (segments or page maps) fail as OOM."""
        cdef size_t k = _as_nbytes(n, "n")
        cdef mp_budget *b = self._budget()
        self._lock()
        b.fail_next = k
        self._unlock()

    def fail_map_after(self, pages):
        """Make the next page map fail after mapping ``pages`` pages (undone: all or nothing)."""
        cdef size_t k = _as_nbytes(pages, "pages")
        cdef mp_budget *b = self._budget()
        self._lock()
        b.fail_map_after = k
        self._unlock()

    @property
    def capacity(self):
        return self._budget().capacity

    @property
    def used_bytes(self):
        """Bytes the device has handed out (segments and mapped pages)."""
        return self._budget().used

    @property
    def peak_bytes(self):
        return self._budget().peak

    def counters(self):
        """Upstream calls seen by the device."""
        cdef mp_budget *b = self._budget()
        return {"allocs": b.num_allocs, "frees": b.num_frees, "maps": b.num_maps,
                "unmaps": b.num_unmaps, "failed": b.num_failed}


def _hold_args(n, timeout):
    """SimDevice.hold_* arguments: (count, timeout in ms), checked."""
    cdef size_t k = _as_nbytes(n, "n")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or \
            not 0 < timeout <= 3600:
        raise ValueError(f"timeout must be a number of seconds in (0, 3600], got {timeout!r}")
    if k > 1 << 31:
        raise ValueError(f"n must be at most 2**31, got {n}")
    return k, int(timeout * 1000)


cdef class SimDevice(_DeviceBase):
    """The simulated device behind a ``Pool(backend="sim")``.

    Work queued on a stream (:meth:`launch`) completes only when the test says so
    (:meth:`complete`, :meth:`complete_all`, or a stream sync by the pool); events recorded
    on a stream complete with the work queued before them; a stream that waits on an event
    is ordered after that work (:meth:`ordered`).
    """
    cdef mp_sim *_sim

    cdef mp_budget *_budget(self) except NULL:
        self._ready()
        return mp_sim_budget(self._sim)

    cdef void _lock(self):
        mp_sim_lock(self._sim)

    cdef void _unlock(self):
        mp_sim_unlock(self._sim)

    def launch(self, stream=0):
        """Queue work on ``stream``; returns its sequence number on that stream."""
        self._ready()
        return mp_sim_launch(self._sim, stream_handle(stream))

    def complete(self, stream=0):
        """Finish all work queued on ``stream`` (and what it waited for)."""
        self._ready()
        mp_sim_complete(self._sim, stream_handle(stream))

    def complete_all(self):
        self._ready()
        mp_sim_complete_all(self._sim)

    def ordered(self, stream, other, seq):
        """True when work queued on ``stream`` from now on runs after ``other``'s work up
        to ``seq``: that work is complete, or ``stream`` waits on an event covering it."""
        self._ready()
        cdef uint64_t c_seq = _as_nbytes(seq, "seq")
        return bool(mp_sim_ordered(self._sim, stream_handle(stream), stream_handle(other), c_seq))

    def hold_allocs(self, n=1, timeout=2.0):
        """Hold the next ``n`` segment allocations or page maps (expandable segments) of the
        device: each waits inside the upstream call, as a driver call that blocks, until
        :meth:`release_held` or ``timeout`` seconds (then counted in
        ``counters()["hold_timeouts"]``)."""
        self._ready()
        cdef unsigned k, ms
        k, ms = _hold_args(n, timeout)
        mp_sim_hold_allocs(self._sim, k, ms)

    def hold_syncs(self, n=1, timeout=2.0):
        """Hold the next ``n`` stream synchronizations the same way (:meth:`hold_allocs`)."""
        self._ready()
        cdef unsigned k, ms
        k, ms = _hold_args(n, timeout)
        mp_sim_hold_syncs(self._sim, k, ms)

    def hold_event_creates(self, n=1, timeout=2.0):
        """Hold the next ``n`` event creations the same way (:meth:`hold_allocs`). A pool
        creates events only without its lock (Note [Events outside the lock])."""
        self._ready()
        cdef unsigned k, ms
        k, ms = _hold_args(n, timeout)
        mp_sim_hold_event_creates(self._sim, k, ms)

    def hold_va_reserves(self, n=1, timeout=2.0):
        """Hold the next ``n`` address-space reservations (the ranges of expandable
        segments) the same way (:meth:`hold_allocs`); a pool makes them without its lock."""
        self._ready()
        cdef unsigned k, ms
        k, ms = _hold_args(n, timeout)
        mp_sim_hold_va_reserves(self._sim, k, ms)

    @property
    def held(self):
        """Calls waiting in the device now: segment allocations, page maps, stream syncs,
        event creations and address reservations (:meth:`hold_allocs`)."""
        self._ready()
        return mp_sim_held(self._sim)

    def release_held(self):
        """Let every held call go on."""
        self._ready()
        mp_sim_release_held(self._sim)

    def set_call_delays(self, map_ns=0, unmap_ns=0):
        """Make every page map and unmap from now on take ``map_ns`` / ``unmap_ns``
        nanoseconds (0: none), slept outside the device's lock, as a driver's call takes its
        time whatever its size; the counters are unchanged. For measuring where that time
        falls (the mapper, ``map_ahead``; ``python -m mempool replay --sim-delays``)."""
        self._ready()
        cdef uint64_t m = _as_nbytes(map_ns, "map_ns"), u = _as_nbytes(unmap_ns, "unmap_ns")
        mp_sim_set_call_delays(self._sim, m, u)

    # ---- graph capture (docs/architecture.md, Note [Graph capture]) ----
    def begin_capture(self, stream):
        """Make ``stream`` capture a CUDA graph, as ``cuStreamBeginCapture`` in the driver's
        global mode. Until :meth:`end_capture`, every call a real driver refuses during a
        capture or that would break it (a stream or device sync, a stream query, any event
        query, an event wait across the capture's edge, a segment free, an unmap) fails, is
        counted in :attr:`capture_violations` and invalidates the capture. Segment
        allocations on the capturing stream are made outside the graph, as the ``cuda``
        upstream's ``cuMemAlloc`` (:attr:`capture_allocs`); page maps are allowed.

        Raises ``ValueError`` for the legacy stream (0 or 1), which cannot capture, or a
        stream that captures already."""
        self._ready()
        cdef uintptr_t s = stream_handle(stream)
        rc = mp_sim_begin_capture(self._sim, s)
        if rc == MP_EINVAL:
            raise ValueError(f"begin_capture: the legacy default stream ({s}) cannot capture; "
                             f"use another stream")
        if rc == MP_EBUSY:
            raise ValueError(f"begin_capture: stream {s:#x} is capturing already")
        if rc != MP_OK:
            raise MemoryError("begin_capture: out of host memory")

    def capture_join(self, stream, other):
        """``stream`` waits for ``other`` inside other's capture, as an event recorded on
        ``other`` and waited on by ``stream`` (``stream.wait_stream(other)`` in PyTorch):
        work ``stream`` captures next depends on what both captured so far, and a stream that
        did not capture joins other's capture (Note [Sim capture graphs] in mp_sim.c).
        :meth:`launch` on a capturing stream adds a node to the capture's graph. Raises
        ``ValueError`` when ``other`` does not capture, the two capture apart, or ``stream``
        is the legacy stream or ``other``."""
        self._ready()
        cdef uintptr_t s = stream_handle(stream), o = stream_handle(other)
        rc = mp_sim_capture_join(self._sim, s, o)
        if rc == MP_EINVAL:
            raise ValueError(f"capture_join: stream {s:#x} cannot wait for stream {o:#x} in "
                             f"a capture: {o:#x} must capture, {s:#x} must capture in the same "
                             f"capture or not at all, and neither may be the legacy stream "
                             f"nor both the same")
        if rc != MP_OK:
            raise MemoryError("capture_join: out of host memory")

    def end_capture(self, stream):
        """End the capture on ``stream``, and on every stream that joined it
        (:meth:`capture_join`). Raises ``RuntimeError`` when an illegal call invalidated it
        (the capture ends all the same, as ``cuStreamEndCapture`` does), and ``ValueError``
        when ``stream`` was not capturing."""
        self._ready()
        cdef uintptr_t s = stream_handle(stream)
        rc = mp_sim_end_capture(self._sim, s)
        if rc == MP_EINVAL:
            raise ValueError(f"end_capture: stream {s:#x} is not capturing")
        if rc != MP_OK:
            raise RuntimeError(f"end_capture: the capture on stream {s:#x} was invalidated "
                               f"by an illegal call ({self.capture_violations} so far)")

    def is_capturing(self, stream):
        """True between :meth:`begin_capture` and :meth:`end_capture` of ``stream``."""
        self._ready()
        return bool(mp_sim_is_capturing(self._sim, stream_handle(stream)))

    @property
    def capture_violations(self):
        """Calls made during a capture that a real driver refuses or that break it."""
        self._ready()
        cdef uint64_t violations = 0, allocs = 0
        mp_sim_capture_counts(self._sim, &violations, &allocs)
        return violations

    @property
    def capture_allocs(self):
        """Segments allocated outside a graph for a capturing stream."""
        self._ready()
        cdef uint64_t violations = 0, allocs = 0
        mp_sim_capture_counts(self._sim, &violations, &allocs)
        return allocs

    def destroy_stream(self, stream):
        """Destroy a stream as ``cudaStreamDestroy`` does: its queued work completes, and its
        handle may name a new stream later. ``ValueError`` for a stream the device never saw."""
        self._ready()
        cdef uintptr_t s = stream_handle(stream)
        cdef int rc = mp_sim_destroy_stream(self._sim, s)
        if rc == MP_EINVAL:
            raise ValueError(f"destroy_stream: stream {s:#x} is not a stream of this device")
        if rc != MP_OK:
            raise MemoryError("destroy_stream: out of host memory")

    def fail_events(self, n=1):
        """Make the next ``n`` event records fail, as a driver out of resources would."""
        self._ready()
        cdef size_t k = _as_nbytes(n, "n")
        if k > 0xFFFFFFFF:
            raise ValueError(f"fail_events: n must be at most 2**32-1; got {n!r}")
        mp_sim_fail_events(self._sim, <unsigned>k)

    @property
    def held_bytes(self):
        """Bytes the device holds now: ``used_bytes`` plus segments freed behind work of
        their stream not yet complete, which a cudaMemPool keeps until that work has run
        (Note [Frees the driver keeps] in mp_sim.c). They count against the capacity: an
        allocation that fits only in them fails as out of memory."""
        self._ready()
        return mp_sim_held_bytes(self._sim)

    @property
    def held_peak_bytes(self):
        """The most ``held_bytes`` reached at any segment allocation or page map."""
        self._ready()
        return mp_sim_held_peak(self._sim)

    def stream_info(self, stream=0):
        self._ready()
        cdef uint64_t submitted = 0, completed = 0
        mp_sim_stream_info(self._sim, stream_handle(stream), &submitted, &completed)
        return {"submitted": submitted, "completed": completed}

    def counters(self):
        out = _DeviceBase.counters(self)
        out.update(syncs=mp_sim_num_syncs(self._sim),
                   stream_queries=mp_sim_num_queries(self._sim),
                   event_records=mp_sim_num_event_records(self._sim),
                   event_creates=mp_sim_num_event_creates(self._sim),
                   waits=mp_sim_num_waits(self._sim), errors=mp_sim_num_errors(self._sim),
                   live_segments=mp_sim_live_segments(self._sim),
                   live_events=mp_sim_live_events(self._sim),
                   mapped_bytes=mp_sim_mapped_bytes(self._sim),
                   live_maps=mp_sim_live_maps(self._sim),
                   open_imports=mp_sim_open_imports(self._sim),
                   imports_opened=mp_sim_imports_opened(self._sim),
                   split_unmaps=mp_sim_num_split_unmaps(self._sim),
                   streams=mp_sim_num_streams(self._sim),
                   hold_timeouts=mp_sim_hold_timeouts(self._sim))
        return out


cdef class HostDevice(_DeviceBase):
    """The host-memory device behind a ``Pool(backend="host")``: streams are always complete."""
    cdef void *_ctx

    cdef mp_budget *_budget(self) except NULL:
        self._ready()
        return mp_host_budget(self._ctx)

    cdef void _lock(self):
        mp_host_lock(self._ctx)

    cdef void _unlock(self):
        mp_host_unlock(self._ctx)

    def launch(self, stream=0):
        self._ready()
        stream_handle(stream)   # the same checks as the simulated device's
        return 0

    def complete(self, stream=0):
        self._ready()
        stream_handle(stream)

    def complete_all(self):
        self._ready()


cdef object _make_device(mp_pool *pool, int kind):
    """The device control of the C pool `pool` of backend `kind` (None for cuda), holding a
    reference on it."""
    cdef SimDevice sim
    cdef HostDevice host
    if kind == _SIM:
        sim = SimDevice.__new__(SimDevice)
        sim._sim = <mp_sim *>mp_pool_upstream(pool).ctx
        sim._pool = pool
        sim.backend = "sim"
        mp_pool_retain(pool)
        return sim
    if kind == _HOST:
        host = HostDevice.__new__(HostDevice)
        host._ctx = mp_pool_upstream(pool).ctx
        host._pool = pool
        host.backend = "host"
        mp_pool_retain(pool)
        return host
    return None
