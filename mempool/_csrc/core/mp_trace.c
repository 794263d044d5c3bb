/* Trace recording: a ring of the last N events, copied out on request. Off by default:
 * then the only cost on the allocate/free path is the NULL check in mp_trace_locked. */
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mp_internal.h"

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Note [A ring that grows]
 * record_history(max_entries=N), as PyTorch's _record_memory_history, takes N to be how much
 * history to keep, often a generous bound: the ring does not allocate N entries at once (a
 * million entries are 40 MB; a careless N, a request the host refuses or, under a sanitizer,
 * an abort) but starts small and doubles while it fills, up to N. It only grows while it
 * has not wrapped, so its entries stay in order from index 0 and realloc keeps them. When
 * the host refuses a doubling, the ring keeps what it has and wraps from there: it records
 * fewer events than asked, never none. */
#define MP_TRACE_FIRST 1024

static void grow_ring_locked(mp_pool *p) {
    size_t want = p->trace_cap * 2;
    if (want < MP_TRACE_FIRST) want = MP_TRACE_FIRST;
    if (want > p->trace_max) want = p->trace_max;
    mp_trace_entry *bigger = realloc(p->trace, want * sizeof *bigger);
    if (!bigger) {
        p->trace_max = p->trace_cap;   /* wrap within what there is */
        return;
    }
    p->trace = bigger;
    p->trace_cap = want;
}

void mp_trace_record_locked(mp_pool *p, int action, uintptr_t ptr, size_t nbytes,
                            uintptr_t stream) {
    /* As in PyTorch's trace, an OOM entry carries the bytes the device reports free where
     * other entries carry an address (the caller passes 0). A short upstream call, made only
     * while recording and only on an OOM. */
    if (action == MP_TRACE_OOM) {
        size_t free_bytes = 0, total = 0;
        if (p->up.mem_info && p->up.mem_info(p->up.ctx, &free_bytes, &total) == MP_OK) ptr = free_bytes;
    }
    if (p->trace_len == p->trace_cap && p->trace_cap < p->trace_max) grow_ring_locked(p);
    /* head < cap and len <= cap: one compare wraps the index, no division on the path. */
    size_t i = p->trace_head + p->trace_len;
    if (i >= p->trace_cap) i -= p->trace_cap;
    mp_trace_entry *e = &p->trace[i];
    if (p->trace_len < p->trace_cap) p->trace_len++;
    else if (++p->trace_head == p->trace_cap) p->trace_head = 0;
    e->action = action;
    e->ptr = ptr;
    e->nbytes = nbytes;
    e->stream = stream;
    e->time_ns = now_ns();
}

mp_segment_observer mp_observer_fn;
void *mp_observer_ctx;

void mp_set_segment_observer(mp_segment_observer fn, void *ctx) {
    /* The context first: a reader that sees the new function sees its context. */
    mp_observer_ctx = ctx;
    __atomic_store_n(&mp_observer_fn, fn, __ATOMIC_RELEASE);
}

mp_release_observer mp_release_observer_fn;
void *mp_release_observer_ctx;

void mp_set_release_observer(mp_release_observer fn, void *ctx) {
    mp_release_observer_ctx = ctx;   /* as mp_set_segment_observer: the context first */
    __atomic_store_n(&mp_release_observer_fn, fn, __ATOMIC_RELEASE);
}

int mp_trace_enable(mp_pool *p, size_t max_entries) {
    mp_trace_entry *ring = NULL;
    /* A count whose ring would not fit in size_t must not wrap into a small buffer. */
    if (max_entries > SIZE_MAX / sizeof *ring) return MP_ENOMEM;
    size_t first = max_entries < MP_TRACE_FIRST ? max_entries : MP_TRACE_FIRST;
    if (first && !(ring = malloc(first * sizeof *ring))) return MP_ENOMEM;
    mp_lock_acquire(&p->lock);
    mp_trace_entry *old = p->trace;
    p->trace = ring;
    p->trace_cap = first;   /* Note [A ring that grows] */
    p->trace_max = max_entries;
    p->trace_len = p->trace_head = 0;
    mp_lock_release(&p->lock);
    free(old);
    return MP_OK;
}

int mp_trace_take(mp_pool *p, mp_trace_entry **entries, size_t *n) {
    *entries = NULL;
    *n = 0;
    mp_lock_acquire(&p->lock);
    size_t len = p->trace_len;
    mp_trace_entry *copy = len ? malloc(len * sizeof *copy) : NULL;
    if (len && !copy) {
        mp_lock_release(&p->lock);
        return MP_ENOMEM;
    }
    for (size_t i = 0; i < len; i++) copy[i] = p->trace[(p->trace_head + i) % p->trace_cap];
    mp_lock_release(&p->lock);
    *entries = copy;
    *n = len;
    return MP_OK;
}
