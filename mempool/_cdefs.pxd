# Every C declaration of the compiled core, in one place: the C data plane (mempool/_csrc),
# the Python C API calls the fast paths make themselves, and the GIL hooks the core calls back.
# The include files of _core.pyx hold no `cdef extern` of their own.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t


cdef extern from "Python.h":
    size_t PyLong_AsSize_t(object) except? -1
    object PyLong_FromSize_t(size_t)
    # The same function with no error check of Cython's: the fast paths of _common.pxi test
    # for the error themselves and clear it, which costs less than a try block's exception save.
    size_t _PyLong_AsSize_t_unchecked "PyLong_AsSize_t"(object)


# Note [Blocking upstream calls]: a Pool method that holds the GIL marks its thread around
# its core call; the core's blocking hooks then let the GIL go for the upstream calls that may
# block (a new segment, a release, a stream sync) and take it back after, so other Python
# threads run meanwhile, as CuPy's own cudaMalloc does. A thread that did not mark (the
# PyTorch entry points, DLPack deleters, a dealloc) is left alone: it may not hold the GIL.
# _pool.pxi installs the hooks (mp_set_blocking_hooks) and marks around its core calls.
cdef extern from *:
    """
    /* initial-exec: a plain %fs-relative access, no __tls_get_addr call on the hot path
       (4 bytes of the static TLS surplus glibc keeps for modules loaded later). */
    static __thread int mp_py_thread_marked __attribute__((tls_model("initial-exec")));
    static inline void mp_py_mark(int marked) { mp_py_thread_marked = marked; }
    static void *mp_py_blocking_begin(void) {
        if (!mp_py_thread_marked) return NULL;
        mp_py_thread_marked = 0;                 /* nested pairs leave the GIL alone */
        return (void *)PyEval_SaveThread();
    }
    static void mp_py_blocking_end(void *state) {
        if (!state) return;
        PyEval_RestoreThread((PyThreadState *)state);
        mp_py_thread_marked = 1;
    }
    """
    void mp_py_mark(int marked) nogil
    void *mp_py_blocking_begin() noexcept nogil
    void mp_py_blocking_end(void *state) noexcept nogil


cdef extern from "mp_errors.h" nogil:
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


cdef extern from "mp_upstream.h" nogil:
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
        int (*share)(void *ctx, uintptr_t base, size_t nbytes, int expandable,
                     unsigned char *buf, size_t cap, size_t *len)
        void (*destroy)(void *ctx)

    int mp_sim_upstream(mp_upstream *up, size_t capacity, size_t granularity)
    int mp_host_upstream(mp_upstream *up, size_t capacity, size_t granularity)
    int mp_host_set_shareable(mp_upstream *up, int on)


cdef extern from "mp_assert.h" nogil:
    int MP_DEBUG        # 1 in the debug build (MEMPOOL_DEBUG=1 at build time)


cdef extern from "mp_core.h" nogil:
    # The size policy (exported to Python by _policy.pxi, read by mempool._config).
    size_t MP_MIN_BLOCK
    size_t MP_SMALL_SIZE
    size_t MP_SMALL_SEGMENT
    size_t MP_LARGE_SEGMENT
    size_t MP_MIN_LARGE_ALLOC
    size_t MP_LARGE_ROUND
    size_t MP_LARGE_BUFFER
    size_t MP_MAX_ALLOC
    size_t MP_UNLIMITED
    size_t MP_DEFAULT_MAX_MAP
    enum: MP_ROUNDUP_INTERVALS
    int MP_MAX_RECORDED_STREAMS

    ctypedef struct mp_config:
        size_t roundup_divisions[MP_ROUNDUP_INTERVALS]
        size_t max_split_size
        int cross_stream_reuse
        size_t segment_round
        size_t release_threshold
        size_t limit
        size_t initial_pool_size
        double gc_threshold
        int expandable_segments
        size_t expandable_reserve
        size_t max_map_size
        size_t min_map_size
        int capture_reuse
        size_t map_ahead

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
        uint64_t num_ahead_maps
        uint64_t num_behind_unmaps

    ctypedef struct mp_pool:
        pass

    int mp_pool_create(const mp_config *cfg, const mp_upstream *up, mp_pool **out)
    void mp_pool_retain(mp_pool *p)
    void mp_pool_release(mp_pool *p)
    int MP_EFORKED
    long mp_pool_inherited(const mp_pool *p)
    ctypedef void *(*mp_blocking_begin_fn)()
    ctypedef void (*mp_blocking_end_fn)(void *state)
    void mp_set_blocking_hooks(mp_blocking_begin_fn begin, mp_blocking_end_fn end)
    int mp_alloc(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out)
    int mp_free(mp_pool *p, uintptr_t ptr, uintptr_t stream, int has_stream)
    int mp_record_stream(mp_pool *p, uintptr_t ptr, uintptr_t stream)
    int mp_forget_stream(mp_pool *p, uintptr_t stream)
    int mp_block_info(mp_pool *p, uintptr_t ptr, size_t *nbytes, size_t *requested, uintptr_t *stream)
    # Sharing across processes (_share.pxi, Note [Sharing across processes] in mp_share.c).
    size_t MP_SHARE_HANDLE_MAX
    int mp_share(mp_pool *p, uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len,
                 size_t *offset)
    int mp_share_open(mp_pool *p, const unsigned char *buf, size_t len, uintptr_t *base,
                      size_t *nbytes)
    int mp_share_close(mp_pool *p, uintptr_t base)
    int mp_empty_cache(mp_pool *p)
    int mp_trim(mp_pool *p, size_t keep)
    int mp_give_back(mp_pool *p, size_t keep)
    int mp_mapper_wait_idle(mp_pool *p)
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
    int mp_set_size_policy(mp_pool *p, const size_t *divisions, size_t max_split_size,
                           double gc_threshold)
    int mp_share_limit(mp_pool *member, mp_pool *owner)
    void mp_set_capture_reuse(mp_pool *p, int on)
    int mp_check_invariants(mp_pool *p, char *msg, size_t msglen)
    int mp_capture_begin(mp_pool *p)
    int mp_capture_end(mp_pool *p)
    int mp_capture_active(mp_pool *p, uintptr_t stream)
    int mp_capture_known(mp_pool *p)
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
        MP_OOM_WORDS_POOL
        MP_OOM_WORDS_TORCH
    ctypedef struct mp_oom_diagnosis:
        int refused_by, advice, fragmented
    void mp_oom_explain(const mp_oom *rec, const mp_config *cfg, mp_oom_diagnosis *out)
    size_t mp_oom_message(mp_pool *p, const mp_oom *rec, const char *backend, int device,
                          int words, char *buf, size_t buflen)
    size_t mp_format_bytes(size_t nbytes, int exact, char *buf, size_t buflen)

    enum:
        MP_BLOCK_FREE
        MP_BLOCK_ALLOCATED
        MP_BLOCK_PENDING
        MP_BLOCK_UNMAPPED

    ctypedef struct mp_block_view:
        uintptr_t ptr
        size_t nbytes, requested, last_requested
        uintptr_t stream
        int state

    ctypedef struct mp_segment_view:
        uintptr_t ptr
        size_t nbytes
        size_t mapped_bytes
        uintptr_t stream
        int is_small, is_expandable, is_pinned
        size_t first_map, nmaps
        size_t first_block, nblocks

    ctypedef struct mp_layout:
        mp_segment_view *segments
        size_t nsegments
        mp_block_view *blocks
        size_t nblocks
        uintptr_t *maps
        size_t nmaps

    int mp_layout_take(mp_pool *p, mp_layout *out)
    void mp_layout_free(mp_layout *l)

    # Trace actions (exported to Python by _policy.pxi as TRACE_ACTIONS).
    enum:
        MP_TRACE_ALLOC
        MP_TRACE_FREE_REQUESTED
        MP_TRACE_FREE_COMPLETED
        MP_TRACE_SEGMENT_ALLOC
        MP_TRACE_SEGMENT_FREE
        MP_TRACE_OOM
        MP_TRACE_SEGMENT_MAP
        MP_TRACE_SEGMENT_UNMAP
        MP_TRACE_EMPTY_CACHE
        MP_TRACE_TRIM

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
    void mp_sim_hold_event_creates(mp_sim *sim, unsigned n, unsigned timeout_ms)
    void mp_sim_hold_va_reserves(mp_sim *sim, unsigned n, unsigned timeout_ms)
    unsigned mp_sim_held(mp_sim *sim)
    void mp_sim_release_held(mp_sim *sim)
    uint64_t mp_sim_hold_timeouts(mp_sim *sim)
    void mp_sim_set_call_delays(mp_sim *sim, uint64_t map_ns, uint64_t unmap_ns)
    int mp_sim_destroy_stream(mp_sim *sim, uintptr_t stream)
    size_t mp_sim_num_streams(mp_sim *sim)
    void mp_sim_fail_events(mp_sim *sim, unsigned n)
    size_t mp_sim_live_segments(mp_sim *sim)
    size_t mp_sim_mapped_bytes(mp_sim *sim)
    size_t mp_sim_live_maps(mp_sim *sim)
    size_t mp_sim_open_imports(mp_sim *sim)
    uint64_t mp_sim_imports_opened(mp_sim *sim)
    uint64_t mp_sim_num_split_unmaps(mp_sim *sim)
    uint64_t mp_sim_num_syncs(mp_sim *sim)
    size_t mp_sim_held_bytes(mp_sim *sim)
    size_t mp_sim_held_peak(mp_sim *sim)
    uint64_t mp_sim_num_queries(mp_sim *sim)
    uint64_t mp_sim_num_event_records(mp_sim *sim)
    uint64_t mp_sim_num_event_creates(mp_sim *sim)
    uint64_t mp_sim_num_waits(mp_sim *sim)
    uint64_t mp_sim_num_errors(mp_sim *sim)
    size_t mp_sim_live_events(mp_sim *sim)
    int mp_sim_begin_capture(mp_sim *sim, uintptr_t stream)
    int mp_sim_end_capture(mp_sim *sim, uintptr_t stream)
    int mp_sim_is_capturing(mp_sim *sim, uintptr_t stream)
    int mp_sim_capture_join(mp_sim *sim, uintptr_t stream, uintptr_t other)
    void mp_sim_capture_counts(mp_sim *sim, uint64_t *violations, uint64_t *allocs)
    # Several devices (_peers.pxi, docs/multigpu.md).
    int MP_SIM_MAX_DEVICES
    uintptr_t MP_SIM_DEVICE_SPAN
    int mp_sim_set_device(mp_sim *sim, int device)
    int mp_sim_enable_peer(mp_sim *sim, int peer)
    uint64_t mp_sim_peer_mask(mp_sim *sim)
    uint64_t mp_sim_access_mask(mp_sim *sim, uintptr_t addr, size_t nbytes)


# The CUDA upstream (_cuda.pxi, _cudapool.pxi, _peers.pxi). The mp_upstream struct is passed
# as void *: C converts the pointer back implicitly.
cdef extern from "mp_cuda.h" nogil:
    int mp_cuda_upstream(void *up, int device, uintptr_t mempool_handle, char *err,
                         size_t errlen)
    int mp_cuda_available()
    int mp_cuda_relax_capture_mode()
    void mp_cuda_restore_capture_mode(int mode)
    int mp_cuda_last_error(const void *up)
    void mp_cuda_bind_errors(void *up)
    void mp_cuda_own_pool(void *up)
    void mp_cuda_error_string(int code, char *buf, size_t buflen)
    int mp_cuda_set_page_size(void *up, size_t page, char *err, size_t errlen)
    int mp_cuda_set_shareable(void *up, int on)
    int mp_cuda_enable_peer_access(void *up, int peer, char *err, size_t errlen)
    size_t mp_cuda_peer_devices(const void *up, int *out, size_t cap)
    int mp_cuda_access_mask(const void *up, uintptr_t addr, size_t nbytes, uint64_t *mask,
                            char *err, size_t errlen)
    int mp_cuda_set_shareable(void *up, int on)
    void mp_cuda_share_message(char *buf, size_t buflen)


# The consumers' ledger and imported blocks (_share.pxi, core/mp_share.h).
cdef extern from "mp_share.h" nogil:
    ctypedef struct mp_ledger:
        pass
    int MP_LEDGER_NAME_MAX
    int mp_ledger_create(mp_ledger **out, char *name)
    void mp_ledger_destroy(mp_ledger *l)
    int mp_ledger_take(mp_ledger *l, uint32_t *slot, uint64_t *gen)
    int mp_ledger_send(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t *ticket)
    int mp_ledger_collect(mp_ledger *l, uint32_t slot, uint64_t gen, int retire,
                          size_t *holds, int *retired)
    int mp_ledger_attach(const char *name, mp_ledger **out)
    void mp_ledger_detach(mp_ledger *l)
    int mp_ledger_foreign(const mp_ledger *l)
    int mp_ledger_join(mp_ledger *l, uint32_t slot, uint64_t gen, uint64_t ticket)
    int mp_ledger_leave(mp_ledger *l, uint32_t slot, uint64_t gen)
    enum: MP_SHARE_NAME_MAX
    int mp_share_region(const unsigned char *buf, size_t len, char *name, size_t namecap,
                        uint64_t *nbytes)
    int mp_share_sync(mp_pool *p, uintptr_t ptr)
    int mp_share_import_pool(mp_pool *parent, uintptr_t base, size_t nbytes, mp_ledger *ledger,
                             uint32_t slot, uint64_t gen, mp_pool **out)


# The DLPack bridge (_buffer.pxi, docs/sharing.md).
cdef extern from "mp_dlpack.h" nogil:
    ctypedef enum DLDeviceType:
        kDLCPU
        kDLCUDA
    ctypedef struct DLDevice:
        DLDeviceType device_type
        int32_t device_id
    ctypedef struct DLDataType:
        uint8_t code
        uint8_t bits
        uint16_t lanes
    ctypedef struct DLPackVersion:
        uint32_t major
        uint32_t minor
    ctypedef struct DLManagedTensor:
        pass
    ctypedef struct DLManagedTensorVersioned:
        pass
    uint64_t DLPACK_FLAG_BITMASK_READ_ONLY
    uint64_t DLPACK_FLAG_BITMASK_IS_COPIED
    ctypedef struct mp_dl_block:
        mp_pool *pool
        uintptr_t ptr
        size_t nbytes
    ctypedef struct mp_dl_view:
        DLDevice device
        DLDataType dtype
        int32_t ndim
        const int64_t *shape
        const int64_t *strides
        uint64_t byte_offset
        uint64_t flags
        DLPackVersion version
    int mp_dl_block_new(mp_pool *p, size_t nbytes, uintptr_t stream, mp_dl_block **out)
    void mp_dl_block_retain(mp_dl_block *b)
    void mp_dl_block_release(mp_dl_block *b)
    int64_t mp_dl_live_blocks()
    int mp_dl_export(mp_dl_block *b, const mp_dl_view *view, int versioned, void **out)
    void mp_dl_deleter(DLManagedTensor *self)
    void mp_dl_deleter_versioned(DLManagedTensorVersioned *self)
    int mp_dl_handoff(mp_pool *p, uintptr_t ptr, uintptr_t producer, uintptr_t consumer)
    void mp_dl_capsule_destructor(object capsule) noexcept
    void mp_dl_capsule_destructor_versioned(object capsule) noexcept


# The PyTorch pluggable allocator's registry and entry points (_torch.pxi).
cdef extern from "mp_torch.h" nogil:
    # The PyTorch entry points' allocation (glue/mp_torch.c; _torch.pxi's tests call it).
    int mp_alloc_torch(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out)
    int MP_TORCH_MAX_DEVICES
    int mp_torch_register(int device, mp_pool *p)
    int mp_torch_unregister(int device)
    mp_pool *mp_torch_registered(int device)
    int64_t mp_torch_live_blocks(int device)
    uint64_t mp_torch_failed_allocs(int device)
    int mp_torch_follow_size_policy(int device)
    int mp_torch_set_expandable(int device, int expandable)
    int mp_torch_kind_switched(int device)
    int mp_torch_private_track(int device, mp_pool *p)
    void mp_torch_private_release(mp_pool *p)
    void *mempool_torch_alloc(Py_ssize_t size, int device, void *stream)
    void mempool_torch_free(void *ptr, Py_ssize_t size, int device, void *stream)
    void mempool_torch_record_stream(void *ptr, void *stream)
    void mempool_torch_reset()
    void mempool_torch_memory_fraction(double fraction, int device)
    void *mempool_torch_base_alloc(void *ptr, size_t *size)
    ctypedef struct mp_torch_api:
        pass
    const mp_torch_api *mp_torch_api_table()


# Compiled benchmark loops (_bench.pxi).
cdef extern from "mp_bench.h" nogil:
    uint64_t mp_bench_core_roundtrips(mp_pool *p, size_t nbytes, size_t n, uintptr_t stream)
    uint64_t mp_bench_core_mix(mp_pool *p, const uint64_t *sizes, size_t n, uint64_t *ring,
                               size_t live, uintptr_t stream)
    uint64_t mp_bench_fn_roundtrips(uintptr_t alloc_fn, uintptr_t free_fn, size_t nbytes,
                                    size_t n, int device, uintptr_t stream)
    void *mp_bench_libc_alloc(ssize_t size, int device, void *stream)
    void mp_bench_libc_free(void *ptr, ssize_t size, int device, void *stream)
