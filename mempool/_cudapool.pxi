# The Pool's use of the CUDA upstream: choosing and configuring the cudaMemPool (through
# mempool/_cuda.py, CuPy's runtime bindings) and reading its attributes into stats().
# Uses _cuda.pxi and _streams.pxi; takes the cudaMemPool handle, never the Pool.
from libc.stdint cimport uintptr_t


# The page of expandable segments on cuda unless the `granularity` option sets one: the
# driver's granularity times the smallest power of two reaching this (mempool/_conf_options.py).
cdef size_t _DEFAULT_CUDA_PAGE = _config.DEFAULT_CUDA_PAGE


cdef object _make_cuda(mp_upstream *up, int device, dict opts):
    """Fill `up` with the cuda-pool upstream; returns (cudaMemPool handle, owned)."""
    from mempool import _cuda
    if not _cuda.available():
        raise RuntimeError(
            "backend='cuda' needs CuPy and a CUDA device, and none was found; "
            "use backend='sim' (simulated device) or 'host' on a machine without a GPU")
    # Sharing with other processes needs a cudaMemPool made for it (docs/sharing.md).
    ipc = opts["ipc"]
    if ipc and opts["pool_handle"] != "create":
        raise ValueError(f"option 'ipc' (True) needs pool_handle='create' (the default), not "
                         f"{opts['pool_handle']!r}: only a cudaMemPool the Pool creates can "
                         f"be shared with other processes")
    if ipc is None:
        ipc = opts["pool_handle"] == "create" and _cuda.shareable_supported(device)
    elif ipc and not _cuda.shareable_supported(device):
        raise RuntimeError(f"option 'ipc' (True): device {device}'s driver cannot share a "
                           f"cudaMemPool through POSIX file descriptors")
    opts["ipc"] = bool(ipc)
    handle, owned = _cuda.resolve_pool_handle(opts["pool_handle"], device,
                                              shareable=opts["ipc"])
    try:
        _cuda.configure(
            handle,
            release_threshold=_cuda.driver_release_threshold(opts["pool_handle"],
                                                             opts["release_threshold"]),
            reuse_follow_event_dependencies=opts["reuse_follow_event_dependencies"],
            reuse_allow_opportunistic=opts["reuse_allow_opportunistic"],
            reuse_allow_internal_dependencies=opts["reuse_allow_internal_dependencies"])
        _make_cuda_upstream(up, device, handle)
        if mp_cuda_set_shareable(up, 1 if opts["ipc"] else 0) != MP_OK:
            up.destroy(up.ctx)
            raise RuntimeError(f"option 'ipc' (True): device {device}'s upstream cannot share")
    except BaseException:
        if owned:
            _cuda.destroy(handle)
        raise
    page = opts["granularity"]
    if page is None and up.granularity:
        page = up.granularity
        while page < _DEFAULT_CUDA_PAGE:
            page *= 2
    if page is not None:
        try:
            _set_cuda_page_size(up, page)
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


cdef int _cuda_set_release_threshold(object handle, object pool_handle,
                                     object value) except -1:
    """Set the cudaMemPool's release threshold for the pool option's `value`."""
    from mempool import _cuda
    _cuda.configure(handle,
                    release_threshold=_cuda.driver_release_threshold(pool_handle, value))
    return 0


cdef dict _cuda_stats(object handle):
    """The cudaMemPool's own Reserved/Used Current/High attributes."""
    from mempool import _cuda
    # Note [Set-up during a capture] (mp_cuda_capture.c): read in the thread's relaxed capture mode,
    # as a metrics thread (mempool.prometheus) may read them while another thread captures.
    cdef int capture_mode = mp_cuda_relax_capture_mode()
    try:
        return {f"cuda_pool.{k}": v for k, v in _cuda.attributes(handle).items()}
    finally:
        mp_cuda_restore_capture_mode(capture_mode)
