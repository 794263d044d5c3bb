# Several devices: which device a simulated pool is, and peer access (another device reading
# and writing a pool's memory) on every backend. The Pool methods enable_peer_access,
# peer_devices and access_devices (mempool/_pool.pxi) call the functions here with the C pool,
# its backend kind and device; the C side is mp_sim_peers.c (the simulated record) and
# mp_cuda_peers.c ("Note [Peer access]"). See docs/multigpu.md. Uses _common.pxi.
from libc.stdint cimport uint64_t, uintptr_t


#: Simulated devices: ordinals in [0, SIM_MAX_DEVICES); device k's addresses start at
#: the sim's base + k * SIM_DEVICE_SPAN, so no two devices share an address.
SIM_MAX_DEVICES = MP_SIM_MAX_DEVICES
SIM_DEVICE_SPAN = MP_SIM_DEVICE_SPAN


cdef int _sim_place(mp_upstream *up, int device) except -1:
    """Make the fresh sim upstream at `up` simulated device `device`; on a bad ordinal the
    upstream is destroyed and ValueError raised."""
    if mp_sim_set_device(<mp_sim *>up.ctx, device) == MP_OK:
        return 0
    up.destroy(up.ctx)
    raise ValueError(f"device must be a simulated device ordinal in [0, {MP_SIM_MAX_DEVICES}) "
                     f"for backend 'sim', got {device}")


cdef tuple _mask_devices(uint64_t mask):
    return tuple(d for d in range(64) if mask >> d & 1)


cdef int _peer_ordinal(int device_id, object peer_device) except -1:
    """The checks every backend shares; the upstream checks the device count."""
    if isinstance(peer_device, bool) or not hasattr(peer_device, "__index__"):
        raise TypeError(f"peer_device must be an int device ordinal, got "
                        f"{type(peer_device).__name__} {peer_device!r}")
    peer = peer_device.__index__()
    if peer < 0:
        raise ValueError(f"peer_device must be a device ordinal >= 0, got {peer}")
    if peer == device_id:
        raise ValueError(f"peer_device {peer} is the pool's own device, which always has "
                         f"access; pass another device's ordinal")
    if peer >= 2 ** 31:
        raise ValueError(f"peer_device {peer} is not a device ordinal (too large)")
    return peer


cdef int _enable_peer_access(mp_pool *pool, int kind, int device_id,
                             object peer_device) except -1:
    if kind == _HOST:
        raise ValueError("enable_peer_access: backend 'host' allocates host memory, which "
                         "belongs to no device; peer access applies to backend 'cuda' (and "
                         "'sim', which models it)")
    cdef int peer = _peer_ordinal(device_id, peer_device)
    cdef int rc
    cdef char err[512]
    err[0] = 0
    if kind == _SIM:
        if peer >= MP_SIM_MAX_DEVICES:
            raise ValueError(f"peer_device must be a simulated device ordinal in "
                             f"[0, {MP_SIM_MAX_DEVICES}), got {peer}")
        rc = mp_sim_enable_peer(<mp_sim *>mp_pool_upstream(pool).ctx, peer)
        if rc != MP_OK:
            raise ValueError(f"peer_device {peer} refused by the simulated device (error {rc})")
        return 0
    with nogil:
        rc = mp_cuda_enable_peer_access(mp_pool_upstream(pool), peer, err, sizeof(err))
    if rc == MP_OK:
        return 0
    text = err.decode("utf-8", "replace")
    if rc == MP_EINVAL:
        raise ValueError(f"enable_peer_access: {text}")
    raise RuntimeError(f"enable_peer_access({peer}) on cuda device {device_id}: {text}")


cdef tuple _peer_devices(mp_pool *pool, int kind):
    cdef int out[64]
    cdef size_t n
    if kind == _SIM:
        return _mask_devices(mp_sim_peer_mask(<mp_sim *>mp_pool_upstream(pool).ctx))
    if kind == _CUDA:
        n = mp_cuda_peer_devices(mp_pool_upstream(pool), out, 64)
        if n > 64:
            n = 64
        return tuple([out[i] for i in range(n)])
    return ()


cdef tuple _access_devices(mp_pool *pool, int kind, object ptr):
    cdef uintptr_t p = _as_pointer(ptr)
    cdef size_t nbytes = 0, requested = 0
    cdef uintptr_t stream = 0
    if mp_block_info(pool, p, &nbytes, &requested, &stream) != MP_OK:
        raise ValueError(f"access_devices: {p:#x} is not the start of a live block of this pool")
    cdef uint64_t mask = 0
    cdef int rc
    cdef char err[512]
    err[0] = 0
    if kind == _SIM:
        mask = mp_sim_access_mask(<mp_sim *>mp_pool_upstream(pool).ctx, p, nbytes)
    elif kind == _CUDA:
        with nogil:
            rc = mp_cuda_access_mask(mp_pool_upstream(pool), p, nbytes, &mask, err,
                                     sizeof(err))
        if rc != MP_OK:
            raise RuntimeError(f"access_devices: {err.decode('utf-8', 'replace')}")
    else:
        return ()
    return _mask_devices(mask)
