/* The simulated device (see mp_sim.h). Thread-safe: one mutex guards the whole context,
 * since tests complete streams from Python while other threads allocate. This file is the
 * device model: segments, events, streams and pages. Fault injection and held calls are in
 * mp_sim_faults.c, graph capture in mp_sim_graphs.c, several devices in mp_sim_peers.c. */
#include "mp_sim_internal.h"

#include <stdlib.h>
#include <string.h>

/* Note [Frees the driver keeps]
 * A cudaMemPool frees a segment in stream order (cuMemFreeAsync): until the work queued
 * before the free has run, the memory is the driver's, neither the Pool's nor free for a new
 * allocation of another size. The sim keeps such a segment's bytes as "held" until its
 * stream's work up to the free completes (complete, complete_all, a sync): held_bytes is the
 * device's own count, used_bytes the segments and pages handed out. Kept bytes count
 * against the capacity too: a segment allocation or page map that fits only in them fails
 * as out of memory, as the driver's would. The core's answer is
 * Note [Released before a growth] in core/mp_core.c. */
void sim_drop_completed_kept_locked(mp_sim *s) {
    size_t i = 0;
    while (i < s->nkept) {
        const sim_kept *k = &s->kept[i];
        if (s->streams[k->stream].completed >= k->seq) {
            s->kept_bytes -= k->nbytes;
            s->kept[i] = s->kept[--s->nkept];
        } else {
            i++;
        }
    }
}

/* Note [Frees the driver keeps]: kept bytes are not the device's to hand out, so a request
 * that fits only in them is out of memory (the caller counts the failure). */
static int kept_refuses_locked(mp_sim *s, size_t nbytes) {
    if (!s->nkept) return 0;
    sim_drop_completed_kept_locked(s);
    return s->kept_bytes && s->budget.used + s->kept_bytes + nbytes > s->budget.capacity;
}

static void note_held_locked(mp_sim *s) {
    sim_drop_completed_kept_locked(s);
    size_t held = s->budget.used + s->kept_bytes;
    if (held > s->held_peak) s->held_peak = held;
}

static size_t shash_home(const mp_sim *s, uintptr_t id) {
    return (size_t)(((uint64_t)id * 0x9E3779B97F4A7C15ull) >> 17) & s->shash_mask;
}

/* Index of stream id in the hash, inserting (index) when absent and `insert` is given. */
static size_t *shash_find(mp_sim *s, uintptr_t id) {
    for (size_t h = shash_home(s, id);; h = (h + 1) & s->shash_mask) {
        size_t v = s->shash[h];
        if (!v || s->streams[v - 1].id == id) return &s->shash[h];
    }
}

static int shash_grow(mp_sim *s) {
    size_t cap = s->shash ? 2 * (s->shash_mask + 1) : 64;
    size_t *old = s->shash, old_cap = s->shash ? s->shash_mask + 1 : 0;
    size_t *grown = calloc(cap, sizeof *grown);
    if (!grown) return 0;
    s->shash = grown;
    s->shash_mask = cap - 1;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i]) *shash_find(s, s->streams[old[i] - 1].id) = old[i];
    free(old);
    return 1;
}

/* Backward-shift deletion, so lookups stay short however many streams come and go. */
static void shash_remove(mp_sim *s, size_t *slot) {
    size_t i = (size_t)(slot - s->shash);
    for (size_t j = (i + 1) & s->shash_mask; s->shash[j]; j = (j + 1) & s->shash_mask) {
        size_t home = shash_home(s, s->streams[s->shash[j] - 1].id);
        /* j's entry may move to i when its home is not in (i, j] (cyclically) */
        if (((j - home) & s->shash_mask) >= ((j - i) & s->shash_mask)) {
            s->shash[i] = s->shash[j];
            i = j;
        }
    }
    s->shash[i] = 0;
    s->shash_count--;
}

size_t sim_stream_index(mp_sim *s, uintptr_t id) {
    if ((s->shash_count + 1) * 2 > (s->shash ? s->shash_mask + 1 : 0) && !shash_grow(s))
        return SIZE_MAX;
    size_t *slot = shash_find(s, id);
    if (*slot) return *slot - 1;
    size_t i;
    if (s->nfree_slots) {
        i = s->free_slots[--s->nfree_slots];
        s->streams[i].id = id;   /* counters carried on: see mp_sim_destroy_stream */
    } else {
        if (s->nstreams == s->cap_streams) {
            size_t cap = s->cap_streams ? s->cap_streams * 2 : 8;
            sim_stream *grown = realloc(s->streams, cap * sizeof *grown);
            if (!grown) return SIZE_MAX;
            s->streams = grown;
            s->cap_streams = cap;
        }
        memset(&s->streams[s->nstreams], 0, sizeof(sim_stream));
        s->streams[s->nstreams].id = id;
        i = s->nstreams++;
    }
    *slot = i + 1;
    s->shash_count++;
    return i;
}

/* The live stream of that handle, or NULL: through the hash, since a destroyed stream's slot
 * keeps its old handle until it is reused. */
sim_stream *sim_live_stream(mp_sim *s, uintptr_t stream) {
    if (!s->shash) return NULL;
    size_t *slot = shash_find(s, stream);
    return *slot ? &s->streams[*slot - 1] : NULL;
}

static uintptr_t bump(mp_sim *s, size_t nbytes, size_t align) {
    uintptr_t p = (s->next_addr + align - 1) / align * align;
    s->next_addr = p + nbytes;
    return p;
}

/* On a capturing stream the segment is allocated outside the graph, as the CUDA upstream
 * does with cuMemAlloc (a stream-ordered allocation there would be a graph node): legal,
 * counted in capture_allocs. */
static int sim_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    int plain = s->ncapturing && sim_is_capturing(s, stream);
    if (s->hold_next) sim_hold_locked(s, &s->hold_next);
    int rc;
    if (kept_refuses_locked(s, nbytes)) {
        s->budget.num_failed++;
        rc = MP_ENOMEM;
    } else {
        rc = mp_budget_take(&s->budget, nbytes);
    }
    if (rc == MP_OK) {
        uintptr_t p = bump(s, nbytes, 512);
        if (mp_ptrmap_insert(&s->segments, p, (void *)(uintptr_t)nbytes) != MP_OK) {
            mp_budget_give(&s->budget, nbytes);
            rc = MP_ENOMEM;
        } else {
            s->budget.num_allocs++;
            s->capture_allocs += plain;
            *out = p;
            note_held_locked(s);
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* During a capture a free is refused: on the capturing stream it would be a graph node, and
 * elsewhere (cuMemFree) an unsafe call. */
static int sim_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (s->ncapturing) {
        int rc = sim_capture_violation(s);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    void *v = mp_ptrmap_remove(&s->segments, ptr);
    int rc = MP_OK;
    if (!v || (size_t)(uintptr_t)v != nbytes) {
        s->num_errors++;
        rc = MP_EINVAL;
    } else {
        mp_budget_give(&s->budget, nbytes);
        s->budget.num_frees++;
        /* Note [Frees the driver keeps] (best effort without host memory: not kept) */
        size_t si = sim_stream_index(s, stream);
        if (si != SIZE_MAX && s->streams[si].completed < s->streams[si].submitted) {
            if (s->nkept == s->cap_kept) {
                size_t cap = s->cap_kept ? 2 * s->cap_kept : 8;
                sim_kept *grown = realloc(s->kept, cap * sizeof *grown);
                if (grown) {
                    s->kept = grown;
                    s->cap_kept = cap;
                }
            }
            if (s->nkept < s->cap_kept) {
                s->kept[s->nkept++] = (sim_kept){si, s->streams[si].submitted, nbytes};
                s->kept_bytes += nbytes;
            }
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_event_create(void *ctx, uintptr_t *out) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (s->hold_events_next) sim_hold_locked(s, &s->hold_events_next);
    s->num_creates++;
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
        memset(&s->events[s->nevents++], 0, sizeof(sim_event));
    }
    s->events[i].in_use = 1;
    s->events[i].stream = SIZE_MAX;
    s->events[i].target = 0;
    s->events[i].ndeps = 0;
    s->events[i].captured = 0;
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
    if (s->fail_events) {
        s->fail_events--;
        pthread_mutex_unlock(&s->mu);
        return MP_EUPSTREAM;
    }
    sim_event *e = event_at(s, ev);
    size_t si = sim_stream_index(s, stream);
    int rc = e && si != SIZE_MAX ? MP_OK : MP_EINVAL;
    if (rc == MP_OK) {
        sim_stream *st = &s->streams[si];
        if (e->cap_deps < st->nwaits) {
            sim_dep *grown = realloc(e->deps, st->nwaits * sizeof *grown);
            if (!grown) rc = MP_ENOMEM;
            else {
                e->deps = grown;
                e->cap_deps = st->nwaits;
            }
        }
    }
    if (rc == MP_OK) {
        sim_stream *st = &s->streams[si];
        e->stream = si;
        e->target = st->submitted;
        e->captured = st->capturing;
        e->ndeps = 0;
        for (size_t i = 0; i < st->nwaits; i++) {
            const sim_wait *w = &st->waits[i];
            if (s->streams[w->other].completed >= w->seq) continue;
            /* One dep per stream, its latest: the event completes when that is done. Copying
             * every wait grew the lists without bound while streams never completed. */
            size_t d = 0;
            while (d < e->ndeps && e->deps[d].other != w->other) d++;
            if (d == e->ndeps) e->deps[e->ndeps++] = (sim_dep){w->other, w->seq};
            else if (e->deps[d].seq < w->seq) e->deps[d].seq = w->seq;
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

/* An event recorded during a capture cannot be queried (CUDA_ERROR_CAPTURED_EVENT), and no
 * event can while a capture is under way (an unsafe call). */
static int sim_event_query(void *ctx, uintptr_t ev) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_event *e = event_at(s, ev);
    int rc = !e ? MP_EINVAL : event_done(s, e) ? MP_OK : MP_ENOTREADY;
    if (e && (e->captured || s->ncapturing)) rc = sim_capture_violation(s);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_stream_wait_event(void *ctx, uintptr_t stream, uintptr_t ev) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    sim_event *e = event_at(s, ev);
    size_t si = sim_stream_index(s, stream);
    int rc = e && si != SIZE_MAX ? MP_OK : MP_EINVAL;
    /* Across a capture's edge: a capturing stream waiting on an event from outside
     * (isolation), or a stream outside waiting on a captured event (it would join the
     * capture and leave it unjoined). */
    if (rc == MP_OK && e->captured != s->streams[si].capturing) rc = sim_capture_violation(s);
    s->num_waits += rc == MP_OK;
    if (rc == MP_OK && !event_done(s, e)) {
        /* The stream now waits for the event's work and for what that work waited on. */
        sim_stream *st = &s->streams[si];
        size_t need = st->nwaits + 1 + e->ndeps;
        if (need > st->cap_waits) {
            size_t cap = st->cap_waits ? st->cap_waits * 2 : 4;
            while (cap < need) cap *= 2;
            sim_wait *grown = realloc(st->waits, cap * sizeof *grown);
            if (!grown) rc = MP_ENOMEM;
            else {
                st->waits = grown;
                st->cap_waits = cap;
            }
        }
        /* The wait is an operation in the stream's queue, as cudaStreamWaitEvent's is: a
         * sync of the stream, or an event recorded after it, covers what it waits for. */
        if (rc == MP_OK) st->submitted++;
        for (size_t i = 0; rc == MP_OK && i <= e->ndeps; i++) {
            size_t other = i ? e->deps[i - 1].other : e->stream;
            uint64_t seq = i ? e->deps[i - 1].seq : e->target;
            if (s->streams[other].completed >= seq) continue;
            /* A wait placed earlier for as much of `other` covers this one (it completes
             * with less of this stream's work, and orders as much). */
            size_t k = 0;
            while (k < st->nwaits && !(st->waits[k].other == other && st->waits[k].seq >= seq)) k++;
            if (k < st->nwaits) continue;
            st->waits[st->nwaits].other = other;
            st->waits[st->nwaits].seq = seq;
            st->waits[st->nwaits].at = st->submitted - 1;
            st->nwaits++;
        }
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

static int sim_stream_synchronize(void *ctx, uintptr_t stream) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (s->ncapturing) {   /* a sync during a capture: refused, and it breaks the capture */
        int rc = sim_capture_violation(s);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    if (s->hold_syncs_next) sim_hold_locked(s, &s->hold_syncs_next);
    size_t si = sim_stream_index(s, stream);
    if (si != SIZE_MAX) complete_upto(s, si, s->streams[si].submitted);
    s->num_syncs++;
    pthread_mutex_unlock(&s->mu);
    return si == SIZE_MAX ? MP_ENOMEM : MP_OK;
}

/* Complete when all the stream's queued work is. A wait on an event is queued work of the
 * stream (sim_stream_wait_event), and completing it completes what it waited for. */
static int sim_stream_query(void *ctx, uintptr_t stream) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    s->num_queries++;
    size_t si = sim_stream_index(s, stream);
    int rc = si == SIZE_MAX ? MP_ENOMEM : MP_OK;
    if (rc == MP_OK && s->streams[si].completed < s->streams[si].submitted) rc = MP_ENOTREADY;
    if (s->ncapturing) rc = sim_capture_violation(s);
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_device_synchronize(void *ctx) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (s->ncapturing) {
        int rc = sim_capture_violation(s);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    for (size_t i = 0; i < s->nstreams; i++) complete_upto(s, i, s->streams[i].submitted);
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
    if (s->hold_va_next) sim_hold_locked(s, &s->hold_va_next);
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
    sim_call_delay(&s->map_delay_ns);
    pthread_mutex_lock(&s->mu);
    if (va % g || nbytes % g || !nbytes) {
        s->num_errors++;
        pthread_mutex_unlock(&s->mu);
        return MP_EINVAL;
    }
    if (s->hold_next) sim_hold_locked(s, &s->hold_next);
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
        if (s->budget.used + g > s->budget.capacity || kept_refuses_locked(s, g)) {
            s->budget.num_failed++;
            rc = MP_ENOMEM;
            break;
        }
        if (mp_ptrmap_insert(&s->pages, page, (void *)(uintptr_t)sim_own_access(s)) != MP_OK) {
            rc = MP_ENOMEM;
            break;
        }
        s->budget.used += g;
        if (s->budget.used > s->budget.peak) s->budget.peak = s->budget.used;
    }
    /* One physical allocation for the whole call, as the CUDA upstream makes one handle. */
    if (rc == MP_OK && mp_ptrmap_insert(&s->mappings, va, (void *)(uintptr_t)nbytes) != MP_OK)
        rc = MP_ENOMEM;
    if (rc != MP_OK) unmap_pages(s, va, done);
    else {
        s->budget.num_maps++;
        note_held_locked(s);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

/* Pages are mapped during a capture as PyTorch's expandable segments map them for a graph's
 * pool; an unmap then would pull memory from under the graph (and a real one needs the
 * streams synchronized first): refused. */
static int sim_unmap(void *ctx, uintptr_t va, size_t nbytes) {
    mp_sim *s = ctx;
    sim_call_delay(&s->unmap_delay_ns);
    pthread_mutex_lock(&s->mu);
    if (s->ncapturing) {
        int rc = sim_capture_violation(s);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    /* As the driver: only whole allocations; anything else is a caller bug, refused with
     * nothing changed. */
    if (!nbytes || !mp_mappings_whole(&s->mappings, va, nbytes)) {
        s->num_errors++;
        s->num_split_unmaps++;
        pthread_mutex_unlock(&s->mu);
        return MP_EINVAL;
    }
    mp_mappings_remove(&s->mappings, va, nbytes);
    unmap_pages(s, va, nbytes / s->granularity);
    s->budget.num_unmaps++;
    pthread_mutex_unlock(&s->mu);
    return MP_OK;
}

static int sim_va_release(void *ctx, uintptr_t va, size_t nbytes) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    if (s->ncapturing) {
        int rc = sim_capture_violation(s);
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
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
    mp_ptrmap_destroy(&s->mappings);
    sim_share_destroy(s);
    for (size_t i = 0; i < s->nstreams; i++) {
        free(s->streams[i].waits);
        free(s->streams[i].frontier);
    }
    free(s->streams);
    for (size_t i = 0; i < s->nnodes; i++) free(s->nodes[i].parents);
    free(s->nodes);
    free(s->shash);
    free(s->free_slots);
    for (size_t i = 0; i < s->nevents; i++) free(s->events[i].deps);
    free(s->events);
    free(s->kept);
    pthread_cond_destroy(&s->hold_cv);
    pthread_mutex_destroy(&s->mu);
    free(s);
}

int mp_sim_upstream(mp_upstream *up, size_t capacity, size_t granularity) {
    if (!granularity || granularity % 512) return MP_EINVAL;
    mp_sim *s = calloc(1, sizeof *s);
    if (!s) return MP_ENOMEM;
    if (mp_ptrmap_init(&s->segments, 256) || mp_ptrmap_init(&s->reservations, 16) ||
        mp_ptrmap_init(&s->pages, 256) || mp_ptrmap_init(&s->mappings, 64)) {
        mp_ptrmap_destroy(&s->segments);
        mp_ptrmap_destroy(&s->reservations);
        mp_ptrmap_destroy(&s->pages);
        free(s);
        return MP_ENOMEM;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->hold_cv, NULL);
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
    up->stream_query = sim_stream_query;
    up->device_synchronize = sim_device_synchronize;
    up->stream_capturing = sim_stream_capturing;
    up->capture_frontier = sim_capture_frontier;
    up->capture_follows = sim_capture_follows;
    up->mem_info = sim_mem_info;
    up->granularity = granularity;
    up->va_reserve = sim_va_reserve;
    up->map = sim_map;
    up->unmap = sim_unmap;
    up->va_release = sim_va_release;
    up->destroy = sim_destroy;
    if (sim_share_init(s, up) != MP_OK) {
        sim_destroy(s);
        memset(up, 0, sizeof *up);
        return MP_ENOMEM;
    }
    return MP_OK;
}

/* The free-slot list with room for one more, or NULL (the list unchanged). */
static size_t *realloc_slots(mp_sim *s) {
    size_t cap = s->cap_free_slots ? 2 * s->cap_free_slots : 16;
    size_t *grown = realloc(s->free_slots, cap * sizeof *grown);
    if (grown) s->cap_free_slots = cap;
    return grown;
}

uint64_t mp_sim_launch(mp_sim *s, uintptr_t stream) {
    pthread_mutex_lock(&s->mu);
    size_t si = sim_stream_index(s, stream);
    uint64_t seq = si == SIZE_MAX ? 0 : ++s->streams[si].submitted;
    if (si != SIZE_MAX && s->streams[si].capturing)
        sim_capture_node(s, si);   /* Note [Sim capture graphs] */
    pthread_mutex_unlock(&s->mu);
    return seq;
}

void mp_sim_complete(mp_sim *s, uintptr_t stream) {
    pthread_mutex_lock(&s->mu);
    size_t si = sim_stream_index(s, stream);
    if (si != SIZE_MAX) complete_upto(s, si, s->streams[si].submitted);
    pthread_mutex_unlock(&s->mu);
}

void mp_sim_complete_all(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    for (size_t i = 0; i < s->nstreams; i++) complete_upto(s, i, s->streams[i].submitted);
    pthread_mutex_unlock(&s->mu);
}

int mp_sim_ordered(mp_sim *s, uintptr_t stream, uintptr_t other, uint64_t seq) {
    pthread_mutex_lock(&s->mu);
    size_t si = sim_stream_index(s, stream), oi = sim_stream_index(s, other);
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
    size_t si = sim_stream_index(s, stream);
    *submitted = si == SIZE_MAX ? 0 : s->streams[si].submitted;
    *completed = si == SIZE_MAX ? 0 : s->streams[si].completed;
    pthread_mutex_unlock(&s->mu);
}

int mp_sim_destroy_stream(mp_sim *s, uintptr_t stream) {
    pthread_mutex_lock(&s->mu);
    size_t *slot = s->shash ? shash_find(s, stream) : NULL;
    int rc = MP_EINVAL;
    if (slot && *slot) {
        size_t i = *slot - 1;
        rc = MP_ENOMEM;
        if (s->nfree_slots == s->cap_free_slots) {
            size_t *grown = realloc_slots(s);
            if (grown) s->free_slots = grown;
        }
        if (s->nfree_slots < s->cap_free_slots) {
            /* Its queued work runs to the end, as after cudaStreamDestroy; the counters
             * stay with the slot, so events recorded on it stay complete when it is reused. */
            complete_upto(s, i, s->streams[i].submitted);
            s->streams[i].nwaits = 0;
            if (s->streams[i].capturing) {   /* a destroyed stream's capture ends with it */
                s->streams[i].capturing = 0;
                s->streams[i].broken = 0;
                s->ncapturing--;
            }
            shash_remove(s, slot);
            s->free_slots[s->nfree_slots++] = i;
            rc = MP_OK;
        }
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

size_t mp_sim_num_streams(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    size_t n = s->shash_count;
    pthread_mutex_unlock(&s->mu);
    return n;
}
