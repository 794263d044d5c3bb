# What a pool keeps, changed on a live pool: giving memory back to the device after
# empty_cache and trim, and the size policy set_size_policy changes. The Pool's methods
# (_pool.pxi) check the pool is usable, count the call in the core (Note [Closing a pool])
# and call these with the C pool.
#
# Uses backend kinds (_common), the CUDA upstream's error text (_cuda), the limits' conversion
# (_pool_create).
from mempool import _config

# The options Pool.set_size_policy changes on a live pool.
_SIZE_POLICY = ("roundup_power2_divisions", "max_split_size", "garbage_collection_threshold")


cdef int _give_back(mp_pool *pool, int kind, int device_id, size_t keep) except -1:
    """After empty_cache or trim on cuda: the cudaMemPool gives the device what the pool
    freed, beyond `keep` bytes (Note [Giving back to the device], mp_release.c). The core
    waits for the device first, and only when a segment was freed since its last call;
    while the pool knows of a CUDA graph capture, which a sync would break, nothing is
    done (MP_EBUSY) and a later call gives it back (the core released nothing meanwhile
    either, Note [Graph capture])."""
    if kind != _CUDA:
        return 0
    cdef int rc = mp_give_back(pool, keep)
    if rc == MP_OK or rc == MP_EBUSY:
        return 0
    raise RuntimeError(
        f"giving the freed memory back to device {device_id} failed: "
        f"{_cuda_error_text(mp_cuda_last_error(mp_pool_upstream(pool)))}")


cdef dict _set_size_policy(mp_pool *pool, dict options):
    """Apply set_size_policy's `options` to `pool`; returns the options changed, for the
    Pool's `options`."""
    unknown = [k for k in options if k not in _SIZE_POLICY]
    if unknown:
        raise TypeError(f"set_size_policy: unknown option {unknown[0]!r}; it changes "
                        f"{', '.join(_SIZE_POLICY)} (the other options are fixed when "
                        f"the pool is made, except limit and release_threshold: "
                        f"set_limit, set_release_threshold)")
    # The options not given stay as the core has them (the Pool's options are the caller's
    # to read, and may have been changed since).
    cdef const mp_config *cfg = mp_pool_config(pool)
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
    rc = mp_set_size_policy(pool, divisions, max_split, gc)
    if rc != MP_OK:   # the checks above are the core's; a refusal here is a bug
        raise RuntimeError(f"set_size_policy: the pool refused the policy (code {rc})")
    return dict(
        roundup_power2_divisions=[divisions[i] for i in range(MP_ROUNDUP_INTERVALS)],
        max_split_size=None if max_split == MP_UNLIMITED else max_split,
        garbage_collection_threshold=gc)
