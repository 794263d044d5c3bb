/* Sharing the CUDA upstream's memory with other processes: the upstream's share, open and
 * close (mp_upstream.h), under the core's handles (Note [Sharing across processes],
 * core/mp_share.c).
 *
 * Note [Sharing CUDA memory]
 * What a handle's payload names, and how another process maps it:
 *   - A segment of the cudaMemPool: the pool must have been created with the POSIX
 *     file-descriptor handle type (Pool(pool_handle="create", ipc=True)); the device's
 *     default or current pool, or a caller's handle made without it, cannot be exported,
 *     and share answers MP_EUNSUPPORTED saying so. The pool is exported once
 *     (cuMemPoolExportToShareableHandle), its descriptor kept open for the upstream's life,
 *     and each segment described by cuMemPoolExportPointer's 64 bytes. The consumer takes
 *     the descriptor out of the producer with mp_fd_take (pidfd_getfd, or the producer's
 *     descriptor server where ptrace permission is refused: Note [Passing descriptors] in
 *     common/mp_fdpass.c), imports the pool once per producer pool (cuMemPoolImportFromShareableHandle; cached by
 *     the producer's pid and the upstream's random token, and destroyed when the last
 *     pointer from it is freed), grants its device access (cuMemPoolSetAccess) and imports
 *     the pointer (cuMemPoolImportPointer); close frees that pointer (cuMemFree).
 *   - A run of expandable pages: each physical allocation is created exportable
 *     (requestedHandleTypes = POSIX file descriptor, mp_cuda_set_shareable; where cuMemCreate
 *     refuses that, pages are made without it and sharing them is refused), exported on its
 *     first share (cuMemExportToShareableHandle) and its descriptor kept, and offered to
 *     other processes (mp_fd_offer), until it is unmapped (mp_cuda_vmm.c). The payload lists each allocation's descriptor, size and
 *     serial; the consumer imports each (cuMemImportFromShareableHandle), reserves address
 *     space for the run, maps them end to end, and grants its device access; close unmaps
 *     them and frees the address space.
 * The payload holds the producer's pid, the upstream's random token, beside each descriptor
 * its own secret (what mp_fd_offer gave for it: the producer's server gives a descriptor only
 * to a request that carries that descriptor's secret, so a handle opens only the descriptors
 * it names) and, for pages, each allocation's serial, so bytes differ whenever the memory
 * differs even where a descriptor number or an address is reused; the driver's export data
 * names one allocation of the pool. The driver maps an allocation once per process, so the opens of one memory in a
 * process share one mapping, counted (two pools opening it get the same address), and a
 * handle opened in the process that made it gives the producer's own address, once its
 * upstream confirms the memory is still what the handle names. Bytes that no share made
 * are refused (MP_EINVAL) before any descriptor is taken; the driver refuses the rest.
 * Why a share or an open failed is in mp_cuda_share_message, per thread: the contract's
 * calls carry only a code.
 */
#define _GNU_SOURCE
#include "mp_cuda_internal.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "mp_fdpass.h"

/* ---- The payload (native byte order: both processes are on one machine). ---- */
enum { KIND_SEGMENT = 1, KIND_PAGES = 2 };
#define PAYLOAD_VERSION 3  /* another layout's payload is refused, never misread */
#define HEAD_BYTES 40      /* kind u8, version u8, pad u16, pid u32, token u64, base u64,
                              then u32 (segment: the pool's descriptor; pages: how many),
                              u32 pad, u64 (segment: the pool descriptor's secret; pages: 0) */
#define SEGMENT_BYTES (HEAD_BYTES + 64)   /* + cuMemPoolExportPointer's data */
#define PIECE_BYTES 32     /* per allocation: descriptor i32, pad u32, size u64, serial u64,
                              the descriptor's secret u64 */
/* Allocations one handle may list: a handle stays within the core's bound on its bytes. */
#define MAX_PIECES 2048

typedef struct {
    int kind;
    uint32_t pid, count;
    int32_t fd;
    uint64_t token, base, secret;
} head;

static void put32(unsigned char *b, uint32_t v) { memcpy(b, &v, 4); }
static void put64(unsigned char *b, uint64_t v) { memcpy(b, &v, 8); }
static uint32_t get32(const unsigned char *b) { uint32_t v; memcpy(&v, b, 4); return v; }
static uint64_t get64(const unsigned char *b) { uint64_t v; memcpy(&v, b, 8); return v; }

static void put_head(unsigned char *b, int kind, const mp_cuda *c, uintptr_t base, uint32_t n,
                     uint64_t secret) {
    memset(b, 0, HEAD_BYTES);
    b[0] = (unsigned char)kind;
    b[1] = PAYLOAD_VERSION;
    put32(b + 4, (uint32_t)getpid());
    put64(b + 8, c->token);
    put64(b + 16, base);
    put32(b + 24, n);
    put64(b + 32, secret);
}

/* ---- Messages (per thread: the contract's calls carry only a code). ---- */
static __thread char sh_msg[512];

static int say(int rc, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(sh_msg, sizeof sh_msg, fmt, ap);
    va_end(ap);
    return rc;
}

static int say_driver(mp_cuda *c, CUresult r, const char *what) {
    char text[200];
    mp_cuda_error_string(r, text, sizeof text);
    say(MP_EUPSTREAM, "%s failed: %s", what, text);
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return MP_ENOMEM;
    return cu_fail(c, r);
}

void mp_cuda_share_message(char *buf, size_t buflen) {
    if (buf && buflen) snprintf(buf, buflen, "%s", sh_msg);
}

#define CANNOT_SHARE "; create the Pool with pool_handle=\"create\" (the default) and ipc=True"

/* ---- Process-wide state, under sh_lock: shareable upstreams (for opens in the process
 * that made a handle), imported pools and open imports. Lock order: sh_lock, then an
 * upstream's vmm_lock or share_lock. ---- */
typedef struct {
    uint32_t pid;
    uint64_t token;
    CUmemoryPool pool;
    size_t users;        /* imports open from it */
    uint64_t access;     /* devices granted, bit per ordinal */
} sh_pool;

typedef struct {
    unsigned char *bytes;   /* the payload opened, the key */
    size_t len, nbytes, users;
    CUdeviceptr base;
    int kind;               /* KIND_*, or 0: this process's own memory */
    CUcontext ctx;          /* the context it was imported in */
    sh_pool *pool;          /* KIND_SEGMENT */
    size_t npieces;         /* KIND_PAGES: the allocations mapped end to end */
    size_t *sizes;
    uint64_t access;
} sh_import;

static pthread_mutex_t sh_lock = PTHREAD_MUTEX_INITIALIZER;
static mp_cuda **sh_own;
static size_t sh_nown, sh_capown;
static sh_pool **sh_pools;
static size_t sh_npools, sh_cappools;
static sh_import **sh_imports;
static size_t sh_nimports, sh_capimports;

/* Append v to a growing array of pointers; 0 when out of memory. */
static int push(void ***arr, size_t *n, size_t *cap, void *v) {
    if (*n == *cap) {
        size_t grown = *cap ? 2 * *cap : 8;
        void **a = realloc(*arr, grown * sizeof *a);
        if (!a) return 0;
        *arr = a;
        *cap = grown;
    }
    (*arr)[(*n)++] = v;
    return 1;
}

static void drop(void **arr, size_t *n, void *v) {
    for (size_t i = 0; i < *n; i++)
        if (arr[i] == v) {
            arr[i] = arr[--*n];
            return;
        }
}

/* ---- Life of an upstream's sharing state. ---- */

int cu_share_init(mp_cuda *c) {
    c->pool_fd = -1;
    c->page_handle_types = CU_MEM_HANDLE_TYPE_NONE;
    if (getrandom(&c->token, sizeof c->token, GRND_NONBLOCK) != (ssize_t)sizeof c->token) {
        struct timespec t;
        clock_gettime(CLOCK_MONOTONIC, &t);
        c->token = ((uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec) ^
                   ((uint64_t)getpid() << 32) ^ (uint64_t)(uintptr_t)c;
    }
    return pthread_mutex_init(&c->share_lock, NULL) == 0 ? MP_OK : MP_ENOMEM;
}

void cu_share_destroy(mp_cuda *c) {
    pthread_mutex_lock(&sh_lock);
    drop((void **)sh_own, &sh_nown, c);
    pthread_mutex_unlock(&sh_lock);
    if (c->pool_fd >= 0) {
        mp_fd_withdraw(c->pool_fd);   /* before the number can name another file */
        close(c->pool_fd);
    }
    c->pool_fd = -1;
    pthread_mutex_destroy(&c->share_lock);
}

int mp_cuda_set_shareable(mp_upstream *up, int on) {
    sh_msg[0] = 0;
    if (!mp_cuda_owns(up)) return say(MP_EINVAL, "not an upstream made by mp_cuda_upstream");
    mp_cuda *c = up->ctx;
    if (on && !mp_cu.has_share)
        return say(MP_EUNSUPPORTED, "the CUDA driver lacks the calls that share memory with "
                   "other processes (cuMemPoolExportToShareableHandle and the rest, driver "
                   "11.2+)");
    int rc = MP_OK;
    pthread_mutex_lock(&sh_lock);
    pthread_mutex_lock(&c->vmm_lock);
    if (c->nranges) {
        rc = say(MP_EBUSY, "whether the memory is shared must be said before any address "
                 "space is reserved");
    } else {
        drop((void **)sh_own, &sh_nown, c);
        if (on && !push((void ***)&sh_own, &sh_nown, &sh_capown, c)) {
            rc = say(MP_ENOMEM, "out of host memory");
        } else {
            c->shareable = on ? 1 : 0;
            c->page_handle_types = on ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                                      : CU_MEM_HANDLE_TYPE_NONE;
        }
    }
    pthread_mutex_unlock(&c->vmm_lock);
    pthread_mutex_unlock(&sh_lock);
    return rc;
}

/* ---- share ---- */

/* The cudaMemPool's descriptor, exported and offered on first use, and its secret. */
static int pool_fd(mp_cuda *c, int *fd, uint64_t *secret) {
    int rc = MP_OK;
    pthread_mutex_lock(&c->share_lock);
    if (c->pool_fd < 0) {
        if (!c->pool) {
            rc = say(MP_EUNSUPPORTED, "the pool allocates from device %d's current cudaMemPool, "
                     "which cannot be shared" CANNOT_SHARE, c->ordinal);
        } else {
            int out = -1;
            CUresult r;
            CU_CALL(c, r, mp_cu.MemPoolExportToShareableHandle(
                              &out, c->pool, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
            if (r == CUDA_SUCCESS && out >= 0 && mp_fd_offer(out, secret) != MP_OK) {
                close(out);
                rc = say(MP_ENOMEM, "out of host memory");
            } else if (r == CUDA_SUCCESS && out >= 0) {
                c->pool_fd = out;
            } else {
                char text[200];
                mp_cuda_error_string(r, text, sizeof text);
                rc = say(MP_EUNSUPPORTED, "the pool's cudaMemPool cannot be shared with other "
                         "processes (cuMemPoolExportToShareableHandle: %s): it was not created "
                         "with the POSIX file-descriptor handle type" CANNOT_SHARE, text);
            }
        }
    } else if (mp_fd_offer(c->pool_fd, secret) != MP_OK) {   /* offered: its secret again */
        rc = say(MP_ENOMEM, "out of host memory");
    }
    *fd = c->pool_fd;
    pthread_mutex_unlock(&c->share_lock);
    return rc;
}

static int share_segment(mp_cuda *c, uintptr_t base, unsigned char *buf, size_t cap,
                         size_t *len) {
    *len = SEGMENT_BYTES;
    if (cap < SEGMENT_BYTES) return MP_EINVAL;
    int fd;
    uint64_t secret = 0;
    int rc = pool_fd(c, &fd, &secret);
    if (rc != MP_OK) return rc;
    CUmemPoolPtrExportData data;
    memset(&data, 0, sizeof data);
    CUresult r;
    CU_CALL(c, r, mp_cu.MemPoolExportPointer(&data, (CUdeviceptr)base));
    if (r != CUDA_SUCCESS) {
        char text[200];
        mp_cuda_error_string(r, text, sizeof text);
        /* A segment of cuMemAlloc (made while a CUDA graph was captured) is none of the
         * pool's: Note [Capture segments]. */
        return say(MP_EUNSUPPORTED, "this segment cannot be shared (cuMemPoolExportPointer: "
                   "%s); segments made while a CUDA graph is captured are outside the "
                   "cudaMemPool", text);
    }
    put_head(buf, KIND_SEGMENT, c, base, (uint32_t)fd, secret);
    memcpy(buf + HEAD_BYTES, &data, sizeof data);
    return MP_OK;
}

static int share_pages(mp_cuda *c, uintptr_t base, size_t nbytes, unsigned char *buf,
                       size_t cap, size_t *len) {
    const size_t g = c->granularity;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = g && base % g == 0 && nbytes % g == 0 && nbytes
                           ? cu_range_find_locked(c, base, nbytes) : NULL;
    size_t first = r ? (base - r->va) / g : 0, n = nbytes / g, count = 0;
    int whole = r && r->mapped[first] == PAGE_HEAD &&
                (first + n == r->npages || r->mapped[first + n] != PAGE_REST);
    for (size_t i = first; whole && i < first + n; i++) {
        whole = r->mapped[i] != PAGE_UNMAPPED;
        count += r->mapped[i] == PAGE_HEAD;
    }
    if (!whole || count > MAX_PIECES) {
        rc = say(MP_EINVAL, "[%#lx, +%zu) is not a run of whole mapped allocations",
                 (unsigned long)base, nbytes);
        goto out;
    }
    *len = HEAD_BYTES + count * PIECE_BYTES;
    if (cap < *len) {
        rc = MP_EINVAL;
        goto out;
    }
    put_head(buf, KIND_PAGES, c, base, (uint32_t)count, 0);
    unsigned char *p = buf + HEAD_BYTES;
    for (size_t i = first; i < first + n; i++) {
        if (r->mapped[i] != PAGE_HEAD) continue;
        size_t k = 1;
        while (i + k < r->npages && r->mapped[i + k] == PAGE_REST) k++;
        if (!r->shareable[i]) {
            char text[200];
            mp_cuda_error_string(c->page_share_refused, text, sizeof text);
            rc = say(MP_EUNSUPPORTED, "these expandable-segment pages cannot be shared: %s",
                     c->page_share_refused ? text : "they were made before the pool was "
                     "shareable");
            goto out;
        }
        if (!r->fds[i]) {
            int fd = -1;
            CUresult e;
            CU_CALL(c, e, mp_cu.MemExportToShareableHandle(
                              &fd, r->handles[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
            if (e != CUDA_SUCCESS || fd < 0) {
                rc = say_driver(c, e, "cuMemExportToShareableHandle");
                goto out;
            }
            r->fds[i] = fd + 1;   /* kept (and closed at unmap) even if the offer fails */
        }
        uint64_t secret = 0;   /* the first offer draws it; later ones give it again */
        if (mp_fd_offer(r->fds[i] - 1, &secret) != MP_OK) {
            rc = say(MP_ENOMEM, "out of host memory");
            goto out;
        }
        memset(p, 0, PIECE_BYTES);
        put32(p, (uint32_t)(r->fds[i] - 1));
        put64(p + 8, (uint64_t)(k * g));
        put64(p + 16, r->serials[i]);
        put64(p + 24, secret);
        p += PIECE_BYTES;
    }
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

static int cu_share(void *ctx, uintptr_t base, size_t nbytes, int expandable,
                    unsigned char *buf, size_t cap, size_t *len) {
    mp_cuda *c = ctx;
    sh_msg[0] = 0;
    if (!len || (cap && !buf)) return say(MP_EINVAL, "no buffer for the handle");
    *len = 0;   /* stays 0 unless the buffer was too small */
    if (!c->shareable)
        return say(MP_EUNSUPPORTED, "the pool was not made to share its memory with other "
                   "processes" CANNOT_SHARE);
    return expandable ? share_pages(c, base, nbytes, buf, cap, len)
                      : share_segment(c, base, buf, cap, len);
}

/* ---- open ---- */

/* Descriptor `fd` of process `pid`, asked for with its `secret`, duplicated into this one
 * (mp_fd_take), or why not. */
static int take_fd(const head *h, int32_t fd, uint64_t secret, int *out) {
    uint32_t pid = h->pid;
    int why = 0;
    int rc = mp_fd_take(pid, fd, secret, out, &why);
    if (rc == MP_OK) return MP_OK;
    if (rc == MP_ENOMEM)
        return say(MP_ENOMEM, "this process cannot take process %u's shared descriptor: %s",
                   pid, strerror(why));
    if (rc == MP_EINVAL && why == ESRCH)
        return say(MP_EINVAL, "the process that shared this memory (pid %u) is gone: %s", pid,
                   strerror(why));
    if (rc == MP_EINVAL)
        return say(MP_EINVAL, "process %u has no shared descriptor %d any more, or the "
                   "handle's descriptor secret is not its own: %s", pid, (int)fd,
                   strerror(why));
    if (why == EPERM || why == EACCES)
        return say(MP_EUNSUPPORTED, "this process may not take the descriptor of process %u's "
                   "shared memory: pidfd_getfd (%s) needs ptrace permission over it, which "
                   "Yama's /proc/sys/kernel/yama/ptrace_scope refuses (at 1: unless that "
                   "process is this one's descendant or allowed it with prctl "
                   "PR_SET_PTRACER), and its descriptor server did not answer", pid,
                   strerror(why));
    if (why == ENOSYS)
        return say(MP_EUNSUPPORTED, "opening another process's memory needs pidfd_getfd "
                   "(Linux 5.6+) or the producer's descriptor server, which did not answer");
    return say(MP_EUNSUPPORTED, "process %u's descriptor server did not answer (%s)", pid,
               strerror(why));
}

/* Grant the calling upstream's device access to an imported pool (before its pointers
 * are imported, as CUDA's own samples do), once per device. */
static int pool_grant(mp_cuda *c, sh_pool *sp) {
    uint64_t bit = (uint64_t)1 << (c->ordinal & 63);
    if (sp->access & bit) return MP_OK;
    CUmemAccessDesc d = {.location = c->prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUresult r;
    CU_CALL(c, r, mp_cu.MemPoolSetAccess(sp->pool, &d, 1));
    if (r != CUDA_SUCCESS) return say_driver(c, r, "cuMemPoolSetAccess of the imported pool");
    sp->access |= bit;
    return MP_OK;
}

/* Grant the calling upstream's device access to an import, once per device. */
static int grant(mp_cuda *c, sh_import *im) {
    uint64_t bit = (uint64_t)1 << (c->ordinal & 63);
    if (im->kind == 0 || (im->access & bit)) return MP_OK;
    CUmemAccessDesc d = {.location = c->prop.location, .flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUresult r;
    if (im->kind == KIND_SEGMENT) {
        int rc = pool_grant(c, im->pool);
        if (rc != MP_OK) return rc;
    } else {
        CU_CALL(c, r, mp_cu.MemSetAccess(im->base, im->nbytes, &d, 1));
        if (r != CUDA_SUCCESS) return say_driver(c, r, "cuMemSetAccess of the imported pages");
    }
    im->access |= bit;
    return MP_OK;
}

/* Memory of this process's own upstream `token`, still what the payload names: *ok = 1. */
static int check_own(const head *h, const unsigned char *buf, size_t nbytes, int *ok) {
    *ok = 0;
    mp_cuda *own = NULL;
    for (size_t i = 0; i < sh_nown; i++)
        if (sh_own[i]->token == h->token) own = sh_own[i];
    if (!own) return MP_OK;
    if (h->kind == KIND_SEGMENT) {
        CUmemPoolPtrExportData data;
        CUresult r;
        CU_CALL(own, r, mp_cu.MemPoolExportPointer(&data, (CUdeviceptr)h->base));
        *ok = r == CUDA_SUCCESS && !memcmp(&data, buf + HEAD_BYTES, sizeof data);
        return MP_OK;
    }
    const size_t g = own->granularity;
    pthread_mutex_lock(&own->vmm_lock);
    mp_cuda_range *r = g && h->base % g == 0 && nbytes % g == 0
                           ? cu_range_find_locked(own, h->base, nbytes) : NULL;
    size_t p = r ? (h->base - r->va) / g : 0, seen = 0;
    int good = r != NULL;
    for (size_t i = 0; good && i < h->count; i++) {
        const unsigned char *piece = buf + HEAD_BYTES + i * PIECE_BYTES;
        size_t k = get64(piece + 8) / g;
        good = p < r->npages && r->mapped[p] == PAGE_HEAD &&
               r->serials[p] == get64(piece + 16);
        p += k;
        seen += k;
    }
    *ok = good && seen * g == nbytes;
    pthread_mutex_unlock(&own->vmm_lock);
    return MP_OK;
}

/* The producer's pool, imported once per process; users counted by the caller. */
static int import_pool(mp_cuda *c, const head *h, sh_pool **out) {
    for (size_t i = 0; i < sh_npools; i++)
        if (sh_pools[i]->pid == h->pid && sh_pools[i]->token == h->token) {
            *out = sh_pools[i];
            return MP_OK;
        }
    sh_pool *sp = calloc(1, sizeof *sp);
    if (!sp || !push((void ***)&sh_pools, &sh_npools, &sh_cappools, sp)) {
        free(sp);
        return say(MP_ENOMEM, "out of host memory");
    }
    int fd = -1;
    int rc = take_fd(h, h->fd, h->secret, &fd);
    if (rc == MP_OK) {
        CUresult r;
        CU_CALL(c, r, mp_cu.MemPoolImportFromShareableHandle(
                          &sp->pool, (void *)(uintptr_t)fd,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
        close(fd);   /* the imported pool holds what it needs */
        if (r != CUDA_SUCCESS) rc = say_driver(c, r, "cuMemPoolImportFromShareableHandle");
    }
    if (rc != MP_OK) {
        drop((void **)sh_pools, &sh_npools, sp);
        free(sp);
        return rc;
    }
    sp->pid = h->pid;
    sp->token = h->token;
    *out = sp;
    return MP_OK;
}

static void pool_unuse(sh_pool *sp, CUcontext ctx) {
    if (--sp->users) return;
    CUcontext prev = NULL;
    if (mp_cu.CtxGetCurrent(&prev) == CUDA_SUCCESS && prev != ctx) mp_cu.CtxSetCurrent(ctx);
    (void)mp_cu.MemPoolDestroy(sp->pool);   /* nothing to report to */
    if (prev != ctx) mp_cu.CtxSetCurrent(prev);
    drop((void **)sh_pools, &sh_npools, sp);
    free(sp);
}

static int open_segment(mp_cuda *c, const head *h, const unsigned char *buf, sh_import *im) {
    sh_pool *sp = NULL;
    int rc = import_pool(c, h, &sp);
    if (rc != MP_OK) return rc;
    sp->users++;
    im->pool = sp;
    CUmemPoolPtrExportData data;
    memcpy(&data, buf + HEAD_BYTES, sizeof data);
    CUresult r = CUDA_SUCCESS;
    rc = pool_grant(c, sp);
    if (rc == MP_OK) {
        CU_CALL(c, r, mp_cu.MemPoolImportPointer(&im->base, sp->pool, &data));
        if (r != CUDA_SUCCESS) rc = say_driver(c, r, "cuMemPoolImportPointer");
    }
    if (rc != MP_OK) {
        pool_unuse(sp, c->ctx);
        im->pool = NULL;
    }
    return rc;
}

static int open_pages(mp_cuda *c, const head *h, const unsigned char *buf, sh_import *im) {
    if (!c->driver_granularity)
        return say(MP_EUNSUPPORTED, "device %d has no virtual memory management, so it cannot "
                   "open another process's expandable segments", c->ordinal);
    im->sizes = calloc(h->count, sizeof *im->sizes);
    CUmemGenericAllocationHandle *hs = calloc(h->count, sizeof *hs);
    if (!im->sizes || !hs) {
        free(hs);
        return say(MP_ENOMEM, "out of host memory");
    }
    int rc = MP_OK;
    size_t imported = 0, mapped = 0;
    CUresult r = CUDA_SUCCESS;
    for (; imported < h->count; imported++) {
        const unsigned char *piece = buf + HEAD_BYTES + imported * PIECE_BYTES;
        im->sizes[imported] = (size_t)get64(piece + 8);
        int fd = -1;
        rc = take_fd(h, (int32_t)get32(piece), get64(piece + 24), &fd);
        if (rc != MP_OK) goto fail;
        CU_CALL(c, r, mp_cu.MemImportFromShareableHandle(
                          &hs[imported], (void *)(uintptr_t)fd,
                          CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
        close(fd);
        if (r != CUDA_SUCCESS) {
            rc = say_driver(c, r, "cuMemImportFromShareableHandle");
            goto fail;
        }
    }
    CU_CALL(c, r, mp_cu.MemAddressReserve(&im->base, im->nbytes, c->driver_granularity, 0, 0));
    if (r != CUDA_SUCCESS) {
        rc = say_driver(c, r, "cuMemAddressReserve");
        goto fail;
    }
    for (size_t off = 0; mapped < h->count; off += im->sizes[mapped++]) {
        CU_CALL(c, r, mp_cu.MemMap(im->base + off, im->sizes[mapped], 0, hs[mapped], 0));
        if (r != CUDA_SUCCESS) {
            rc = say_driver(c, r, "cuMemMap of an imported allocation");
            goto fail;
        }
    }
    /* The mappings keep the memory: the handles go now. */
    for (size_t i = 0; i < h->count; i++) mp_cu.MemRelease(hs[i]);
    free(hs);
    im->npieces = h->count;
    return MP_OK;
fail: {
        CUcontext prev;
        if (cu_ctx_enter(c, &prev) == CUDA_SUCCESS) {
            for (size_t i = 0, off = 0; i < mapped; off += im->sizes[i++])
                mp_cu.MemUnmap(im->base + off, im->sizes[i]);
            if (im->base) mp_cu.MemAddressFree(im->base, im->nbytes);
            for (size_t i = 0; i < imported; i++) mp_cu.MemRelease(hs[i]);
            cu_ctx_leave(prev);
        }
    }
    free(hs);
    im->base = 0;
    return rc;
}

/* Parse and check a payload against the size the core read from its header. */
static int parse(mp_cuda *c, const unsigned char *buf, size_t len, size_t nbytes, head *h) {
    if (!buf || len < HEAD_BYTES || buf[1] != PAYLOAD_VERSION ||
        (buf[0] != KIND_SEGMENT && buf[0] != KIND_PAGES))
        return say(MP_EINVAL, "not a handle of the cuda upstream");
    h->kind = buf[0];
    h->pid = get32(buf + 4);
    h->token = get64(buf + 8);
    h->base = get64(buf + 16);
    h->count = get32(buf + 24);
    h->fd = (int32_t)h->count;
    h->secret = get64(buf + 32);
    if (h->pid == 0 || nbytes == 0) return say(MP_EINVAL, "a handle naming no memory");
    if (h->kind == KIND_SEGMENT)
        return len == SEGMENT_BYTES && h->fd >= 0
                   ? MP_OK : say(MP_EINVAL, "a malformed handle of a cudaMemPool segment");
    if (h->count == 0 || h->count > MAX_PIECES || len != HEAD_BYTES + h->count * PIECE_BYTES ||
        h->secret)
        return say(MP_EINVAL, "a malformed handle of expandable-segment pages");
    size_t total = 0, g = c->driver_granularity ? c->driver_granularity : 1;
    for (uint32_t i = 0; i < h->count; i++) {
        const unsigned char *piece = buf + HEAD_BYTES + i * PIECE_BYTES;
        uint64_t size = get64(piece + 8);
        if ((int32_t)get32(piece) < 0 || size == 0 || size % g || size > nbytes - total)
            return say(MP_EINVAL, "a malformed handle of expandable-segment pages");
        total += (size_t)size;
    }
    return total == nbytes ? MP_OK : say(MP_EINVAL, "a handle whose pages do not add up to its "
                                         "size");
}

/* Undo an import's mapping (not this process's own memory), in the context it was made
 * in. Caller holds sh_lock. */
static int unmap_import(sh_import *im) {
    CUcontext prev = NULL;
    CUresult r = mp_cu.CtxGetCurrent(&prev);
    if (r == CUDA_SUCCESS && prev != im->ctx) r = mp_cu.CtxSetCurrent(im->ctx);
    if (r != CUDA_SUCCESS) return say(MP_EUPSTREAM, "could not make the importing context current");
    CUresult bad = CUDA_SUCCESS;
    if (im->kind == KIND_SEGMENT) {
        bad = mp_cu.MemFree(im->base);
    } else {
        for (size_t i = 0, off = 0; i < im->npieces; off += im->sizes[i++]) {
            CUresult e = mp_cu.MemUnmap(im->base + off, im->sizes[i]);
            if (bad == CUDA_SUCCESS) bad = e;
        }
        CUresult e = mp_cu.MemAddressFree(im->base, im->nbytes);
        if (bad == CUDA_SUCCESS) bad = e;
    }
    if (prev != im->ctx) mp_cu.CtxSetCurrent(prev);
    if (im->kind == KIND_SEGMENT) pool_unuse(im->pool, im->ctx);
    im->pool = NULL;
    if (bad == CUDA_SUCCESS) return MP_OK;
    char text[200];
    mp_cuda_error_string(bad, text, sizeof text);
    return say(MP_EUPSTREAM, "closing memory opened from another process failed: %s", text);
}

/* Drop an import's record. Caller holds sh_lock. */
static void forget(sh_import *im) {
    drop((void **)sh_imports, &sh_nimports, im);
    free(im->sizes);
    free(im->bytes);
    free(im);
}

static int cu_open(void *ctx, const unsigned char *buf, size_t len, size_t nbytes,
                   uintptr_t *out) {
    mp_cuda *c = ctx;
    sh_msg[0] = 0;
    head h = {0};
    if (!out) return say(MP_EINVAL, "nowhere to put the address");
    int rc = parse(c, buf, len, nbytes, &h);
    if (rc != MP_OK) return rc;
    pthread_mutex_lock(&sh_lock);
    for (size_t i = 0; i < sh_nimports; i++) {
        sh_import *im = sh_imports[i];
        if (im->len == len && im->nbytes == nbytes && !memcmp(im->bytes, buf, len)) {
            rc = grant(c, im);
            if (rc == MP_OK) {
                im->users++;
                *out = (uintptr_t)im->base;
            }
            goto out;
        }
    }
    sh_import *im = calloc(1, sizeof *im);
    unsigned char *copy = malloc(len);
    if (!im || !copy || !push((void ***)&sh_imports, &sh_nimports, &sh_capimports, im)) {
        free(im);
        free(copy);
        rc = say(MP_ENOMEM, "out of host memory");
        goto out;
    }
    memcpy(copy, buf, len);
    *im = (sh_import){.bytes = copy, .len = len, .nbytes = nbytes, .users = 1,
                      .kind = h.kind, .ctx = c->ctx};
    if (h.pid == (uint32_t)getpid()) {
        int ok;
        rc = check_own(&h, buf, nbytes, &ok);
        if (rc == MP_OK && !ok)
            rc = say(MP_EINVAL, "this process made the handle, and the memory it names is no "
                     "longer there");
        im->kind = 0;
        im->base = (CUdeviceptr)h.base;
    } else {
        rc = h.kind == KIND_SEGMENT ? open_segment(c, &h, buf, im) : open_pages(c, &h, buf, im);
    }
    if (rc == MP_OK) rc = grant(c, im);
    if (rc == MP_OK) {
        *out = (uintptr_t)im->base;
    } else {
        if (im->base && im->kind) unmap_import(im);
        forget(im);
    }
out:
    pthread_mutex_unlock(&sh_lock);
    return rc;
}

/* ---- close ---- */

static int cu_close(void *ctx, uintptr_t ptr, size_t nbytes) {
    (void)ctx;
    sh_msg[0] = 0;
    int rc = MP_OK;
    pthread_mutex_lock(&sh_lock);
    sh_import *im = NULL;
    for (size_t i = 0; i < sh_nimports && !im; i++)
        if (sh_imports[i]->base == (CUdeviceptr)ptr && sh_imports[i]->nbytes == nbytes)
            im = sh_imports[i];
    if (!im) {
        rc = say(MP_EINVAL, "[%#lx, +%zu) is no memory opened from another process",
                 (unsigned long)ptr, nbytes);
    } else if (--im->users == 0) {
        if (im->kind) rc = unmap_import(im);
        forget(im);
    }
    pthread_mutex_unlock(&sh_lock);
    return rc;
}

void cu_share_install(mp_cuda *c, mp_upstream *up) {
    (void)c;
    if (!mp_cu.has_share) return;
    up->share = cu_share;
    up->open = cu_open;
    up->close = cu_close;
}
