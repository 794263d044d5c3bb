# Declarations of the C data plane (mempool/_csrc) for the Cython layer.
from libc.stdint cimport int64_t, uint64_t, uintptr_t


cdef extern from "mp_upstream.h" nogil:
    enum:
        MP_OK
        MP_ENOMEM
        MP_ELIMIT
        MP_EINVAL
        MP_ENOTFOUND
        MP_EINTERIOR
        MP_EDOUBLEFREE
        MP_ENOTREADY
        MP_EUPSTREAM
        MP_EUNSUPPORTED
        MP_EBUSY
        MP_ERETIRED

    ctypedef struct mp_upstream:
        void *ctx
        const char *name
        int last_error
        int (*segment_alloc)(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out)
        int (*segment_free)(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream)
        int (*event_create)(void *ctx, uintptr_t *out)
        int (*event_record)(void *ctx, uintptr_t event, uintptr_t stream)
        int (*event_query)(void *ctx, uintptr_t event)
        int (*stream_wait_event)(void *ctx, uintptr_t stream, uintptr_t event)
        int (*event_destroy)(void *ctx, uintptr_t event)
        int (*stream_synchronize)(void *ctx, uintptr_t stream)
        int (*mem_info)(void *ctx, size_t *free_bytes, size_t *total_bytes)
        size_t granularity
        int (*map)(void *ctx, uintptr_t ptr, size_t nbytes)
        void (*destroy)(void *ctx)

    int mp_sim_upstream(mp_upstream *up, size_t capacity, size_t granularity)
    int mp_host_upstream(mp_upstream *up, size_t capacity, size_t granularity)


cdef extern from "mp_assert.h" nogil:
    int MP_DEBUG        # 1 in the debug build (MEMPOOL_DEBUG=1 at build time)


cdef extern from "mp_core.h" nogil:
    size_t MP_MIN_BLOCK
    size_t MP_SMALL_SIZE
    size_t MP_MAX_ALLOC
    size_t MP_UNLIMITED
    int MP_ROUNDUP_INTERVALS
    int MP_MAX_RECORDED_STREAMS

    ctypedef struct mp_config:
        size_t roundup_divisions[16]
        size_t max_split_size
        int cross_stream_reuse
        size_t release_threshold
        size_t limit
        size_t initial_pool_size
        double gc_threshold
        int expandable_segments
        size_t expandable_reserve

    void mp_config_default(mp_config *cfg)

    ctypedef struct mp_stat:
        int64_t current, peak, allocated, freed

    ctypedef struct mp_stats:
        mp_stat allocation[3]
        mp_stat segment[3]
        mp_stat active[3]
        mp_stat inactive_split[3]
        mp_stat allocated_bytes[3]
        mp_stat reserved_bytes[3]
        mp_stat active_bytes[3]
        mp_stat inactive_split_bytes[3]
        mp_stat requested_bytes[3]
        mp_stat oversize_allocations
        mp_stat oversize_segments
        mp_stat mapped_bytes
        mp_stat va_reserved_bytes
        uint64_t num_alloc_retries
        uint64_t num_ooms
        uint64_t num_sync_all_streams
        uint64_t num_device_alloc
        uint64_t num_device_free
        uint64_t num_cross_stream_reuse
        uint64_t num_event_waits
        uint64_t num_streams
        uint64_t num_stream_syncs
        uint64_t num_event_records
        uint64_t num_stream_queries

    ctypedef struct mp_pool:
        pass

    int mp_pool_create(const mp_config *cfg, const mp_upstream *up, mp_pool **out)
    void mp_pool_retain(mp_pool *p)
    void mp_pool_release(mp_pool *p)
    ctypedef void *(*mp_blocking_begin_fn)()
    ctypedef void (*mp_blocking_end_fn)(void *state)
    void mp_set_blocking_hooks(mp_blocking_begin_fn begin, mp_blocking_end_fn end)
    int mp_alloc(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out)
    int mp_free(mp_pool *p, uintptr_t ptr, uintptr_t stream, int has_stream)
    int mp_record_stream(mp_pool *p, uintptr_t ptr, uintptr_t stream)
    int mp_forget_stream(mp_pool *p, uintptr_t stream)
    int mp_block_info(mp_pool *p, uintptr_t ptr, size_t *nbytes, size_t *requested, uintptr_t *stream)
    int mp_empty_cache(mp_pool *p)
    int mp_trim(mp_pool *p, size_t keep)
    size_t mp_round_size(const mp_config *cfg, size_t nbytes)
    size_t mp_segment_size(size_t rounded)
    unsigned int mp_size_class(size_t nbytes)
    void mp_get_stats(mp_pool *p, mp_stats *out)
    void mp_reset_peak_stats(mp_pool *p)
    void mp_reset_accumulated_stats(mp_pool *p)
    size_t mp_used_bytes(mp_pool *p)
    size_t mp_cached_bytes(mp_pool *p)
    size_t mp_reserved_bytes(mp_pool *p)
    size_t mp_largest_free_block(mp_pool *p)
    size_t mp_capacity(mp_pool *p)
    const mp_config *mp_pool_config(mp_pool *p)
    mp_upstream *mp_pool_upstream(mp_pool *p)
    int mp_set_limit(mp_pool *p, size_t limit)
    int mp_set_release_threshold(mp_pool *p, size_t threshold)
    int mp_check_invariants(mp_pool *p, char *msg, size_t msglen)
    int mp_capture_begin(mp_pool *p)
    int mp_capture_end(mp_pool *p)
    int mp_capture_active(mp_pool *p, uintptr_t stream)
    ctypedef struct mp_oom:
        const mp_pool *pool
        int code
        size_t nbytes, rounded
        uintptr_t stream
        size_t reserved_bytes, used_bytes, pending_bytes, cached_bytes, largest_free_block
        size_t limit, capacity
        int capturing
        uint64_t num_ooms
    int mp_oom_take(mp_oom *out)
    void mp_oom_snapshot(mp_pool *p, int code, size_t nbytes, uintptr_t stream, mp_oom *out)

    enum:
        MP_BLOCK_FREE
        MP_BLOCK_ALLOCATED
        MP_BLOCK_PENDING
        MP_BLOCK_UNMAPPED

    ctypedef struct mp_block_view:
        uintptr_t ptr
        size_t nbytes, requested
        uintptr_t stream
        int state

    ctypedef struct mp_segment_view:
        uintptr_t ptr
        size_t nbytes
        size_t mapped_bytes
        uintptr_t stream
        int is_small, is_expandable, is_pinned
        size_t first_block, nblocks

    ctypedef struct mp_layout:
        mp_segment_view *segments
        size_t nsegments
        mp_block_view *blocks
        size_t nblocks

    int mp_layout_take(mp_pool *p, mp_layout *out)
    void mp_layout_free(mp_layout *l)

    ctypedef struct mp_trace_entry:
        int action
        uintptr_t ptr
        size_t nbytes
        uintptr_t stream
        uint64_t time_ns

    int mp_trace_enable(mp_pool *p, size_t max_entries)
    int mp_trace_take(mp_pool *p, mp_trace_entry **entries, size_t *n)


cdef extern from "mp_budget.h" nogil:
    ctypedef struct mp_budget:
        size_t capacity
        size_t used
        size_t peak
        uint64_t fail_next
        int64_t fail_map_after
        uint64_t num_allocs, num_frees, num_maps, num_unmaps, num_failed

    mp_budget *mp_host_budget(void *ctx)
    void mp_host_lock(void *ctx)
    void mp_host_unlock(void *ctx)


cdef extern from "mp_sim.h" nogil:
    ctypedef struct mp_sim:
        pass

    uint64_t mp_sim_launch(mp_sim *sim, uintptr_t stream)
    void mp_sim_complete(mp_sim *sim, uintptr_t stream)
    void mp_sim_complete_all(mp_sim *sim)
    int mp_sim_ordered(mp_sim *sim, uintptr_t stream, uintptr_t other, uint64_t seq)
    void mp_sim_stream_info(mp_sim *sim, uintptr_t stream, uint64_t *submitted, uint64_t *completed)
    mp_budget *mp_sim_budget(mp_sim *sim)
    void mp_sim_lock(mp_sim *sim)
    void mp_sim_unlock(mp_sim *sim)
    void mp_sim_hold_allocs(mp_sim *sim, unsigned n, unsigned timeout_ms)
    void mp_sim_hold_syncs(mp_sim *sim, unsigned n, unsigned timeout_ms)
    unsigned mp_sim_held(mp_sim *sim)
    void mp_sim_release_held(mp_sim *sim)
    uint64_t mp_sim_hold_timeouts(mp_sim *sim)
    int mp_sim_destroy_stream(mp_sim *sim, uintptr_t stream)
    size_t mp_sim_num_streams(mp_sim *sim)
    void mp_sim_fail_events(mp_sim *sim, unsigned n)
    size_t mp_sim_live_segments(mp_sim *sim)
    size_t mp_sim_mapped_bytes(mp_sim *sim)
    uint64_t mp_sim_num_syncs(mp_sim *sim)
    uint64_t mp_sim_num_queries(mp_sim *sim)
    uint64_t mp_sim_num_event_records(mp_sim *sim)
    uint64_t mp_sim_num_waits(mp_sim *sim)
    uint64_t mp_sim_num_errors(mp_sim *sim)
    size_t mp_sim_live_events(mp_sim *sim)
    int mp_sim_begin_capture(mp_sim *sim, uintptr_t stream)
    int mp_sim_end_capture(mp_sim *sim, uintptr_t stream)
    int mp_sim_is_capturing(mp_sim *sim, uintptr_t stream)
    void mp_sim_capture_counts(mp_sim *sim, uint64_t *violations, uint64_t *allocs)
