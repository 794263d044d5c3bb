/* The host upstream: real host memory, streams that are always complete. The bytes are
 * real, so tests fill and verify them, and NumPy can read them through DLPack (kDLCPU).
 * Expandable segments map pages of a PROT_NONE reservation read-write. */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "mp_budget.h"
#include "mp_upstream.h"

typedef struct mp_host {
    pthread_mutex_t mu;
    mp_budget budget;
    size_t granularity;
    uintptr_t next_event;
    mp_ptrmap mappings;   /* one per map call, unmapped only whole (mp_mappings_whole) */
} mp_host;

static int host_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_host *h = ctx;
    (void)stream;
    pthread_mutex_lock(&h->mu);
    int rc = mp_budget_take(&h->budget, nbytes);
    pthread_mutex_unlock(&h->mu);
    if (rc != MP_OK) return rc;
    void *p = NULL;
    if (posix_memalign(&p, 4096, nbytes) != 0) {
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
    free((void *)ptr);
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
    pthread_mutex_unlock(&h->mu);
    if (rc != MP_OK) return rc;
    /* Page by page, as the sim and the driver map; a failure part-way undoes the pages
     * already mapped, so the map is all or nothing. */
    for (; done < npages; done++) {
        if ((fail_after >= 0 && (int64_t)done == fail_after) ||
            mprotect((void *)(va + done * g), g, PROT_READ | PROT_WRITE) != 0) {
            rc = MP_ENOMEM;
            break;
        }
    }
    if (rc != MP_OK && done) {
        madvise((void *)va, done * g, MADV_DONTNEED);
        mprotect((void *)va, done * g, PROT_NONE);
    }
    pthread_mutex_lock(&h->mu);
    if (rc == MP_OK && mp_ptrmap_insert(&h->mappings, va, (void *)(uintptr_t)nbytes) != MP_OK) {
        rc = MP_ENOMEM;
        madvise((void *)va, nbytes, MADV_DONTNEED);
        mprotect((void *)va, nbytes, PROT_NONE);
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
    madvise((void *)va, nbytes, MADV_DONTNEED);   /* drop the pages themselves */
    mprotect((void *)va, nbytes, PROT_NONE);
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

static void host_destroy(void *ctx) {
    mp_host *h = ctx;
    mp_ptrmap_destroy(&h->mappings);
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
    up->destroy = host_destroy;
    return MP_OK;
}
