# The Pool's use of the CUDA upstream: choosing and configuring the cudaMemPool (through
# mempool/_cuda.py, CuPy's runtime bindings) and reading its attributes into stats().

_UINT64_MAX = 2 ** 64 - 1


cdef object _make_cuda(mp_upstream *up, int device, dict opts):
    """Fill `up` with the cuda-pool upstream; returns (cudaMemPool handle, owned)."""
    from mempool import _cuda
    if not _cuda.available():
        raise RuntimeError(
            "backend='cuda' needs CuPy and a CUDA device, and none was found; "
            "use backend='sim' (simulated device) or 'host' on a machine without a GPU")
    handle, owned = _cuda.resolve_pool_handle(opts["pool_handle"], device)
    try:
        _cuda.configure(
            handle,
            release_threshold=_UINT64_MAX if opts["release_threshold"] is None
            else opts["release_threshold"],
            reuse_follow_event_dependencies=opts["reuse_follow_event_dependencies"],
            reuse_allow_opportunistic=opts["reuse_allow_opportunistic"],
            reuse_allow_internal_dependencies=opts["reuse_allow_internal_dependencies"])
        _make_cuda_upstream(up, device, handle)
    except BaseException:
        if owned:
            _cuda.destroy(handle)
        raise
    if opts["granularity"] is not None:
        try:
            _set_cuda_page_size(up, opts["granularity"])
        except BaseException:
            up.destroy(up.ctx)   # the upstream does not own the cudaMemPool yet
            if owned:
                _cuda.destroy(handle)
            raise
    if owned:
        mp_cuda_own_pool(up)   # the upstream destroys it after the last segment is freed
    return handle


cdef _CurrentStream _cuda_current_stream(int device):
    """The lookup of CuPy's current stream on `device`, the pool's own (CuPy keeps one per
    device, and the current device's may belong to another GPU than the pool's), through
    CuPy's C layer where it can be read (Note [Current stream], _streams.pxi)."""
    import cupy.cuda
    try:
        import cupy_backends.cuda.stream as backend
        capi = getattr(backend, "__pyx_capi__", None)
    except ImportError:
        capi = None
    return _CurrentStream(cupy.cuda.get_current_stream, capi, device)


def _cuda_set_release_threshold(Pool pool not None):
    pool._ready()
    from mempool import _cuda
    value = pool.options["release_threshold"]
    _cuda.configure(pool._cuda_handle, release_threshold=_UINT64_MAX if value is None else value)


def _cuda_trim(Pool pool not None, keep):
    pool._ready()
    from mempool import _cuda
    # The driver trims only frees it has seen complete: sync the device first.
    _cuda.trim_to(pool._cuda_handle, keep, sync_device=pool.device_id)


def _cuda_stats(Pool pool not None):
    """The cudaMemPool's own Reserved/Used Current/High attributes."""
    pool._ready()
    from mempool import _cuda
    return {f"cuda_pool.{k}": v for k, v in _cuda.attributes(pool._cuda_handle).items()}
