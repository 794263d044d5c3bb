/* What the files of the CUDA upstream share (mp_cuda.c, mp_cuda_capture.c, mp_cuda_vmm.c,
 * mp_cuda_peers.c, mp_cuda_driver.c), and nothing else includes: the upstream's context, the
 * helpers every driver call goes through, and the functions one file gives another.
 */
#ifndef MP_CUDA_INTERNAL_H
#define MP_CUDA_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "mp_cuda.h"
#include "mp_cuda_driver.h"

/* ---- The upstream context. ---- */

/* mapped[i]: page i of a reservation (Note [Expandable pages]) */
enum { PAGE_UNMAPPED = 0, PAGE_HEAD = 1, PAGE_REST = 2 };

typedef struct {
    CUdeviceptr va;
    size_t nbytes, npages, nmapped;
    CUmemGenericAllocationHandle *handles; /* per page; valid where mapped[i] == PAGE_HEAD */
    unsigned char *mapped;                 /* PAGE_* */
    /* Note [Sharing CUDA memory] (mp_cuda_share.c), per page, valid at a PAGE_HEAD: */
    int *fds;           /* the allocation's exported file descriptor + 1; 0 = none yet */
    uint64_t *serials;  /* the allocation's number, unique in the upstream */
    unsigned char *shareable;   /* 1: created with the POSIX file-descriptor handle type */
} mp_cuda_range;

/* The device itself and its peers: bounded by the 64-bit masks of mp_cuda_access_mask. */
#define MP_CUDA_MAX_ACCESS 64

typedef struct {
    CUdevice dev;
    int ordinal;
    int ndevices;                /* devices visible at creation; immutable */
    CUcontext ctx;               /* the retained primary context; immutable */
    CUmemoryPool pool;           /* NULL = the device's current pool; immutable */
    int owns_pool;               /* atomic; destroy destroys `pool` (mp_cuda_own_pool) */
    int last_error;              /* atomic */
    int *error_slot;             /* atomic; NULL until mp_cuda_bind_errors */
    size_t granularity;          /* the page: 0 without virtual memory management; set before
                                    any reservation (mp_cuda_set_page_size), then immutable */
    size_t driver_granularity;   /* the driver's minimum; pages are multiples of it */
    CUmemAllocationProp prop;    /* physical pages: pinned device memory on dev; immutable */
    pthread_mutex_t vmm_lock;    /* guards access, naccess, ranges, nranges, cap and every
                                    range's tables */
    /* Read/write for dev ([0]), then for each peer in the order enabled: what every mapped
     * range is granted (Note [Peer access]). */
    CUmemAccessDesc access[MP_CUDA_MAX_ACCESS];
    size_t naccess;
    mp_cuda_range *ranges;
    size_t nranges, cap;
    /* Note [Sharing CUDA memory] (mp_cuda_share.c). */
    int shareable;               /* mp_cuda_set_shareable; set before any segment */
    int page_handle_types;       /* what cuMemCreate asks for; under vmm_lock */
    int page_share_refused;      /* the CUresult of cuMemCreate's refusal of it; under vmm_lock */
    uint64_t page_serial;        /* the last physical allocation's serial; under vmm_lock */
    uint64_t token;              /* random: names this upstream in handles; immutable */
    pthread_mutex_t share_lock;  /* guards pool_fd */
    int pool_fd;                 /* the cudaMemPool exported, or -1 */
    pthread_mutex_t plain_lock;  /* guards plain, cap_plain and the writes of nplain (atomic) */
    CUdeviceptr *plain;          /* Note [Capture segments]: segments from cuMemAlloc */
    size_t nplain, cap_plain;
} mp_cuda;

static inline int cu_fail(mp_cuda *c, CUresult r) {
    __atomic_store_n(&c->last_error, r, __ATOMIC_RELAXED);
    int *slot = __atomic_load_n(&c->error_slot, __ATOMIC_ACQUIRE);
    if (slot) __atomic_store_n(slot, r, __ATOMIC_RELAXED);
    return MP_EUPSTREAM;
}

/* CUresult -> MP_* code; OUT_OF_MEMORY is the one failure the pool acts on. */
static inline int cu_check(mp_cuda *c, CUresult r) {
    if (r == CUDA_SUCCESS) return MP_OK;
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return MP_ENOMEM;
    return cu_fail(c, r);
}

/* Note [Context]: returns the context to restore in *prev (NULL = nothing to restore). */
static inline CUresult cu_ctx_enter(mp_cuda *c, CUcontext *prev) {
    CUcontext cur = NULL;
    *prev = NULL;
    CUresult r = mp_cu.CtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS || cur == c->ctx) return r;
    r = mp_cu.CtxSetCurrent(c->ctx);
    if (r == CUDA_SUCCESS) *prev = cur;
    return r;
}

static inline void cu_ctx_leave(CUcontext prev) {
    if (prev) mp_cu.CtxSetCurrent(prev);
}

/* result = expr, called with the device's context current (Note [Context]). */
#define CU_CALL(c, result, expr)                           \
    do {                                                   \
        CUcontext prev_;                                   \
        (result) = cu_ctx_enter((c), &prev_);                 \
        if ((result) == CUDA_SUCCESS) {                    \
            (result) = (expr);                             \
            cu_ctx_leave(prev_);                              \
        }                                                  \
    } while (0)

/* The cudaMemPool the segments come from (the device's current one when none was given). */
MP_CUDA_PRIVATE CUresult cu_pool_of(mp_cuda *c, CUmemoryPool *pool);

/* A message into err (when errlen > 0), printf-style. */
MP_CUDA_PRIVATE void cu_set_err(char *err, size_t errlen, const char *fmt, ...);
/* "what failed: the driver's message" into err; MP_ENOMEM for an out-of-memory, else
 * MP_EUPSTREAM. */
MP_CUDA_PRIVATE int cu_describe(char *err, size_t errlen, const char *what, CUresult r);

/* ---- Sharing with other processes (mp_cuda_share.c; Note [Sharing CUDA memory]). ---- */
/* Set up the sharing state of a new context (MP_ENOMEM when a mutex fails); fill up's
 * share/open/close when the driver can share. */
MP_CUDA_PRIVATE int cu_share_init(mp_cuda *c);
MP_CUDA_PRIVATE void cu_share_install(mp_cuda *c, mp_upstream *up);
/* At destroy, before the reservations go. */
MP_CUDA_PRIVATE void cu_share_destroy(mp_cuda *c);

/* ---- Segments and events (mp_cuda.c). ---- */
MP_CUDA_PRIVATE int cu_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream);

/* ---- Graph capture (mp_cuda_capture.c; Note [Capture segments]). ---- */
MP_CUDA_PRIVATE int cu_capturing(mp_cuda *c, uintptr_t stream);
MP_CUDA_PRIVATE int cu_stream_capturing(void *ctx, uintptr_t stream, int *out);
MP_CUDA_PRIVATE int cu_capture_frontier(void *ctx, uintptr_t stream, uint64_t *graph,
                                        uintptr_t *nodes, size_t cap, size_t *n);
MP_CUDA_PRIVATE int cu_capture_follows(void *ctx, uintptr_t stream, const uintptr_t *nodes,
                                       size_t n, unsigned char *followed);
/* The calling thread in the relaxed capture mode until cu_relaxed_leave(the returned mode);
 * -1: nothing changed, nothing to restore. */
MP_CUDA_PRIVATE int cu_relaxed_enter(void);
MP_CUDA_PRIVATE void cu_relaxed_leave(int mode);
/* A segment outside any capture's graph (cuMemAlloc), remembered as plain. */
MP_CUDA_PRIVATE int cu_plain_alloc(mp_cuda *c, size_t nbytes, CUdeviceptr *p);
/* 1 when p was a plain segment (now forgotten): the caller frees it with cuMemFree. */
MP_CUDA_PRIVATE int cu_plain_take(mp_cuda *c, CUdeviceptr p);

/* ---- Expandable segments (mp_cuda_vmm.c; Note [Expandable pages]). ---- */
MP_CUDA_PRIVATE int cu_va_reserve(void *ctx, size_t nbytes, uintptr_t *out);
MP_CUDA_PRIVATE int cu_map(void *ctx, uintptr_t va, size_t nbytes);
MP_CUDA_PRIVATE int cu_unmap(void *ctx, uintptr_t va, size_t nbytes);
MP_CUDA_PRIVATE int cu_va_release(void *ctx, uintptr_t va, size_t nbytes);
/* The reservation holding [va, va + nbytes), or NULL. Caller holds vmm_lock. */
MP_CUDA_PRIVATE mp_cuda_range *cu_range_find_locked(mp_cuda *c, uintptr_t va, size_t nbytes);
/* At destroy: unmap, release and forget every reservation left. */
MP_CUDA_PRIVATE void cu_vmm_destroy(mp_cuda *c);

#endif
