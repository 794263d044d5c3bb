/* The pool's table of streams (Note [Streams without end]): lookup by handle, the list of
 * streams that may hold blocks, and the sweep of idle ones. Every function expects the pool
 * lock. */
#include <stdlib.h>

#include "mp_stream.h"

/* Note [Streams without end]
 * A program may use streams without end and never call forget_stream (a stream per request,
 * record_stream onto fresh streams, a replay of a long trace). Each stream the pool sees has
 * a struct (its free lists' heads by class, 27 KB), and every operation that walked the
 * streams (the lookup of a handle, cross-stream reuse, folding hot blocks in) slowed with
 * their number: 30,000 streams held 798 MiB and cost about 1 ms an operation. So:
 * - a handle is found through a hash table (`stab`, open addressing keyed by handle), and
 *   `streams` keeps each struct's place (mp_stream.index) for an O(1) removal;
 * - the walks over other streams' blocks go over `holding` only: the streams that got a
 *   free or hot block since a walk last found them empty (linked when they get one, taken
 *   out lazily by the walk that finds nothing there);
 * - the pool forgets idle streams on its own: when a new handle would take the count of
 *   streams to `sweep_at`, one pass over the segments marks every stream that a block, a
 *   recorded use or a segment names, and every stream with a free or hot block, a growing
 *   expandable range or a capture under way is kept; the others (no block, no pending
 *   free, nothing cached) are freed, as forget_stream would, with nothing to hand over or
 *   wait for. sweep_at is then twice the streams kept, and at least MP_STREAM_SWEEP_MIN, so
 *   the pass costs O(blocks / MP_STREAM_SWEEP_MIN) per new stream at most and the structs
 *   kept are bounded by the streams that hold something. A sweep is made only while no
 *   operation has the lock dropped (they may hold stream pointers: Note [Forgotten
 *   streams]) and never for handle 0 (the callers that look up the legacy stream hold
 *   other streams' pointers meanwhile), and forget_stream of a swept handle is a no-op.
 * tests/core/test_stream_records.py checks the structure (streams kept after 20,000 idle ones);
 * mempool/bench/test_stream_churn.py measures the time and memory per stream. */

#define MP_STREAM_SWEEP_MIN 64

static size_t stab_slot(const mp_pool *p, uintptr_t handle) {
    uint64_t x = (uint64_t)handle * 0x9E3779B97F4A7C15ull;
    return (size_t)(x ^ (x >> 31)) & p->stab_mask;
}

mp_stream *mp_stream_find_locked(const mp_pool *p, uintptr_t handle) {
    if (!p->stab) return NULL;
    for (size_t i = stab_slot(p, handle);; i = (i + 1) & p->stab_mask) {
        mp_stream *s = p->stab[i];
        if (!s || s->handle == handle) return s;
    }
}

static void stab_put(mp_pool *p, mp_stream *s) {
    size_t i = stab_slot(p, s->handle);
    while (p->stab[i]) i = (i + 1) & p->stab_mask;
    p->stab[i] = s;
}

/* Room for one more stream at a load of at most one half (MP_ENOMEM: unchanged). */
static int stab_reserve(mp_pool *p) {
    if (p->stab && (p->nstreams + 1) * 2 <= p->stab_mask + 1) return MP_OK;
    size_t cap = p->stab ? (p->stab_mask + 1) * 2 : 16;
    while ((p->nstreams + 1) * 2 > cap) cap *= 2;
    mp_stream **grown = calloc(cap, sizeof *grown);
    if (!grown) return MP_ENOMEM;
    free(p->stab);
    p->stab = grown;
    p->stab_mask = cap - 1;
    for (size_t i = 0; i < p->nstreams; i++) stab_put(p, p->streams[i]);
    return MP_OK;
}

/* Backward-shift deletion: no tombstones, so probes stay short however many come and go. */
static void stab_remove(mp_pool *p, const mp_stream *s) {
    size_t i = stab_slot(p, s->handle);
    while (p->stab[i] != s) i = (i + 1) & p->stab_mask;
    for (size_t j = (i + 1) & p->stab_mask; p->stab[j]; j = (j + 1) & p->stab_mask) {
        size_t home = stab_slot(p, p->stab[j]->handle);
        /* j's entry may fill the hole at i when its home is not in (i, j] cyclically */
        if (((j - home) & p->stab_mask) >= ((j - i) & p->stab_mask)) {
            p->stab[i] = p->stab[j];
            i = j;
        }
    }
    p->stab[i] = NULL;
}

void mp_stream_hold_locked(mp_pool *p, mp_stream *s) {
    s->holding = 1;
    s->hprev = NULL;
    s->hnext = p->holding;
    if (p->holding) p->holding->hprev = s;
    p->holding = s;
}

void mp_stream_unhold_locked(mp_pool *p, mp_stream *s) {
    if (!s->holding) return;
    if (s->hprev) s->hprev->hnext = s->hnext;
    else p->holding = s->hnext;
    if (s->hnext) s->hnext->hprev = s->hprev;
    s->hprev = s->hnext = NULL;
    s->holding = 0;
}

int mp_stream_holds(const mp_stream *s) {
    return s->hot || s->lists[KIND_SMALL].count || s->lists[KIND_LARGE].count;
}

/* Take s out of the table and of `streams` (not freed). */
void mp_stream_remove_locked(mp_pool *p, mp_stream *s) {
    stab_remove(p, s);
    mp_stream *last = p->streams[--p->nstreams];
    p->streams[s->index] = last;
    last->index = s->index;
    s->index = MP_STREAM_DEAD;
    if (p->last_stream == s) p->last_stream = NULL;
}

static void sweep_idle_streams_locked(mp_pool *p) {
    for (size_t i = 0; i < p->nstreams; i++) p->streams[i]->mark = 0;
    for (mp_segment *seg = p->segments; seg; seg = seg->next) {
        if (seg->stream) seg->stream->mark = 1;
        for (mp_block *b = seg->first; b; b = b->next) {
            if (b->stream) b->stream->mark = 1;
            for (uint16_t k = 0; k < b->nuses; k++) b->uses[k]->mark = 1;
        }
    }
    for (size_t i = p->nstreams; i-- > 0;) {
        mp_stream *s = p->streams[i];
        if (s->mark || mp_stream_holds(s) || s->expandable[KIND_SMALL] ||
            s->expandable[KIND_LARGE] || s->handle == 0 || s == p->capture_seen)
            continue;
        mp_stream_remove_locked(p, s);
        mp_stream_unhold_locked(p, s);
        free(s);
    }
    p->sweep_at = 2 * p->nstreams > MP_STREAM_SWEEP_MIN ? 2 * p->nstreams : MP_STREAM_SWEEP_MIN;
}

mp_stream *mp_stream_lookup_locked(mp_pool *p, uintptr_t handle) {
    mp_stream *s = mp_stream_find_locked(p, handle);
    if (s) return p->last_stream = s;
    if (handle && p->nstreams + 1 >= p->sweep_at && !p->nunlocked) sweep_idle_streams_locked(p);
    if (p->nstreams == p->cap_streams) {
        size_t cap = p->cap_streams ? p->cap_streams * 2 : 8;
        mp_stream **grown = realloc(p->streams, cap * sizeof *grown);
        if (!grown) return NULL;
        p->streams = grown;
        p->cap_streams = cap;
    }
    if (stab_reserve(p) != MP_OK) return NULL;
    s = mp_calloc_lines(sizeof *s);
    if (!s) return NULL;
    s->handle = handle;
    s->index = (uint32_t)p->nstreams;
    p->streams[p->nstreams++] = s;
    stab_put(p, s);
    return p->last_stream = s;
}

