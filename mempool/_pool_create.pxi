# Making a pool's C core from its normalized options: the defaults of sim and host devices,
# the upstream each backend draws from, and the core's mp_config. Takes the options and gives
# the C pool back; the Pool (_pool.pxi) sets its own fields from what is returned.
#
# Uses argument checks and backend kinds (_common), the CUDA upstream and its cudaMemPool
# (_cuda, _cudapool), CuPy's current stream (_streams), the placement of sim devices (_peers).
from mempool import _config
from mempool._units import format_bytes as _fmt
from mempool._errors import OutOfMemoryError

cdef size_t _DEFAULT_GRANULARITY = _config.DEFAULT_GRANULARITY
_DEFAULT_CAPACITY = _config.DEFAULT_CAPACITY


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


cdef tuple _pool_create(dict opts, mp_pool **out):
    """Make the C pool that `opts` (normalized) describe, into `out[0]`; returns (capacity,
    the cudaMemPool handle, the lookup of CuPy's current stream; None for the last two but on
    cuda). Resolves the defaults `opts` leaves open (granularity, limit in bytes,
    segment_rounding) in `opts`. A failure raises and destroys what was made, so the caller
    holds nothing half made."""
    # Note [Set-up during a capture] (mp_cuda.c): a cuda Pool's driver calls in the
    # thread's relaxed capture mode, so that a CUDA graph captured meanwhile (the global
    # mode included) neither refuses them nor is broken by them.
    cdef int capture_mode = -1
    if _BACKENDS[opts["backend"]] == _CUDA:
        capture_mode = mp_cuda_relax_capture_mode()
    try:
        return _pool_build(opts, out)
    finally:
        mp_cuda_restore_capture_mode(capture_mode)


cdef tuple _pool_build(dict opts, mp_pool **out):
    """_pool_create's work, on locals until the C pool exists."""
    backend_name = opts["backend"]
    cdef int device_id = opts["device"]
    cdef int kind = _BACKENDS[backend_name]
    granularity = opts["granularity"]
    cdef size_t gran = _DEFAULT_GRANULARITY if granularity is None else granularity
    if kind != _CUDA:
        opts["granularity"] = gran   # the page size in use, default resolved
        if opts["ipc"] is None:
            opts["ipc"] = kind == _SIM   # the sim models sharing; host memory needs memfds
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
        # Note [Host sharing] (mp_host.c): memfd-backed only when the pool shares.
        if kind == _HOST and opts["ipc"]:
            mp_host_set_shareable(&up, 1)
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
        cfg.map_ahead = opts["map_ahead"] or 0
        cfg.capture_reuse = 1 if opts["graph_capture_record_stream_reuse"] else 0
        if cfg.expandable_segments and up.map == NULL:
            raise ValueError(f"expandable_segments is not supported by the {backend_name} "
                             f"upstream")
    except BaseException:
        up.destroy(up.ctx)
        raise
    rc = mp_pool_create(&cfg, &up, &pool)
    if rc == MP_OK:
        if kind == _CUDA:
            mp_cuda_bind_errors(mp_pool_upstream(pool))
        out[0] = pool
        return total, cuda_handle, current
    # mp_pool_create destroys the upstream only when reserving initial_pool_size failed
    # (it has made a pool by then); every earlier failure leaves it to us.
    if not (rc == MP_ENOMEM and cfg.initial_pool_size):
        up.destroy(up.ctx)
    if rc == MP_ENOMEM:
        raise OutOfMemoryError(
            f"initial_pool_size of {_fmt(cfg.initial_pool_size, exact=True)} could not be "
            f"reserved on {backend_name} device {device_id} (capacity {_fmt(total)})")
    raise ValueError(f"invalid pool configuration (error {rc})")
