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

/* Note [Torch allocator glue] (docs/architecture.md): `mempool.torch.install` builds a C++
 * class against the installed PyTorch's headers, implementing every method of PyTorch's
 * CUDAAllocator (statistics, OOM, cacheInfo, snapshots, history, graph pools). It reaches
 * the core only through this table, handed over as an address: the extension is loaded with
 * RTLD_LOCAL, so its symbols are not visible to another shared object, and a versioned
 * table keeps the two builds honest with each other. Every function is safe without the
 * GIL and from any thread; per-device ones route through the device table above
 * (MP_EINVAL for a device with no pool). */
#define MP_TORCH_API_VERSION 1
#define MP_TORCH_FIGURES 7

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
    /* Figures for reports, in this order: reserved, used, cached, largest free block,
     * limit, capacity, max_split_size (MP_UNLIMITED for none). */
    int (*memory_figures)(int device, size_t figures[MP_TORCH_FIGURES]);
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
} mp_torch_api;

/* The table (static storage, never freed). */
const mp_torch_api *mp_torch_api_table(void);


#endif
