/* PyTorch's pluggable allocator over mempool pools: C-ABI entry points and the device table.
 *
 * torch.cuda.memory.CUDAPluggableAllocator loads the mempool extension (it is a shared
 * object like any other) and calls the mempool_torch_* functions below through plain C
 * function pointers, from any thread and without the GIL: the autograd engine allocates on
 * its own threads. Each call routes its device argument through a fixed table of pools
 * (mp_torch_register), so one allocator serves every GPU of the process.
 *
 * Signatures are those of torch/csrc/cuda/CUDAPluggableAllocator.h (torch 2.x): size_t and
 * ssize_t are the same width, cudaStream_t is a pointer.
 */
#ifndef MP_TORCH_H
#define MP_TORCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "mp_core.h"

#define MP_TORCH_MAX_DEVICES 64
#define MP_TORCH_API __attribute__((visibility("default")))

/* ---- the table (called from the Pool layer, with the GIL) ------------------------------- */

/* Route `device` to `p` (retained while registered). Re-registering the same pool is a
 * no-op. MP_EINVAL: device outside [0, MP_TORCH_MAX_DEVICES). MP_EBUSY: another pool is
 * registered there and torch still holds blocks of it (or is allocating from it). A pool
 * that was ever registered keeps its struct when destroyed (mp_torch.c). */
int mp_torch_register(int device, mp_pool *p);
/* Stop routing `device` (its pool's reference is dropped). MP_OK when nothing was
 * registered. MP_EBUSY while torch still holds blocks of the pool. */
int mp_torch_unregister(int device);
/* The pool routed to `device`, or NULL; borrowed (for checks, not for use). */
mp_pool *mp_torch_registered(int device);
/* Blocks handed to torch on `device` and not yet freed (with allocations in flight), and
 * allocations refused there. */
int64_t mp_torch_live_blocks(int device);
uint64_t mp_torch_failed_allocs(int device);
/* The configuration of a private pool (a CUDA graph's, a MemPool's) made on a device whose
 * pool has `device_cfg`: its size policy, plain segments, and nothing given back on its own
 * (Note [Keep idle], mp_core.c). */
void mp_torch_private_config(const mp_config *device_cfg, mp_config *out);
/* Note [Private pools follow the size policy] (mp_torch.c): give every live private pool of
 * `device` the size policy its device pool has now (after Pool.set_size_policy on it).
 * MP_EINVAL when no pool is registered there. mp_torch_private_track adds a pool to the
 * list as the table's private_pool_create does (tests give it a sim pool); the table's
 * pool_release takes it out. */
int mp_torch_follow_size_policy(int device);
/* Note [Segment kind at run time] (mp_torch_private.c): PyTorch's expandable_segments
 * setting for `device` is now `expandable` (0 or 1): the table's kind_switched says whether
 * it differs from the registered pool's kind, now and after a later registration. MP_EINVAL
 * for a device outside the table. */
int mp_torch_set_expandable(int device, int expandable);
int mp_torch_kind_switched(int device);
int mp_torch_private_track(int device, mp_pool *p);
void mp_torch_private_release(mp_pool *p);

/* For tests of Note [Torch table lifetime]: the entry points' allocation on `p` as one that
 * read p's newest registration from the table just before a change: counted there, or
 * MP_ERETIRED once that registration has ended (or p was never registered). p must be a
 * pool that was registered (its struct is kept). */
int mp_alloc_torch(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out);

/* ---- the entry points (called by torch, without the GIL) -------------------------------- */

/* torch's alloc_fn. NULL for size 0, an unregistered device, or when the pool is out of
 * memory (for the last two one line on stderr says why: torch's pluggable allocator has no
 * other channel for the reason). An unregistered device never falls back to another
 * device's pool. */
MP_TORCH_API void *mempool_torch_alloc(ssize_t size, int device, void *stream);
/* torch's free_fn. Frees in stream order on the block's own stream; streams declared with
 * record_stream are waited for before reuse. Precondition (torch's own): ptr is NULL or a
 * block alloc returned and not yet freed; a NULL or unknown pointer is ignored, but only a
 * block torch holds pins the pool against a concurrent register/unregister (mp_torch.c). */
MP_TORCH_API void mempool_torch_free(void *ptr, ssize_t size, int device, void *stream);
/* set_record_stream_fn: Tensor.record_stream(s). torch passes no device, so the pointer is
 * looked up in each registered pool. */
MP_TORCH_API void mempool_torch_record_stream(void *ptr, void *stream);
/* set_reset_fn: torch.cuda.empty_cache() releases every registered pool's cached memory. */
MP_TORCH_API void mempool_torch_reset(void);
/* set_memory_fraction_fn: torch.cuda.set_per_process_memory_fraction(f, device) caps the
 * device's pool at f x its capacity. */
MP_TORCH_API void mempool_torch_memory_fraction(double fraction, int device);
/* set_base_alloc_fn: the allocation a pointer belongs to. Each block is its own base: ptr
 * itself, with *size set to the block's size (unchanged for an unknown pointer). */
MP_TORCH_API void *mempool_torch_base_alloc(void *ptr, size_t *size);

/* ---- the table of the C++ allocator (glue/torch_allocator.cpp) --------------------------- */

/* Note [Torch allocator glue]
 * `mempool.torch.install` makes the pool PyTorch's allocator through a C++ class
 * (glue/torch_allocator.cpp) that implements every method of the installed PyTorch's
 * CUDAAllocator. PyTorch's CUDAPluggableAllocator forwards only malloc and free and throws
 * on getDeviceStats, cacheInfo, recordHistory and the graph-pool methods, so scripts that
 * log max_memory_allocated, turn on cudnn.benchmark, capture CUDA graphs or record memory
 * history stop there.
 *
 *   - Built per PyTorch, cached. The class must match the headers of the PyTorch that loads
 *     it, so mempool/torch_build.py compiles it on first use with the system's C++
 *     compiler, against that PyTorch's headers and the CUDA runtime headers, links only
 *     libc10 and libc10_cuda, and caches the library under a key of the source, the headers
 *     and the compiler. PyTorch stays optional: without it nothing is built. Without a
 *     compiler, install falls back on the pluggable allocator with a warning naming what it
 *     lacks.
 *   - One C table between the two (mp_torch_api below): the extension is loaded with
 *     RTLD_LOCAL, so the glue cannot link against its symbols; the table is handed over as
 *     an address, carries its version and size, and routes every per-device call through
 *     the device table (Note [Torch table lifetime]). The core knows nothing of PyTorch;
 *     the table is tested on sim through ctypes (tests/integrations/test_torch_api_table.py). Every
 *     function is safe without the GIL and from any thread; per-device ones return
 *     MP_EINVAL for a device with no pool.
 *   - Data path. allocate reads PyTorch's current device and stream and calls the table's
 *     alloc; the DataPtr's context is the address with the device in its low bits (blocks
 *     are 512-byte aligned), so the deleter frees without a lookup. Size 0 gives a null
 *     DataPtr, as PyTorch's own allocator does.
 *   - Statistics are the core's counters, which have PyTorch's meanings (Note [Derived
 *     totals]), of the device's pool and its private pools together, each peak the
 *     device's own (Note [Device peaks] in mp_torch.c).
 *   - Out of memory throws c10::OutOfMemoryError (Python's torch.OutOfMemoryError) with the
 *     pool's figures, after the OOM observers and an oom trace entry; the pool is
 *     unchanged.
 *   - Private pools (a CUDA graph's, a MemPool's): core pools of their own whose segments
 *     are plain cuMemAlloc allocations (mp_cuda_plain_upstream), because a stream-ordered
 *     allocation on a capturing stream would become a node of the graph. While a capture or
 *     a use_mem_pool is routed (beginAllocateToPool with PyTorch's filter), matching
 *     allocations go there; their blocks are kept in a map so that frees find them. The
 *     device's own pool is told of the capture too (mp_capture_begin/end, Note [Graph
 *     capture]), so that allocations on other streams make no call a global-mode capture
 *     refuses. A pool is destroyed once PyTorch releases it (releasePool, use count 0) and
 *     it holds no live block; no cache is released while a capture is under way, and
 *     empty_cache() empties only the private pools whose use count is 0, as PyTorch's own:
 *     the free blocks of a live graph's pool are the memory its replays write.
 *     getCheckpointState/setCheckpointPoolState (cudagraph trees) record a pool's allocated
 *     blocks and restore them (Note [Allocation at an address]).
 *   - History (_record_memory_history, _snapshot) is recorded in the glue, in PyTorch's own
 *     structures, and a snapshot is built from mp_layout_take, an expandable segment
 *     reported as one segment per run of mapped pages because PyTorch's viewer lays blocks
 *     end to end from a segment's address. The trace's segment entries come from the
 *     core's segment observer (Note [Segment observer], mp_core.h), set at install.
 *   - torch.cuda.caching_allocator_enable(False) hands out the driver's own memory, outside
 *     the pool (Note [Caching off], torch_allocator.cpp).
 *   - MemPool(no_split=True) hands out whole blocks (Note [No split], mp_core.c).
 *   - Other processes (torch.multiprocessing, reduce_tensor): shareIpcHandle gives the
 *     core's handle of the block's memory (share, Note [Sharing across processes] in
 *     core/mp_share.c) as "M", a version byte and the handle's bytes, with the block's
 *     offset in that memory; getIpcDevPtr opens such a handle on the current device's pool
 *     (share_open, closed by the pointer's deleter through share_close) and opens the
 *     cudaIpcMemHandle of PyTorch's own allocator as before. PyTorch's CudaIPCSentData
 *     protocol counts the consumers and keeps the producer's block until they let go (its
 *     "cuda_ipc_collect" runs before an OOM is raised, Note [Free memory callbacks]); both
 *     processes run the pool, the producer's made to share (ipc=True).
 *   - Refused with a message naming the feature: sharing a block of a private pool (a CUDA
 *     graph's, a MemPool's) or of the driver's own memory (caching off), which the device's
 *     pool did not hand out, and opening PyTorch's expandable segments' handles. */
#define MP_TORCH_API_VERSION 12  /* 2: mp_layout lists each segment's physical allocations;
                                    3: the device's peaks with its private pools;
                                    4: the segment observer;
                                    5: the device pool's options;
                                    6: a block's last requested size in mp_layout;
                                    7: private pools over a custom segment source;
                                    8: pool_set_no_split, block_info;
                                    9: the release observer;
                                    10: mp_torch_figures, oom_message;
                                    11: share, share_open, share_close;
                                    12: the segment kind at run time */

/* A device pool's figures for PyTorch's reports (cacheInfo, the memory fraction, the
 * profiler, max_split_size in the statistics). */
typedef struct mp_torch_figures {
    size_t reserved;
    size_t used;
    size_t cached;
    size_t largest_free_block;
    size_t limit;             /* MP_UNLIMITED: none */
    size_t capacity;          /* the device's total memory as the upstream reports it */
    size_t max_split_size;    /* MP_UNLIMITED: none (PyTorch reads -1) */
} mp_torch_figures;

/* Note [Custom segment sources] (mp_torch.c): where a private pool for a MemPool given its own
 * allocator gets its segments. alloc: MP_OK with a non-zero, 512-byte aligned *out, or
 * MP_ENOMEM; it is called without the pool's lock and must not throw. free: gives back a
 * segment alloc made (nbytes and stream as asked). release: once the pool is gone; no call
 * follows. */
typedef struct mp_segment_source {
    void *ctx;
    int (*alloc)(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out);
    void (*free)(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream);
    void (*release)(void *ctx);
} mp_segment_source;

typedef struct mp_torch_api {
    int version;            /* MP_TORCH_API_VERSION */
    int max_devices;        /* MP_TORCH_MAX_DEVICES */
    size_t struct_size;     /* sizeof(mp_torch_api) */
    /* Data path of the device table: the code, not a NULL and a line on stderr. */
    int (*alloc)(int device, size_t nbytes, uintptr_t stream, uintptr_t *out);
    void (*free)(int device, uintptr_t ptr);
    /* The device whose pool holds the live block at ptr, or -1. */
    int (*find_device)(uintptr_t ptr);
    int (*record_stream)(int device, uintptr_t ptr, uintptr_t stream);
    int (*base_allocation)(int device, uintptr_t ptr, uintptr_t *base, size_t *nbytes);
    /* Per device. */
    int (*stats)(int device, mp_stats *out);
    int (*reset_peak_stats)(int device);
    int (*reset_accumulated_stats)(int device);
    int (*empty_cache)(int device);
    int (*memory_figures)(int device, mp_torch_figures *out);
    int (*set_limit)(int device, size_t limit);
    int (*mem_info)(int device, size_t *free_bytes, size_t *total_bytes);
    int (*layout)(int device, mp_layout *out);
    int (*enable_peer_access)(int owner_device, int peer_device);
    /* Note [Graph capture]: tell the device's pool that a capture is (no longer) under way,
     * so that it makes no call a global-mode capture refuses, whatever stream it serves. */
    int (*capture_begin)(int device);
    int (*capture_end)(int device);
    /* Separate pools (CUDA-graph and MemPool private pools) on a device: plain segments
     * that are legal to allocate during stream capture, the device pool's size policy,
     * nothing released until empty_cache. The caller owns the reference. */
    int (*private_pool_create)(int device, mp_pool **out);
    int (*pool_alloc)(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out);
    int (*pool_free)(mp_pool *p, uintptr_t ptr, uintptr_t stream, int has_stream);
    int (*pool_alloc_at)(mp_pool *p, uintptr_t ptr, size_t nbytes, uintptr_t stream);
    int (*pool_record_stream)(mp_pool *p, uintptr_t ptr, uintptr_t stream);
    int (*pool_block_info)(mp_pool *p, uintptr_t ptr, size_t *nbytes, size_t *requested,
                           uintptr_t *stream);
    void (*pool_stats)(mp_pool *p, mp_stats *out);
    void (*pool_reset_peak_stats)(mp_pool *p);
    void (*pool_reset_accumulated_stats)(mp_pool *p);
    int (*pool_empty_cache)(mp_pool *p);
    size_t (*pool_used_bytes)(mp_pool *p);
    size_t (*pool_reserved_bytes)(mp_pool *p);
    size_t (*pool_largest_free_block)(mp_pool *p);
    int (*pool_layout)(mp_pool *p, mp_layout *out);
    void (*layout_free)(mp_layout *l);
    void (*pool_release)(mp_pool *p);
    /* Note [Device peaks] (mp_torch.c): the device's statistics, its pool's and its private
     * pools' (`privates`, n of them) together, with each peak the device's own. The glue
     * calls private_event after every allocation and free of a private pool, and whenever
     * the set of private pools changes. */
    int (*private_event)(int device, mp_pool *const *privates, size_t n);
    int (*device_stats)(int device, mp_pool *const *privates, size_t n, mp_stats *out);
    int (*device_reset_peak_stats)(int device, mp_pool *const *privates, size_t n);
    /* Note [Segment observer] (mp_core.h): the function told of every pool's segment
     * events, and the device whose table routes to a pool (-1: none does). */
    void (*set_segment_observer)(mp_segment_observer fn, void *ctx);
    int (*pool_device)(const mp_pool *p);
    /* The device pool's options, for the snapshot's allocator_settings (its garbage
     * collection threshold and rounding divisions in PyTorch's keys). */
    int (*config)(int device, mp_config *out);
    /* Note [Custom segment sources]: a private pool as private_pool_create makes, whose
     * segments come from `src` (copied; on MP_OK the pool owns src->ctx and releases it,
     * else the caller keeps it). */
    int (*custom_pool_create)(int device, const mp_segment_source *src, mp_pool **out);
    /* Note [No split] (mp_core.c): a private pool hands out its free blocks whole from now
     * on (MemPool(no_split=True)). MP_EINVAL for an expandable pool. */
    int (*pool_set_no_split)(mp_pool *p);
    /* The live block at ptr in the device's pool: its size, the size asked for and its
     * stream (for a free's trace entry, which PyTorch gives the requested size).
     * MP_ENOTFOUND when ptr is no live block there. */
    int (*block_info)(int device, uintptr_t ptr, size_t *nbytes, size_t *requested,
                      uintptr_t *stream);
    /* Note [Release observer] (mp_core.h): the function told, with no lock held, just before
     * a pool gives back segments whose events the segment observer was told. */
    void (*set_release_observer)(mp_release_observer fn, void *ctx);
    /* Note [One OOM explainer] (core/mp_oom.c): a refusal of `code` for nbytes on stream,
     * by the device's pool (p NULL) or by private pool p, explained as the Pool's
     * OutOfMemoryError explains it, with PyTorch's names for the options. *rec gets the
     * record: the calling thread's last refusal when it is this one, else the pool as it
     * stands. MP_EINVAL when no pool is registered for the device (p NULL). */
    int (*oom_message)(int device, mp_pool *p, int code, size_t nbytes, uintptr_t stream,
                       mp_oom *rec, char *msg, size_t msglen);
    /* Other processes (Note [Sharing across processes], core/mp_share.c), on the device's
     * pool: mp_share of the live block at ptr, mp_share_open of a handle another process's
     * share made (into memory of this process), and mp_share_close of one such open, with
     * their codes; MP_EINVAL when no pool is registered for the device. */
    int (*share)(int device, uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len,
                 size_t *offset);
    int (*share_open)(int device, const unsigned char *buf, size_t len, uintptr_t *base,
                      size_t *nbytes);
    int (*share_close)(int device, uintptr_t base);
    /* Note [Segment kind at run time] (mp_torch_private.c): per device, non-zero while
     * PyTorch's expandable_segments setting asks for the other kind of segment than the
     * device's pool makes (read with a relaxed atomic load at each allocation); the device's
     * companion pool of that kind (the caller owns the reference); a pool's mp_share and its
     * capture begin and end, for the companion's blocks and captures. */
    const int *kind_switched;
    int (*companion_pool_create)(int device, mp_pool **out);
    int (*pool_share)(mp_pool *p, uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len,
                      size_t *offset);
    int (*pool_capture_begin)(mp_pool *p);
    int (*pool_capture_end)(mp_pool *p);
} mp_torch_api;

/* The table (static storage, never freed). */
const mp_torch_api *mp_torch_api_table(void);


#endif
