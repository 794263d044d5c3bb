/* The simulated device (see mp_sim.h). Thread-safe: one mutex guards the whole context,
 * since tests complete streams from Python while other threads allocate. */
#include "mp_sim.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mp_ptrmap.h"

typedef struct sim_wait {
    size_t other;    /* index into streams */
    uint64_t seq;    /* work of `other` up to here ... */
    uint64_t at;     /* ... comes before this stream's work after position `at` */
} sim_wait;

typedef struct sim_stream {
    uintptr_t id;
    uint64_t submitted, completed;
    sim_wait *waits;
    size_t nwaits, cap_waits;
} sim_stream;

typedef struct sim_event {
    size_t stream;   /* index into streams, SIZE_MAX until recorded */
    uint64_t target;
    int in_use;
    /* What the stream waited for before the record: an event covers that too, as a CUDA
     * event recorded after cudaStreamWaitEvent does. */
    sim_wait *deps;
    size_t ndeps, cap_deps;
} sim_event;

static int push_wait(sim_wait **arr, size_t *n, size_t *cap, size_t other, uint64_t seq,
                     uint64_t at) {
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 4;
        sim_wait *grown = realloc(*arr, ncap * sizeof *grown);
        if (!grown) return MP_ENOMEM;
        *arr = grown;
        *cap = ncap;
    }
    (*arr)[*n].other = other;
    (*arr)[*n].seq = seq;
    (*arr)[*n].at = at;
    (*n)++;
    return MP_OK;
}

struct mp_sim {
    pthread_mutex_t mu;
    mp_budget budget;
    size_t granularity;
    uintptr_t next_addr;
    mp_ptrmap segments;       /* ptr -> size */
    mp_ptrmap reservations;   /* va -> size */
    mp_ptrmap pages;          /* mapped page address -> 1 */
    sim_stream *streams;
    size_t nstreams, cap_streams;
    sim_event *events;
    size_t nevents, cap_events, live_events;
    uint64_t num_syncs, num_records, num_waits, num_errors;
};

static size_t stream_index(mp_sim *s, uintptr_t id) {
    for (size_t i = 0; i < s->nstreams; i++)
        if (s->streams[i].id == id) return i;
    if (s->nstreams == s->cap_streams) {
        size_t cap = s->cap_streams ? s->cap_streams * 2 : 8;
        sim_stream *grown = realloc(s->streams, cap * sizeof *grown);
        if (!grown) return SIZE_MAX;
        s->streams = grown;
        s->cap_streams = cap;
    }
    memset(&s->streams[s->nstreams], 0, sizeof(sim_stream));
    s->streams[s->nstreams].id = id;
    return s->nstreams++;
}

static uintptr_t bump(mp_sim *s, size_t nbytes, size_t align) {
    uintptr_t p = (s->next_addr + align - 1) / align * align;
    s->next_addr = p + nbytes;
    return p;
}

/* ---------------------------------------------------------------- upstream functions */

static int sim_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_sim *s = ctx;
    (void)stream;
    pthread_mutex_lock(&s->mu);
    int rc = mp_budget_take(&s->budget, nbytes);
    if (rc == MP_OK) {
        uintptr_t p = bump(s, nbytes, 512);
        if (mp_ptrmap_insert(&s->segments, p, (void *)(uintptr_t)nbytes) != MP_OK) {
            mp_budget_give(&s->budget, nbytes);
            rc = MP_ENOMEM;
        } else {
            s->budget.num_allocs++;
            *out = p;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    mp_sim *s = ctx;
    (void)stream;
    pthread_mutex_lock(&s->mu);
    void *v = mp_ptrmap_remove(&s->segments, ptr);
    int rc = MP_OK;
    if (!v || (size_t)(uintptr_t)v != nbytes) {
        s->num_errors++;
        rc = MP_EINVAL;
    } else {
        mp_budget_give(&s->budget, nbytes);
        s->budget.num_frees++;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_event_create(void *ctx, uintptr_t *out) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    size_t i = 0;
    while (i < s->nevents && s->events[i].in_use) i++;
    if (i == s->nevents) {
        if (s->nevents == s->cap_events) {
            size_t cap = s->cap_events ? s->cap_events * 2 : 16;
            sim_event *grown = realloc(s->events, cap * sizeof *grown);
            if (!grown) {
                pthread_mutex_unlock(&s->mu);
                return MP_ENOMEM;
            }
            s->events = grown;
            s->cap_events = cap;
        }
        s->events[s->nevents].deps = NULL;
        s->events[s->nevents].cap_deps = 0;
        s->nevents++;
    }
    s->events[i].in_use = 1;
    s->events[i].ndeps = 0;
    s->events[i].stream = SIZE_MAX;
    s->events[i].target = 0;
    s->live_events++;
    *out = i + 1;
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

static sim_event *event_at(mp_sim *s, uintptr_t ev) {
    if (ev == 0 || ev > s->nevents || !s->events[ev - 1].in_use) {
        s->num_errors++;
        return NULL;
    }
    return &s->events[ev - 1];
}

static int sim_event_record(void *ctx, uintptr_t ev, uintptr_t stream) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_event *e = event_at(s, ev);
    size_t si = stream_index(s, stream);
    int rc = e && si != SIZE_MAX ? MP_OK : MP_EINVAL;
    if (rc == MP_OK) {
        e->stream = si;
        e->target = s->streams[si].submitted;
        e->ndeps = 0;
        sim_stream *st = &s->streams[si];
        for (size_t i = 0; i < st->nwaits && rc == MP_OK; i++) {
            sim_wait w = st->waits[i];
            if (s->streams[w.other].completed < w.seq)
                rc = push_wait(&e->deps, &e->ndeps, &e->cap_deps, w.other, w.seq, 0);
        }
        s->num_records++;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int event_done(mp_sim *s, const sim_event *e) {
    if (e->stream == SIZE_MAX) return 1;
    if (s->streams[e->stream].completed < e->target) return 0;
    for (size_t i = 0; i < e->ndeps; i++)
        if (s->streams[e->deps[i].other].completed < e->deps[i].seq) return 0;
    return 1;
}

static int sim_event_query(void *ctx, uintptr_t ev) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_event *e = event_at(s, ev);
    int rc = !e ? MP_EINVAL : event_done(s, e) ? MP_OK : MP_ENOTREADY;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_stream_wait_event(void *ctx, uintptr_t stream, uintptr_t ev) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_event *e = event_at(s, ev);
    size_t si = stream_index(s, stream);
    int rc = e && si != SIZE_MAX ? MP_OK : MP_EINVAL;
    s->num_waits += rc == MP_OK;
    if (rc == MP_OK && !event_done(s, e)) {
        /* Waiting on an event is waiting on everything the event covers: flattened here so
         * that ordered() needs no recursion. */
        sim_stream *st = &s->streams[si];
        rc = push_wait(&st->waits, &st->nwaits, &st->cap_waits, e->stream, e->target, st->submitted);
        for (size_t i = 0; i < e->ndeps && rc == MP_OK; i++)
            rc = push_wait(&st->waits, &st->nwaits, &st->cap_waits, e->deps[i].other,
                           e->deps[i].seq, st->submitted);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_event_destroy(void *ctx, uintptr_t ev) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_event *e = event_at(s, ev);
    if (e) {
        e->in_use = 0;
        s->live_events--;
    }
    pthread_mutex_unlock(&s->mu);
    return e ? MP_OK : MP_EINVAL;
}

/* Completing a stream's work completes what that work waited for: it could not finish
 * before. Waits placed after the completed work stay. */
static void complete_upto(mp_sim *s, size_t si, uint64_t seq) {
    sim_stream *st = &s->streams[si];
    if (st->completed >= seq) return;
    st->completed = seq;
    size_t i = 0;
    while (i < st->nwaits) {
        sim_wait w = st->waits[i];
        if (w.at >= seq) {
            i++;
            continue;
        }
        st->waits[i] = st->waits[--st->nwaits];
        complete_upto(s, w.other, w.seq);
        st = &s->streams[si];
    }
}

/* Everything queued on a stream so far, waits issued after its last launch included: what
 * a stream sync waits for (complete_upto(submitted) leaves those trailing waits). */
static void drain(mp_sim *s, size_t si) {
    complete_upto(s, si, s->streams[si].submitted);
    while (s->streams[si].nwaits) {
        sim_stream *st = &s->streams[si];
        sim_wait w = st->waits[--st->nwaits];
        complete_upto(s, w.other, w.seq);
    }
}

static int sim_stream_synchronize(void *ctx, uintptr_t stream) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    size_t si = stream_index(s, stream);
    if (si != SIZE_MAX) drain(s, si);
    s->num_syncs++;
    pthread_mutex_unlock(&s->mu);
    return si == SIZE_MAX ? MP_ENOMEM : MP_OK;
}

static int sim_device_synchronize(void *ctx) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->nstreams; i++) drain(s, i);
    s->num_syncs++;
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

static int sim_mem_info(void *ctx, size_t *free_bytes, size_t *total) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    *total = s->budget.capacity;
    *free_bytes = s->budget.capacity - s->budget.used;
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

static int sim_va_reserve(void *ctx, size_t nbytes, uintptr_t *out) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    uintptr_t va = bump(s, nbytes, s->granularity);
    int rc = mp_ptrmap_insert(&s->reservations, va, (void *)(uintptr_t)nbytes);
    if (rc == MP_OK) *out = va;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static void unmap_pages(mp_sim *s, uintptr_t va, size_t npages) {
    for (size_t i = 0; i < npages; i++) {
        if (!mp_ptrmap_remove(&s->pages, va + i * s->granularity)) s->num_errors++;
        else mp_budget_give(&s->budget, s->granularity);
    }
}

static int sim_map(void *ctx, uintptr_t va, size_t nbytes) {
    mp_sim *s = ctx;
    size_t g = s->granularity;
    pthread_mutex_lock(&s->mu);
    if (va % g || nbytes % g || !nbytes) {
        s->num_errors++;
        pthread_mutex_unlock(&s->mu);
        return MP_EINVAL;
    }
    int rc = MP_OK;
    if (s->budget.fail_next) {
        s->budget.fail_next--;
        s->budget.num_failed++;
        rc = MP_ENOMEM;
    }
    size_t done = 0, npages = nbytes / g;
    int64_t fail_after = s->budget.fail_map_after;
    s->budget.fail_map_after = -1;
    /* Page by page, as a driver maps physical chunks; a failure part-way undoes the rest. */
    for (; rc == MP_OK && done < npages; done++) {
        if (fail_after >= 0 && (int64_t)done == fail_after) {
            s->budget.num_failed++;
            rc = MP_ENOMEM;
            break;
        }
        uintptr_t page = va + done * g;
        if (mp_ptrmap_get(&s->pages, page)) {
            s->num_errors++;   /* mapping a mapped page is a caller bug */
            rc = MP_EINVAL;
            break;
        }
        if (s->budget.used + g > s->budget.capacity) {
            s->budget.num_failed++;
            rc = MP_ENOMEM;
            break;
        }
        if (mp_ptrmap_insert(&s->pages, page, (void *)1) != MP_OK) {
            rc = MP_ENOMEM;
            break;
        }
        s->budget.used += g;
        if (s->budget.used > s->budget.peak) s->budget.peak = s->budget.used;
    }
    if (rc != MP_OK) unmap_pages(s, va, done);
    else s->budget.num_maps++;
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_unmap(void *ctx, uintptr_t va, size_t nbytes) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    unmap_pages(s, va, nbytes / s->granularity);
    s->budget.num_unmaps++;
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

static int sim_va_release(void *ctx, uintptr_t va, size_t nbytes) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    void *v = mp_ptrmap_remove(&s->reservations, va);
    if (!v || (size_t)(uintptr_t)v != nbytes) s->num_errors++;
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

static void sim_destroy(void *ctx) {
    mp_sim *s = ctx;
    mp_ptrmap_destroy(&s->segments);
    mp_ptrmap_destroy(&s->reservations);
    mp_ptrmap_destroy(&s->pages);
    for (size_t i = 0; i < s->nstreams; i++) free(s->streams[i].waits);
    free(s->streams);
    for (size_t i = 0; i < s->nevents; i++) free(s->events[i].deps);
    free(s->events);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int mp_sim_upstream(mp_upstream *up, size_t capacity, size_t granularity) {
    if (!granularity || granularity % 512) return MP_EINVAL;
    mp_sim *s = calloc(1, sizeof *s);
    if (!s) return MP_ENOMEM;
    if (mp_ptrmap_init(&s->segments, 256) || mp_ptrmap_init(&s->reservations, 16) ||
        mp_ptrmap_init(&s->pages, 256)) {
        mp_ptrmap_destroy(&s->segments);
        mp_ptrmap_destroy(&s->reservations);
        free(s);
        return MP_ENOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    mp_budget_init(&s->budget, capacity);
    s->granularity = granularity;
    s->next_addr = MP_SIM_BASE;
    memset(up, 0, sizeof *up);
    up->ctx = s;
    up->name = "sim";
    up->segment_alloc = sim_segment_alloc;
    up->segment_free = sim_segment_free;
    up->event_create = sim_event_create;
    up->event_record = sim_event_record;
    up->event_query = sim_event_query;
    up->stream_wait_event = sim_stream_wait_event;
    up->event_destroy = sim_event_destroy;
    up->stream_synchronize = sim_stream_synchronize;
    up->device_synchronize = sim_device_synchronize;
    up->mem_info = sim_mem_info;
    up->granularity = granularity;
    up->va_reserve = sim_va_reserve;
    up->map = sim_map;
    up->unmap = sim_unmap;
    up->va_release = sim_va_release;
    up->destroy = sim_destroy;
    return MP_OK;
}

/* ---------------------------------------------------------------- test controls */

uint64_t mp_sim_launch(mp_sim *s, uintptr_t stream) {
    pthread_mutex_lock(&s->mu);
    size_t si = stream_index(s, stream);
    uint64_t seq = si == SIZE_MAX ? 0 : ++s->streams[si].submitted;
    pthread_mutex_unlock(&s->mu);
    return seq;
}

void mp_sim_complete(mp_sim *s, uintptr_t stream) {
    pthread_mutex_lock(&s->mu);
    size_t si = stream_index(s, stream);
    if (si != SIZE_MAX) drain(s, si);
    pthread_mutex_unlock(&s->mu);
}

void mp_sim_complete_all(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->nstreams; i++) drain(s, i);
    pthread_mutex_unlock(&s->mu);
}

int mp_sim_ordered(mp_sim *s, uintptr_t stream, uintptr_t other, uint64_t seq) {
    pthread_mutex_lock(&s->mu);
    size_t si = stream_index(s, stream), oi = stream_index(s, other);
    int ok = 0;
    if (si != SIZE_MAX && oi != SIZE_MAX) {
        ok = s->streams[oi].completed >= seq || si == oi;
        for (size_t i = 0; i < s->streams[si].nwaits && !ok; i++)
            ok = s->streams[si].waits[i].other == oi && s->streams[si].waits[i].seq >= seq;
    }
    pthread_mutex_unlock(&s->mu);
    return ok;
}

void mp_sim_stream_info(mp_sim *s, uintptr_t stream, uint64_t *submitted, uint64_t *completed) {
    pthread_mutex_lock(&s->mu);
    size_t si = stream_index(s, stream);
    *submitted = si == SIZE_MAX ? 0 : s->streams[si].submitted;
    *completed = si == SIZE_MAX ? 0 : s->streams[si].completed;
    pthread_mutex_unlock(&s->mu);
}

mp_budget *mp_sim_budget(mp_sim *s) { return &s->budget; }
void mp_sim_lock(mp_sim *s) { pthread_mutex_lock(&s->mu); }
void mp_sim_unlock(mp_sim *s) { pthread_mutex_unlock(&s->mu); }
size_t mp_sim_live_segments(mp_sim *s) { return s->segments.count; }
size_t mp_sim_mapped_bytes(mp_sim *s) { return s->pages.count * s->granularity; }
uint64_t mp_sim_num_syncs(mp_sim *s) { return s->num_syncs; }
uint64_t mp_sim_num_event_records(mp_sim *s) { return s->num_records; }
uint64_t mp_sim_num_waits(mp_sim *s) { return s->num_waits; }
uint64_t mp_sim_num_errors(mp_sim *s) { return s->num_errors; }
size_t mp_sim_live_events(mp_sim *s) { return s->live_events; }
