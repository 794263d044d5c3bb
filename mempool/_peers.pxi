# Several devices: which device a simulated pool is, and peer access (another device reading
# and writing a pool's memory) on every backend. The Pool methods enable_peer_access,
# peer_devices and access_devices (mempool/_pool.pxi) call the functions here; the C side is
# mp_sim.c (the simulated record) and mp_cuda.c ("Note [Peer access]"). See docs/multigpu.md.
from libc.stdint cimport uint64_t, uintptr_t

cdef extern from "mp_sim.h" nogil:
    int MP_SIM_MAX_DEVICES
    uintptr_t MP_SIM_DEVICE_SPAN
    int mp_sim_set_device(mp_sim *sim, int device)
    int mp_sim_enable_peer(mp_sim *sim, int peer)
    uint64_t mp_sim_peer_mask(mp_sim *sim)
    uint64_t mp_sim_access_mask(mp_sim *sim, uintptr_t addr, size_t nbytes)

cdef extern from "mp_cuda.h" nogil:
    int mp_cuda_enable_peer_access(void *up, int peer, char *err, size_t errlen)
    size_t mp_cuda_peer_devices(const void *up, int *out, size_t cap)
    int mp_cuda_access_mask(const void *up, uintptr_t addr, size_t nbytes, uint64_t *mask,
                            char *err, size_t errlen)

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


cdef int _peer_ordinal(Pool pool, object peer_device) except -1:
    """The checks every backend shares; the upstream checks the device count."""
    if isinstance(peer_device, bool) or not hasattr(peer_device, "__index__"):
        raise TypeError(f"peer_device must be an int device ordinal, got "
                        f"{type(peer_device).__name__} {peer_device!r}")
    peer = peer_device.__index__()
    if peer < 0:
        raise ValueError(f"peer_device must be a device ordinal >= 0, got {peer}")
    if peer == pool.device_id:
        raise ValueError(f"peer_device {peer} is the pool's own device, which always has "
                         f"access; pass another device's ordinal")
    if peer >= 2 ** 31:
        raise ValueError(f"peer_device {peer} is not a device ordinal (too large)")
    return peer


def _enable_peer_access(Pool pool not None, peer_device):
    pool._ready()
    if pool._kind == _HOST:
        raise ValueError("enable_peer_access: backend 'host' allocates host memory, which "
                         "belongs to no device; peer access applies to backend 'cuda' (and "
                         "'sim', which models it)")
    cdef int peer = _peer_ordinal(pool, peer_device)
    cdef int rc
    cdef char err[512]
    err[0] = 0
    if pool._kind == _SIM:
        if peer >= MP_SIM_MAX_DEVICES:
            raise ValueError(f"peer_device must be a simulated device ordinal in "
                             f"[0, {MP_SIM_MAX_DEVICES}), got {peer}")
        rc = mp_sim_enable_peer(<mp_sim *>mp_pool_upstream(pool._pool).ctx, peer)
        if rc != MP_OK:
            raise ValueError(f"peer_device {peer} refused by the simulated device (error {rc})")
        return
    with nogil:
        rc = mp_cuda_enable_peer_access(mp_pool_upstream(pool._pool), peer, err, sizeof(err))
    if rc == MP_OK:
        return
    text = err.decode("utf-8", "replace")
    if rc == MP_EINVAL:
        raise ValueError(f"enable_peer_access: {text}")
    raise RuntimeError(f"enable_peer_access({peer}) on cuda device {pool.device_id}: {text}")


def _peer_devices(Pool pool not None):
    pool._ready()
    cdef int out[64]
    cdef size_t n
    if pool._kind == _SIM:
        return _mask_devices(mp_sim_peer_mask(<mp_sim *>mp_pool_upstream(pool._pool).ctx))
    if pool._kind == _CUDA:
        n = mp_cuda_peer_devices(mp_pool_upstream(pool._pool), out, 64)
        if n > 64:
            n = 64
        return tuple([out[i] for i in range(n)])
    return ()


def _access_devices(Pool pool not None, ptr):
    pool._ready()
    cdef uintptr_t p = _as_pointer(ptr)
    cdef size_t nbytes = 0, requested = 0
    cdef uintptr_t stream = 0
    if mp_block_info(pool._pool, p, &nbytes, &requested, &stream) != MP_OK:
        raise ValueError(f"access_devices: {p:#x} is not the start of a live block of this pool")
    cdef uint64_t mask = 0
    cdef int rc
    cdef char err[512]
    err[0] = 0
    if pool._kind == _SIM:
        mask = mp_sim_access_mask(<mp_sim *>mp_pool_upstream(pool._pool).ctx, p, nbytes)
    elif pool._kind == _CUDA:
        with nogil:
            rc = mp_cuda_access_mask(mp_pool_upstream(pool._pool), p, nbytes, &mask, err,
                                     sizeof(err))
        if rc != MP_OK:
            raise RuntimeError(f"access_devices: {err.decode('utf-8', 'replace')}")
    else:
        return ()
    return _mask_devices(mask)
