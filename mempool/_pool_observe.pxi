# What a pool shows of itself: the registry of live pools, its counters (stats), its
# invariants, the layout of its segments and blocks, and its recorded history. Each reader
# takes the C pool and returns Python values; the Pool's methods (_pool.pxi) are one-line
# delegates that check the pool is usable first. The reports built on these (summary,
# snapshot, trace files) are mempool/tools'.
#
# Uses the trace action names (_policy), the cudaMemPool's stats (_cudapool).
from libc.stdint cimport int64_t
from libc.stdlib cimport free as c_free

import itertools as _itertools
import weakref as _weakref

from mempool._errors import InvariantError

_STAT_FAMILIES = ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                  "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes")
_STAT_POOLS = ("all", "small_pool", "large_pool")


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


cdef dict _pool_stats(mp_pool *pool, int kind, object cuda_handle):
    """Pool.stats() of `pool` (a cuda pool adds its cudaMemPool's, from `cuda_handle`)."""
    cdef mp_stats st
    mp_get_stats(pool, &st)
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
    out["num_ahead_maps"] = st.num_ahead_maps
    out["num_behind_unmaps"] = st.num_behind_unmaps
    # The core's own: a policy set from C (a private pool following its device's, Note
    # [Private pools follow the size policy]) reaches it and not the Pool's options.
    cdef size_t mss = mp_pool_config(pool).max_split_size
    out["max_split_size"] = -1 if mss == MP_UNLIMITED else <int64_t>mss
    if kind == _CUDA:
        out.update(_cuda_stats(cuda_handle))
    return out


cdef _put_stat(dict out, str prefix, mp_stat s):
    out[prefix + ".current"] = s.current
    out[prefix + ".peak"] = s.peak
    out[prefix + ".allocated"] = s.allocated
    out[prefix + ".freed"] = s.freed


cdef int _mapper_wait_idle(mp_pool *pool) except -1:
    """Pool._mapper_wait_idle: the mapper's work done (Note [Mapper]), without the GIL."""
    cdef int rc
    with nogil:
        rc = mp_mapper_wait_idle(pool)
    if rc == MP_EFORKED:
        raise _forked_error(pool)
    return 0


cdef int _check_invariants(mp_pool *pool) except -1:
    """Raise InvariantError naming the first breach of `pool`'s invariants."""
    cdef char msg[512]
    if mp_check_invariants(pool, msg, sizeof(msg)) != MP_OK:
        raise InvariantError(msg.decode())
    return 0


cdef list _pool_layout(mp_pool *pool):
    """Pool.layout() of `pool`: its segments and their blocks, copied under the pool lock."""
    cdef mp_layout lay
    if mp_layout_take(pool, &lay) != MP_OK:
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


cdef int _record_history(mp_pool *pool, object enabled, object max_entries) except -1:
    """Pool.record_history(enabled, max_entries) on `pool`."""
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
    if mp_trace_enable(pool, n) != MP_OK:
        raise MemoryError(f"record_history: no host memory for {max_entries} entries")
    return 0


cdef list _pool_history(mp_pool *pool):
    """Pool.history() of `pool`: the recorded events, oldest first."""
    cdef mp_trace_entry *entries = NULL
    cdef size_t n = 0, i
    if mp_trace_take(pool, &entries, &n) != MP_OK:
        raise MemoryError("history: out of host memory")
    try:
        return [(TRACE_ACTIONS[entries[i].action], entries[i].ptr, entries[i].nbytes,
                 entries[i].stream, entries[i].time_ns) for i in range(n)]
    finally:
        c_free(entries)
