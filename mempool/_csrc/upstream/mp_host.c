/* The host upstream: real host memory, streams that are always complete. The bytes are
 * real, so tests fill and verify them, and NumPy can read them through DLPack (kDLCPU).
 * Expandable segments map pages of a PROT_NONE reservation read-write. */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "mp_budget.h"
#include "mp_fdpass.h"
#include "mp_upstream.h"

typedef struct mp_host {
    pthread_mutex_t mu;
    mp_budget budget;
    size_t granularity;
    uintptr_t next_event;
    mp_ptrmap mappings;   /* one per map call, unmapped only whole (mp_mappings_whole) */
    /* Note [Host sharing]: memory backed by memfds, so that another process can map it:
     * set before the first allocation (mp_host_set_shareable); the memfd of each segment
     * and each map call by address (struct host_fd), and the serial of the next one. */
    int shareable;
    int used;
    mp_ptrmap fds;
    uint64_t next_serial;
} mp_host;

/* A memfd behind a segment or a map call (Note [Host sharing]). */
struct host_fd {
    int fd;
    size_t nbytes;
    uint64_t serial;
    uint64_t ino;   /* the consumer checks it: an fd number may be reused for other memory */
};

/* Note [Host sharing] (below): the helpers the allocation paths call. */
static int host_fd_back(mp_host *h, uintptr_t at, size_t nbytes, int fixed, uintptr_t *out);
static void host_fd_drop(mp_host *h, uintptr_t at, size_t nbytes, int fixed);

static int host_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_host *h = ctx;
    (void)stream;
    pthread_mutex_lock(&h->mu);
    int rc = mp_budget_take(&h->budget, nbytes);
    h->used = 1;
    pthread_mutex_unlock(&h->mu);
    if (rc != MP_OK) return rc;
    void *p = NULL;
    uintptr_t shared = 0;
    if (h->shareable) {
        if (host_fd_back(h, 0, nbytes, 0, &shared) != MP_OK) {
            pthread_mutex_lock(&h->mu);
            mp_budget_give(&h->budget, nbytes);
            pthread_mutex_unlock(&h->mu);
            return MP_ENOMEM;
        }
        p = (void *)shared;
    } else if (posix_memalign(&p, 4096, nbytes) != 0) {
        pthread_mutex_lock(&h->mu);
        mp_budget_give(&h->budget, nbytes);
        pthread_mutex_unlock(&h->mu);
        return MP_ENOMEM;
    }
    pthread_mutex_lock(&h->mu);
    h->budget.num_allocs++;
    pthread_mutex_unlock(&h->mu);
    *out = (uintptr_t)p;
    return MP_OK;
}

static int host_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    mp_host *h = ctx;
    (void)stream;
    if (h->shareable) host_fd_drop(h, ptr, nbytes, 0);
    else free((void *)ptr);
    pthread_mutex_lock(&h->mu);
    mp_budget_give(&h->budget, nbytes);
    h->budget.num_frees++;
    pthread_mutex_unlock(&h->mu);
    return MP_OK;
}

/* Host streams are always complete: events are tokens, waits and syncs return at once. */
static int host_event_create(void *ctx, uintptr_t *out) {
    mp_host *h = ctx;
    pthread_mutex_lock(&h->mu);
    *out = ++h->next_event;
    pthread_mutex_unlock(&h->mu);
    return MP_OK;
}
static int host_event_record(void *ctx, uintptr_t ev, uintptr_t stream) { (void)ctx; (void)ev; (void)stream; return MP_OK; }
static int host_event_query(void *ctx, uintptr_t ev) { (void)ctx; (void)ev; return MP_OK; }
static int host_stream_wait_event(void *ctx, uintptr_t stream, uintptr_t ev) { (void)ctx; (void)stream; (void)ev; return MP_OK; }
static int host_event_destroy(void *ctx, uintptr_t ev) { (void)ctx; (void)ev; return MP_OK; }
static int host_stream_synchronize(void *ctx, uintptr_t stream) { (void)ctx; (void)stream; return MP_OK; }
static int host_stream_query(void *ctx, uintptr_t stream) { (void)ctx; (void)stream; return MP_OK; }
static int host_device_synchronize(void *ctx) { (void)ctx; return MP_OK; }

static int host_mem_info(void *ctx, size_t *free_bytes, size_t *total) {
    mp_host *h = ctx;
    pthread_mutex_lock(&h->mu);
    *total = h->budget.capacity;
    *free_bytes = h->budget.capacity - h->budget.used;
    pthread_mutex_unlock(&h->mu);
    return MP_OK;
}

static int host_va_reserve(void *ctx, size_t nbytes, uintptr_t *out) {
    mp_host *h = ctx;
    size_t g = h->granularity;
    /* Over-reserve by one page to align the start to the granularity, then trim. */
    void *p = mmap(NULL, nbytes + g, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return MP_ENOMEM;
    uintptr_t base = (uintptr_t)p, start = (base + g - 1) / g * g;
    if (start > base) munmap(p, start - base);
    if (base + nbytes + g > start + nbytes) munmap((void *)(start + nbytes), base + nbytes + g - (start + nbytes));
    *out = start;
    return MP_OK;
}

static int host_map(void *ctx, uintptr_t va, size_t nbytes) {
    mp_host *h = ctx;
    size_t g = h->granularity, npages = nbytes / g, done = 0;
    if (!nbytes || va % g || nbytes % g) return MP_EINVAL;
    pthread_mutex_lock(&h->mu);
    int64_t fail_after = h->budget.fail_map_after;
    h->budget.fail_map_after = -1;
    int rc = mp_budget_take(&h->budget, nbytes);   /* fail_next and the capacity */
    h->used = 1;
    pthread_mutex_unlock(&h->mu);
    if (rc != MP_OK) return rc;
    if (h->shareable) {
        /* One memfd for the whole call, mapped over the reservation: the physical
         * allocation another process maps (Note [Host sharing]). */
        uintptr_t at = va;
        if (fail_after >= 0 || host_fd_back(h, va, nbytes, 1, &at) != MP_OK) rc = MP_ENOMEM;
        else done = npages;
    }
    /* Page by page, as the sim and the driver map; a failure part-way undoes the pages
     * already mapped, so the map is all or nothing. */
    for (; rc == MP_OK && done < npages; done++) {
        if ((fail_after >= 0 && (int64_t)done == fail_after) ||
            mprotect((void *)(va + done * g), g, PROT_READ | PROT_WRITE) != 0) {
            rc = MP_ENOMEM;
            break;
        }
    }
    if (rc != MP_OK && done && !h->shareable) {
        madvise((void *)va, done * g, MADV_DONTNEED);
        mprotect((void *)va, done * g, PROT_NONE);
    }
    pthread_mutex_lock(&h->mu);
    if (rc == MP_OK && mp_ptrmap_insert(&h->mappings, va, (void *)(uintptr_t)nbytes) != MP_OK) {
        rc = MP_ENOMEM;
        pthread_mutex_unlock(&h->mu);
        if (h->shareable) host_fd_drop(h, va, nbytes, 1);
        else {
            madvise((void *)va, nbytes, MADV_DONTNEED);
            mprotect((void *)va, nbytes, PROT_NONE);
        }
        pthread_mutex_lock(&h->mu);
    }
    if (rc == MP_OK) {
        h->budget.num_maps++;
    } else {
        mp_budget_give(&h->budget, nbytes);
        h->budget.num_failed++;
    }
    pthread_mutex_unlock(&h->mu);
    return rc;
}

static int host_unmap(void *ctx, uintptr_t va, size_t nbytes) {
    mp_host *h = ctx;
    pthread_mutex_lock(&h->mu);
    int whole = nbytes && mp_mappings_whole(&h->mappings, va, nbytes);
    if (whole) mp_mappings_remove(&h->mappings, va, nbytes);
    pthread_mutex_unlock(&h->mu);
    if (!whole) return MP_EINVAL;   /* it would cut a physical allocation: nothing changes */
    if (h->shareable) {
        /* Each map call's memfd, whole: [va, va + nbytes) is made of whole ones. */
        for (uintptr_t a = va; a < va + nbytes;) {
            pthread_mutex_lock(&h->mu);
            struct host_fd *f = mp_ptrmap_get(&h->fds, a);
            size_t n = f ? f->nbytes : nbytes - (a - va);
            pthread_mutex_unlock(&h->mu);
            host_fd_drop(h, a, n, 1);
            a += n;
        }
    } else {
        madvise((void *)va, nbytes, MADV_DONTNEED);   /* drop the pages themselves */
        mprotect((void *)va, nbytes, PROT_NONE);
    }
    pthread_mutex_lock(&h->mu);
    mp_budget_give(&h->budget, nbytes);
    h->budget.num_unmaps++;
    pthread_mutex_unlock(&h->mu);
    return MP_OK;
}

static int host_va_release(void *ctx, uintptr_t va, size_t nbytes) {
    (void)ctx;
    munmap((void *)va, nbytes);
    return MP_OK;
}

/* ---- sharing with other processes ------------------------------------------------------ */

/* Note [Host sharing]
 * A host pool made to share (mp_host_set_shareable, before its first allocation) backs each
 * segment and each map call with a memfd of its own, mapped MAP_SHARED: memory another
 * process can map. The payload of a region is the producer's pid, the payload's version
 * and, for each memfd in it, the fd number, its secret (what mp_fd_offer gave for it), its
 * inode, its size and a serial; share offers each memfd (withdrawn before it is closed), and
 * a consumer takes the fds across with mp_fd_take (pidfd_getfd, or the producer's
 * descriptor server, which asks for each fd's own secret, where ptrace permission is
 * refused: Note [Passing
 * descriptors] in common/mp_fdpass.c; neither allowed, open answers MP_EUNSUPPORTED), checks
 * each one's inode and size (an fd number freed and reused names other memory: MP_EINVAL),
 * maps them side by side in a reservation of its own and closes them. The mapping keeps the
 * memory alive whatever the producer does next; close unmaps it. Pools that do not share
 * keep malloc'd segments and mprotect'ed pages: no fd per segment.
 */
#define HOST_HEAD_LEN 16    /* u32 pid, u32 entries, u32 HOST_PAYLOAD_VERSION, u32 pad */
#define HOST_ENTRY_LEN 36   /* u32 fd, u64 its secret, u64 inode, u64 bytes, u64 serial */
#define HOST_PAYLOAD_VERSION 2   /* another layout's payload is refused, never misread */
#define HOST_MAX_ENTRIES 65536

static void hput(unsigned char *at, uint64_t v, int n) {
    for (int i = 0; i < n; i++) at[i] = (unsigned char)(v >> (8 * i));
}
static uint64_t hget(const unsigned char *at, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)at[i] << (8 * i);
    return v;
}

static int host_fd_back(mp_host *h, uintptr_t at, size_t nbytes, int fixed, uintptr_t *out) {
    struct host_fd *f = malloc(sizeof *f);
    if (!f) return MP_ENOMEM;
    int fd = (int)syscall(SYS_memfd_create, "mempool-host", 1u /* MFD_CLOEXEC */);
    struct stat st;
    if (fd < 0 || ftruncate(fd, (off_t)nbytes) != 0 || fstat(fd, &st) != 0) {
        if (fd >= 0) close(fd);
        free(f);
        return MP_ENOMEM;
    }
    void *p = mmap(fixed ? (void *)at : NULL, nbytes, PROT_READ | PROT_WRITE,
                   MAP_SHARED | (fixed ? MAP_FIXED : 0), fd, 0);
    if (p == MAP_FAILED) {
        close(fd);
        free(f);
        return MP_ENOMEM;
    }
    f->fd = fd;
    f->nbytes = nbytes;
    f->ino = (uint64_t)st.st_ino;
    pthread_mutex_lock(&h->mu);
    f->serial = ++h->next_serial;
    int rc = mp_ptrmap_insert(&h->fds, (uintptr_t)p, f);
    pthread_mutex_unlock(&h->mu);
    if (rc != MP_OK) {
        if (fixed) mmap(p, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
        else munmap(p, nbytes);
        close(fd);
        free(f);
        return MP_ENOMEM;
    }
    *out = (uintptr_t)p;
    return MP_OK;
}

static void host_fd_drop(mp_host *h, uintptr_t at, size_t nbytes, int fixed) {
    pthread_mutex_lock(&h->mu);
    struct host_fd *f = mp_ptrmap_remove(&h->fds, at);
    pthread_mutex_unlock(&h->mu);
    /* Back to what it was: a hole in the reservation, or nothing. */
    if (fixed) mmap((void *)at, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    else munmap((void *)at, nbytes);
    if (f) {
        mp_fd_withdraw(f->fd);   /* before the number can name another file */
        close(f->fd);
        free(f);
    }
}

static int host_share(void *ctx, uintptr_t base, size_t nbytes, int expandable,
                      unsigned char *buf, size_t cap, size_t *len) {
    mp_host *h = ctx;
    *len = 0;
    pthread_mutex_lock(&h->mu);
    if (!h->shareable) {
        pthread_mutex_unlock(&h->mu);
        return MP_EUNSUPPORTED;
    }
    size_t k = 0;
    uintptr_t a = base;
    while (a < base + nbytes) {
        struct host_fd *f = mp_ptrmap_get(&h->fds, a);
        if (!f || (!expandable && f->nbytes != nbytes)) break;
        a += f->nbytes;
        k++;
    }
    if (a != base + nbytes || !k) {
        pthread_mutex_unlock(&h->mu);
        return MP_EINVAL;   /* not a segment, nor a run of whole map calls */
    }
    *len = HOST_HEAD_LEN + k * HOST_ENTRY_LEN;
    if (!buf || cap < *len) {
        pthread_mutex_unlock(&h->mu);
        return MP_EINVAL;
    }
    memset(buf, 0, HOST_HEAD_LEN);
    hput(buf, (uint64_t)getpid(), 4);
    hput(buf + 4, k, 4);
    hput(buf + 8, HOST_PAYLOAD_VERSION, 4);
    unsigned char *at = buf + HOST_HEAD_LEN;
    for (a = base; a < base + nbytes; at += HOST_ENTRY_LEN) {
        struct host_fd *f = mp_ptrmap_get(&h->fds, a);
        uint64_t secret = 0;
        if (mp_fd_offer(f->fd, &secret) != MP_OK) {
            pthread_mutex_unlock(&h->mu);
            return MP_ENOMEM;
        }
        hput(at, (uint64_t)f->fd, 4);
        hput(at + 4, secret, 8);
        hput(at + 12, f->ino, 8);
        hput(at + 20, f->nbytes, 8);
        hput(at + 28, f->serial, 8);
        a += f->nbytes;
    }
    pthread_mutex_unlock(&h->mu);
    return MP_OK;
}

static int host_open(void *ctx, const unsigned char *buf, size_t len, size_t nbytes,
                     uintptr_t *out) {
    (void)ctx;
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    if (!buf || len < HOST_HEAD_LEN || !out || !nbytes || nbytes % page) return MP_EINVAL;
    uint64_t pid = hget(buf, 4), k = hget(buf + 4, 4);
    if (hget(buf + 8, 4) != HOST_PAYLOAD_VERSION || hget(buf + 12, 4) || !pid ||
        pid > INT32_MAX || !k || k > HOST_MAX_ENTRIES || len != HOST_HEAD_LEN + k * HOST_ENTRY_LEN)
        return MP_EINVAL;
    uint64_t total = 0;
    for (uint64_t i = 0; i < k; i++) {
        const unsigned char *e = buf + HOST_HEAD_LEN + i * HOST_ENTRY_LEN;
        uint64_t n = hget(e + 20, 8);
        if (!n || n % page || n > nbytes || total + n > nbytes) return MP_EINVAL;
        if (hget(e, 4) > INT32_MAX) return MP_EINVAL;
        total += n;
    }
    if (total != nbytes) return MP_EINVAL;
    void *region = mmap(NULL, nbytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (region == MAP_FAILED) return MP_ENOMEM;
    int rc = MP_OK;
    size_t off = 0;
    for (uint64_t i = 0; i < k && rc == MP_OK; i++) {
        const unsigned char *e = buf + HOST_HEAD_LEN + i * HOST_ENTRY_LEN;
        size_t n = (size_t)hget(e + 20, 8);
        int fd = -1, why = 0;
        rc = mp_fd_take((uint32_t)pid, (int)hget(e, 4), hget(e + 4, 8), &fd, &why);
        if (rc != MP_OK) break;   /* gone, not offered, or neither way allowed */
        struct stat st;
        if (fstat(fd, &st) != 0 || (uint64_t)st.st_ino != hget(e + 12, 8) ||
            !S_ISREG(st.st_mode) || (uint64_t)st.st_size != n)
            rc = MP_EINVAL;   /* another file under that number: not the memory named */
        else if (mmap((char *)region + off, n, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                      fd, 0) == MAP_FAILED)
            rc = MP_ENOMEM;
        close(fd);
        off += n;
    }
    if (rc != MP_OK) {
        munmap(region, nbytes);
        return rc;
    }
    *out = (uintptr_t)region;
    return MP_OK;
}

static int host_close(void *ctx, uintptr_t ptr, size_t nbytes) {
    (void)ctx;
    return munmap((void *)ptr, nbytes) == 0 ? MP_OK : MP_EINVAL;
}

int mp_host_set_shareable(mp_upstream *up, int on) {
    mp_host *h = up->ctx;
    pthread_mutex_lock(&h->mu);
    int rc = h->used ? MP_EBUSY : MP_OK;
    if (rc == MP_OK) h->shareable = on ? 1 : 0;
    pthread_mutex_unlock(&h->mu);
    return rc;
}

static void host_destroy(void *ctx) {
    mp_host *h = ctx;
    mp_ptrmap_destroy(&h->mappings);
    mp_ptrmap_destroy(&h->fds);
    pthread_mutex_destroy(&h->mu);
    free(h);
}

mp_budget *mp_host_budget(void *ctx) { return &((mp_host *)ctx)->budget; }
void mp_host_lock(void *ctx) { pthread_mutex_lock(&((mp_host *)ctx)->mu); }
void mp_host_unlock(void *ctx) { pthread_mutex_unlock(&((mp_host *)ctx)->mu); }

int mp_host_upstream(mp_upstream *up, size_t capacity, size_t granularity) {
    long page = sysconf(_SC_PAGESIZE);
    if (!granularity || granularity % (size_t)page) return MP_EINVAL;
    mp_host *h = calloc(1, sizeof *h);
    if (!h) return MP_ENOMEM;
    if (mp_ptrmap_init(&h->mappings, 64) != MP_OK) {
        free(h);
        return MP_ENOMEM;
    }
    if (mp_ptrmap_init(&h->fds, 64) != MP_OK) {
        mp_ptrmap_destroy(&h->mappings);
        free(h);
        return MP_ENOMEM;
    }
    pthread_mutex_init(&h->mu, NULL);
    mp_budget_init(&h->budget, capacity);
    h->granularity = granularity;
    memset(up, 0, sizeof *up);
    up->ctx = h;
    up->name = "host";
    up->segment_alloc = host_segment_alloc;
    up->segment_free = host_segment_free;
    up->event_create = host_event_create;
    up->event_record = host_event_record;
    up->event_query = host_event_query;
    up->stream_wait_event = host_stream_wait_event;
    up->event_destroy = host_event_destroy;
    up->stream_synchronize = host_stream_synchronize;
    up->stream_query = host_stream_query;
    up->device_synchronize = host_device_synchronize;
    up->mem_info = host_mem_info;
    up->granularity = granularity;
    up->va_reserve = host_va_reserve;
    up->map = host_map;
    up->unmap = host_unmap;
    up->va_release = host_va_release;
    up->share = host_share;
    up->open = host_open;
    up->close = host_close;
    up->destroy = host_destroy;
    return MP_OK;
}
