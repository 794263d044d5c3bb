# The PyTorch pluggable allocator's registry (see mempool/torch.py and mp_torch.h).
#
# The entry points PyTorch calls are C functions of this extension (mp_torch.c); this file
# only routes devices to pools and hands out the entry points' addresses.
from libc.stdint cimport int64_t, uint64_t, uintptr_t


TORCH_MAX_DEVICES = MP_TORCH_MAX_DEVICES
# The Pool objects routed to, by device (the C table holds their mp_pool pointers).
_torch_pools = {}


def _torch_registered_pools():
    """The pools PyTorch's allocations reach, in device order."""
    return [_torch_pools[d] for d in sorted(_torch_pools)]


def _torch_check_device(device):
    import operator
    try:
        d = operator.index(device)
    except TypeError:
        raise TypeError(f"device: expected an int device index, got {device!r}") from None
    if not 0 <= d < MP_TORCH_MAX_DEVICES:
        raise ValueError(f"device: {d} is outside [0, {MP_TORCH_MAX_DEVICES})")
    return d


def _torch_register(device, Pool pool not None):
    """Route torch's allocations on `device` to `pool` (the pool is kept alive while
    registered). Raises RuntimeError if another pool is registered there and torch still
    holds blocks of it."""
    cdef int d = _torch_check_device(device)
    pool._ready()
    if pool.device_id != d:
        raise ValueError(f"device {d}: the pool allocates on device {pool.device_id}; torch's "
                         f"allocations on device {d} need a pool of that device")
    cdef int rc
    pool._in_core += 1   # Note [Closing a pool]
    with nogil:
        rc = mp_torch_register(d, pool._pool)
    pool._in_core -= 1
    if rc == MP_EBUSY:
        raise RuntimeError(f"device {d}: torch still holds {mp_torch_live_blocks(d)} blocks "
                           f"of the pool registered there; free them before replacing it")
    if rc != MP_OK:
        raise RuntimeError(f"device {d}: registering the pool failed (code {rc})")
    _torch_pools[d] = pool


def _torch_unregister(device):
    """Stop routing `device`. Raises RuntimeError while torch still holds blocks there."""
    cdef int d = _torch_check_device(device)
    cdef int rc
    with nogil:
        rc = mp_torch_unregister(d)
    if rc == MP_EBUSY:
        raise RuntimeError(f"device {d}: torch still holds {mp_torch_live_blocks(d)} blocks "
                           f"of its pool; free them (and torch.cuda.empty_cache()) first")
    if rc != MP_OK:
        raise RuntimeError(f"device {d}: unregistering failed (code {rc})")
    _torch_pools.pop(d, None)


def _torch_is_registered(device, Pool pool=None):
    """Whether `device` routes anywhere (to `pool`, when given)."""
    cdef int d = _torch_check_device(device)
    cdef mp_pool *p = mp_torch_registered(d)
    if pool is None:
        return p is not NULL
    pool._ready()
    return p is not NULL and p == pool._pool


def _torch_counters(device):
    """{"live_blocks": ..., "failed_allocs": ...} for `device`."""
    cdef int d = _torch_check_device(device)
    return {"live_blocks": mp_torch_live_blocks(d), "failed_allocs": mp_torch_failed_allocs(d)}


def _torch_entry_points():
    """Addresses of the C entry points, by the name of the CUDAPluggableAllocator hook that
    takes each (for ctypes callers and benchmarks)."""
    return {
        "alloc": <uintptr_t>&mempool_torch_alloc,
        "free": <uintptr_t>&mempool_torch_free,
        "record_stream": <uintptr_t>&mempool_torch_record_stream,
        "reset": <uintptr_t>&mempool_torch_reset,
        "memory_fraction": <uintptr_t>&mempool_torch_memory_fraction,
        "base_alloc": <uintptr_t>&mempool_torch_base_alloc,
    }


# Addresses _torch_pool_address has returned: the only ones _torch_alloc_at accepts, since
# any other int would be dereferenced as a pool (a pool once in the table keeps its struct).
_torch_seen_pools = set()


def _torch_follow_size_policy(Pool pool not None):
    """Note [Private pools follow the size policy] (mp_torch.c): when `pool` is the one
    routed to its device, give that device's live private pools (CUDA graphs', MemPools')
    its size policy as it is now. True when it did; False for a pool that is not routed."""
    cdef int d = pool.device_id
    if _torch_pools.get(d) is not pool:
        return False
    cdef int rc
    with nogil:
        rc = mp_torch_follow_size_policy(d)
    if rc != MP_OK:
        raise RuntimeError(f"device {d}: the private pools refused the size policy (code {rc})")
    return True


def _torch_set_expandable(device, expandable):
    """Note [Segment kind at run time] (mp_torch_private.c): PyTorch's expandable_segments
    setting for `device` is now `expandable`; the C++ allocator sends the device's later
    allocations to a companion pool of that kind while it differs from the registered
    pool's. Returns whether it differs now."""
    cdef int d = _torch_check_device(device)
    if not isinstance(expandable, bool):
        raise TypeError(f"expandable: expected a bool, got {expandable!r}")
    cdef int rc = mp_torch_set_expandable(d, 1 if expandable else 0)
    if rc != MP_OK:
        raise RuntimeError(f"device {d}: the segment kind could not be set (code {rc})")
    return mp_torch_kind_switched(d) != 0


def _torch_kind_switched(device):
    """Whether `device`'s allocations now go to its companion pool of the other kind."""
    return mp_torch_kind_switched(_torch_check_device(device)) != 0


# For tests of Note [Private pools follow the size policy]: pools listed as private pools of
# a device (a sim pool stands for a graph's, which only the cuda upstream makes), each
# retained by the list until _torch_release_private.
_torch_tracked_privates = {}


def _torch_track_private(device, Pool pool not None):
    """List `pool` as a private pool of `device`, as the table's private_pool_create does."""
    cdef int d = _torch_check_device(device)
    pool._ready()
    if id(pool) in _torch_tracked_privates:
        raise ValueError("the pool is listed already")
    mp_pool_retain(pool._pool)
    cdef int rc = mp_torch_private_track(d, pool._pool)
    if rc != MP_OK:
        mp_pool_release(pool._pool)
        raise RuntimeError(f"device {d}: listing the private pool failed (code {rc})")
    _torch_tracked_privates[id(pool)] = pool


def _torch_release_private(Pool pool not None):
    """Take `pool` off the list, as the table's pool_release does."""
    if _torch_tracked_privates.pop(id(pool), None) is None:
        raise ValueError("the pool is not listed")
    mp_torch_private_release(pool._pool)


def _torch_pool_address(device):
    """The address of the pool routed to `device` (0 for none): what an entry point reads
    from the table. For tests of Note [Torch table lifetime]."""
    address = <uintptr_t>mp_torch_registered(_torch_check_device(device))
    if address:
        _torch_seen_pools.add(address)
    return address


def _torch_alloc_at(address, nbytes):
    """For tests: the PyTorch entry point's allocation on the pool at `address`, as an entry
    point does that read the table just before a change; ``(code, pointer)``, the code
    ``"retired"`` when the pool has left the table. The address must be one that
    ``_torch_pool_address`` returned (the struct of such a pool is never freed)."""
    cdef uintptr_t ptr = 0
    cdef int rc
    cdef uintptr_t pool_address = _as_pointer(address)
    cdef size_t n = _as_nbytes(nbytes, "nbytes")
    if pool_address == 0:
        raise ValueError("address: 0 is no pool")
    if pool_address not in _torch_seen_pools:
        raise ValueError(f"address: {pool_address:#x} is not a pool address that "
                         f"_torch_pool_address returned")
    with nogil:
        rc = mp_alloc_torch(<mp_pool *>pool_address, n, 0, &ptr)
    if rc == MP_ERETIRED:
        return "retired", 0
    return ("ok" if rc == MP_OK else f"error {rc}"), ptr


def _torch_api_address():
    """The address of the C table the C++ PyTorch allocator calls the pools through
    (mp_torch.h, Note [Torch allocator glue])."""
    return <uintptr_t>mp_torch_api_table()
