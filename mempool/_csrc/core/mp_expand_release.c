/* Expandable segments' release (Note [Expandable segments] in mp_expand.c): whole physical
 * allocations unmapped inside runs of free blocks (Note [Growth extents]), largest runs
 * first, after a sync of the streams that freed them. */
#include <stdlib.h>
#include <string.h>

#include "mp_capture.h"
#include "mp_expand_internal.h"

/* Release works on runs: maximal sequences of adjacent free blocks. Blocks of different
 * owners never merge, but their pages are all free, so a page shared by two of them can
 * go too; each owner's stream is synchronized before the unmap. */

/* The run starting at free block `first`: its last block, and the part of it that may be
 * unmapped, [*lo, *hi): the extents wholly inside it past the pinned prefix (Note [Growth
 * extents]; contiguous, since extents tile what is mapped). *hi <= *lo when there is none. */
static mp_block *run_pages(const mp_pool *p, mp_block *first, uintptr_t *lo, uintptr_t *hi) {
    mp_block *last = first;
    while (last->next && last->next->state == MP_BLOCK_FREE) last = last->next;
    const mp_segment *seg = first->seg;
    uintptr_t a = first->ptr, e = last->ptr + last->nbytes, pin = pinned_end(p, seg);
    size_t i = extent_at(seg, a < pin ? pin : a), j = i;
    while (j < seg->nextents && seg->extents[j].ptr + seg->extents[j].nbytes <= e) j++;
    *lo = *hi = 0;
    if (j > i) {
        *lo = seg->extents[i].ptr;
        *hi = seg->extents[j - 1].ptr + seg->extents[j - 1].nbytes;
    }
    return last;
}

typedef struct run_ref {
    mp_block *first;
    size_t nbytes;        /* in the whole allocations in it */
} run_ref;

/* Visit the runs with pages to give, outside [keep_lo, keep_hi); stop when visit says 0. */
typedef int (*run_visit)(void *arg, mp_block *first, uintptr_t lo, uintptr_t hi);

static void each_run_locked(const mp_pool *p, uintptr_t keep_lo, uintptr_t keep_hi, run_visit visit,
                            void *arg) {
    for (mp_segment *seg = p->segments; seg; seg = seg->next) {
        if (!seg->expandable) continue;
        mp_block *b = seg->first;
        while (b) {
            if (b->state != MP_BLOCK_FREE) {
                b = b->next;
                continue;
            }
            uintptr_t lo, hi;
            mp_block *last = run_pages(p, b, &lo, &hi);
            uintptr_t end = last->ptr + last->nbytes;
            int kept = b->ptr < keep_hi && keep_lo < end;
            if (hi > lo && !kept && !visit(arg, b, lo, hi)) return;
            b = last->next;
        }
    }
}

static int add_idle(void *arg, mp_block *first, uintptr_t lo, uintptr_t hi) {
    (void)first;
    *(size_t *)arg += hi - lo;
    return 1;
}

size_t ex_idle_bytes_locked(const mp_pool *p, uintptr_t keep_lo, uintptr_t keep_hi) {
    size_t n = 0;
    each_run_locked(p, keep_lo, keep_hi, add_idle, &n);
    return n;
}

typedef struct run_list {
    run_ref *runs;
    size_t n, cap;
} run_list;

static int add_run(void *arg, mp_block *first, uintptr_t lo, uintptr_t hi) {
    run_list *l = arg;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 32;
        run_ref *grown = realloc(l->runs, cap * sizeof *grown);
        if (!grown) return 0;
        l->runs = grown;
        l->cap = cap;
    }
    l->runs[l->n].first = first;
    l->runs[l->n++].nbytes = hi - lo;
    return 1;
}

/* Largest first; the lower address first among equals, so the order is deterministic. */
static int cmp_run(const void *x, const void *y) {
    const run_ref *a = x, *b = y;
    if (a->nbytes != b->nbytes) return a->nbytes > b->nbytes ? -1 : 1;
    return a->first->ptr < b->first->ptr ? -1 : a->first->ptr > b->first->ptr;
}

/* Part of a run that one owner freed: put back as it was if the pages cannot go. */
typedef struct run_part {
    uintptr_t ptr;
    size_t nbytes;
    mp_stream *owner;
} run_part;

typedef struct unmap_job {
    mp_block *u;          /* busy unmapped block whose pages are still mapped upstream */
    run_part *parts;      /* who freed which bytes of it, in address order */
    size_t nparts;
    int ok;
    mp_stream *unsynced;  /* an owner whose sync failed */
} unmap_job;

/* Split free block b at addr (inside it) with the spare struct n: both halves stay free
 * with b's owner. Returns the upper half. */
static mp_block *split_free_locked(mp_pool *p, mp_block *b, uintptr_t addr, mp_block *n) {
    mp_remove_free_locked(p, b);
    n->ptr = addr;
    n->nbytes = b->ptr + b->nbytes - addr;
    n->stream = b->stream;
    link_block(b, n, 1);
    b->nbytes = addr - b->ptr;
    mp_insert_free_locked(p, b);
    mp_insert_free_locked(p, n);
    return n;
}

/* Turn pages [lo, hi) of the run starting at `first` into one busy unmapped block, noting
 * in job who freed which part of it. 0 (nothing changed) when out of host memory. */
static int carve_run_locked(mp_pool *p, mp_block *first, uintptr_t lo, uintptr_t hi, unmap_job *job) {
    mp_block *x = first;
    while (x->ptr + x->nbytes <= lo) x = x->next;
    size_t nparts = 0;
    for (mp_block *b = x; b && b->ptr < hi; b = b->next) nparts++;
    /* Everything that can fail is taken first. */
    run_part *parts = malloc(nparts * sizeof *parts);
    mp_block *spare1 = mp_block_new_locked(p), *spare2 = spare1 ? mp_block_new_locked(p) : NULL;
    if (!parts || !spare2) {
        free(parts);
        if (spare1) mp_block_delete_locked(p, spare1);
        return 0;
    }
    size_t i = 0;
    for (mp_block *b = x; b && b->ptr < hi; b = b->next, i++) {
        parts[i].ptr = b->ptr < lo ? lo : b->ptr;
        parts[i].nbytes = (b->ptr + b->nbytes < hi ? b->ptr + b->nbytes : hi) - parts[i].ptr;
        parts[i].owner = b->stream;
    }
    if (x->ptr < lo) {
        x = split_free_locked(p, x, lo, spare1);
        spare1 = NULL;
    }
    mp_block *y = x;
    while (y->ptr + y->nbytes < hi) y = y->next;
    if (y->ptr + y->nbytes > hi) {
        split_free_locked(p, y, hi, spare2);
        spare2 = NULL;
    }
    if (spare1) mp_block_delete_locked(p, spare1);
    if (spare2) mp_block_delete_locked(p, spare2);
    mp_block *stop = y->next;
    mp_remove_free_locked(p, x);
    for (mp_block *b = x->next; b != stop;) {
        mp_block *next = b->next;
        mp_remove_free_locked(p, b);
        mp_block_delete_locked(p, b);
        b = next;
    }
    x->next = stop;
    if (stop) stop->prev = x;
    x->nbytes = hi - lo;
    x->state = MP_BLOCK_UNMAPPED;
    x->busy = 1;
    extents_set_busy(x->seg, lo, hi, 1);
    job->u = x;
    job->parts = parts;
    job->nparts = nparts;
    job->ok = 1;
    job->unsynced = NULL;
    return 1;
}

/* Pages that could not go (an owner not synchronized, or the unmap failed) become free
 * blocks again, each part with the owner that freed it. `unsynced` is an owner whose sync
 * failed, if any. */
static void restore_run_locked(mp_pool *p, unmap_job *job, mp_stream *unsynced) {
    mp_block *u = job->u;
    ex_count_mapped_locked(p, u->seg, u->nbytes, 1);
    extents_set_busy(u->seg, u->ptr, u->ptr + u->nbytes, 0);
    u->busy = 0;
    mp_block **more = malloc(job->nparts * sizeof *more);
    size_t got = 1;
    while (more && got < job->nparts && (more[got] = mp_block_new_locked(p))) got++;
    if (got < job->nparts) {
        /* Out of host memory for the parts: the whole run goes to the stream that was not
         * synchronized (its own order keeps the pages safe there), else to any owner. */
        for (size_t i = 1; more && i < got; i++) mp_block_delete_locked(p, more[i]);
        free(more);
        u->stream = unsynced ? unsynced : job->parts[0].owner;
        mp_insert_free_merged_locked(p, u);
        return;
    }
    u->nbytes = job->parts[0].nbytes;
    u->stream = job->parts[0].owner;
    mp_block *prev = u;
    for (size_t i = 1; i < job->nparts; i++) {
        mp_block *b = more[i];
        b->ptr = job->parts[i].ptr;
        b->nbytes = job->parts[i].nbytes;
        b->stream = job->parts[i].owner;
        b->state = MP_BLOCK_UNMAPPED;   /* until its turn below: nothing merges into it */
        b->busy = 1;
        link_block(prev, b, 1);
        prev = b;
    }
    more[0] = u;
    for (size_t i = 0; i < job->nparts; i++) {
        more[i]->busy = 0;
        mp_insert_free_merged_locked(p, more[i]);
    }
    free(more);
}

/* Note [Threshold releases without a sync]: whether stream s has no work left now, asked of
 * the upstream once per release (the answers kept in asked/idle, room for every stream). */
static int stream_idle_locked(mp_pool *p, mp_stream *s, mp_stream **asked, int *idle,
                              size_t *nasked) {
    for (size_t j = 0; j < *nasked; j++)
        if (asked[j] == s) return idle[j];
    /* Note [Graph capture]: a capturing stream is never idle (and must not be queried). */
    int capturing = mp_capture_handle(p, s->handle);
    int ok = p->up.stream_query && !capturing && mp_up_query(p, s->handle) == MP_OK;
    asked[*nasked] = s;
    idle[(*nasked)++] = ok;
    return ok;
}

/* Whether every stream that freed a part of [lo, hi) of the run at `first` is idle. */
static int run_idle_locked(mp_pool *p, mp_block *first, uintptr_t lo, uintptr_t hi,
                           mp_stream **asked, int *idle, size_t *nasked) {
    mp_block *x = first;
    while (x->ptr + x->nbytes <= lo) x = x->next;
    for (mp_block *b = x; b && b->ptr < hi; b = b->next)
        if (!stream_idle_locked(p, b->stream, asked, idle, nasked)) return 0;
    return 1;
}

/* Unmap whole free pages outside [keep_lo, keep_hi) until `target` bytes are released (or
 * nothing releasable is left), after synchronizing their owner streams; or, when `wait` is 0,
 * only pages whose owner streams have no work left now (Note [Threshold releases without a
 * sync]), setting *busy when some page stayed for a busy stream. *unmaps (may be NULL) counts
 * the physical allocations unmapped (one unmap call, num_device_free, may cover several).
 * Drops and retakes the lock. Returns the bytes released. */
size_t ex_release_pages_locked(mp_pool *p, size_t target, uintptr_t keep_lo, uintptr_t keep_hi,
                               int wait, int *busy, uint64_t *unmaps) {
    /* Less than a page free in all: no whole page to find (the common case under a
     * release_threshold, checked on every free), so skip the walk over the blocks. */
    int64_t free_bytes = mp_stat3_current(p->stats.reserved_bytes) -
                         mp_hot_current(p, MP_HOT_ACTIVE_BYTES);
    if (!target || free_bytes < (int64_t)p->up.granularity) return 0;
    if (mp_capture_stream_locked(p, NULL)) return 0;   /* Note [Graph capture]; owners below */
    run_list runs = {0};
    each_run_locked(p, keep_lo, keep_hi, add_run, &runs);
    unmap_job *jobs = runs.n ? malloc(runs.n * sizeof *jobs) : NULL;
    /* Room for every stream a block may belong to: forgotten ones too (Note [Forgotten
     * streams]: an operation under way may have handed them blocks). */
    size_t nall = p->nstreams + p->ndead;
    mp_stream **owners = runs.n ? malloc(nall * sizeof *owners) : NULL;
    int *synced = runs.n ? malloc(nall * sizeof *synced) : NULL;
    uintptr_t *handles = runs.n ? malloc(nall * sizeof *handles) : NULL;
    /* !wait: the streams asked whether idle, and their answers */
    mp_stream **asked = runs.n && !wait ? malloc(nall * sizeof *asked) : NULL;
    int *idle = runs.n && !wait ? malloc(nall * sizeof *idle) : NULL;
    if (!jobs || !owners || !synced || !handles || (!wait && (!asked || !idle))) {
        free(runs.runs);
        free(jobs);
        free(owners);
        free(synced);
        free(handles);
        free(asked);
        free(idle);
        return 0;
    }
    size_t nasked = 0;
    qsort(runs.runs, runs.n, sizeof *runs.runs, cmp_run);
    size_t n = 0, released = 0, nowners = 0;
    for (size_t i = 0; i < runs.n && released < target; i++) {
        uintptr_t lo, hi;
        run_pages(p, runs.runs[i].first, &lo, &hi);
        size_t want = target - released;   /* only what is still wanted, from the high end */
        if (want < hi - lo) {
            /* in whole extents (Note [Growth extents]): as few as cover it */
            const mp_segment *seg = runs.runs[i].first->seg;
            size_t k = extent_at(seg, hi);
            uintptr_t cut = hi;
            while (cut > lo && hi - cut < want) cut = seg->extents[--k].ptr;
            lo = cut;
        }
        if (!wait && !run_idle_locked(p, runs.runs[i].first, lo, hi, asked, idle, &nasked)) {
            if (busy) *busy = 1;
            continue;   /* a stream may still use these pages: they stay, no sync */
        }
        if (!carve_run_locked(p, runs.runs[i].first, lo, hi, &jobs[n])) break;
        for (size_t k = 0; k < jobs[n].nparts; k++) {
            size_t j = 0;
            while (j < nowners && owners[j] != jobs[n].parts[k].owner) j++;
            if (j == nowners) owners[nowners++] = jobs[n].parts[k].owner;
        }
        ex_count_mapped_locked(p, jobs[n].u->seg, hi - lo, 0);
        released += hi - lo;
        n++;
    }
    free(runs.runs);
    free(asked);
    free(idle);
    if (!n) {
        free(jobs);
        free(owners);
        free(synced);
        free(handles);
        return 0;
    }
    p->inflight_bytes += released;   /* still held until unmapped: count it for the limit */
    mp_publish_held_locked(p);
    /* !wait: every owner was idle when asked, after the frees of these pages. */
    for (size_t j = 0; j < nowners && !wait; j++) synced[j] = 1;
    /* The handles, read under the lock (forget_stream may change a struct's meanwhile) */
    for (size_t j = 0; j < nowners; j++) handles[j] = owners[j]->handle;
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    /* Note [Graph capture]: a capturing owner is not synchronized; its pages stay. */
    for (size_t j = 0; j < nowners && wait; j++)
        synced[j] = !mp_capture_handle(p, handles[j]) && mp_up_sync(p, handles[j]) == MP_OK;
    for (size_t i = 0; i < n; i++) {
        for (size_t k = 0; k < jobs[i].nparts; k++) {
            size_t j = 0;
            while (owners[j] != jobs[i].parts[k].owner) j++;
            if (!synced[j]) {
                jobs[i].ok = 0;
                jobs[i].unsynced = owners[j];
            }
        }
        mp_assert(jobs[i].u->ptr % p->up.granularity == 0 && jobs[i].u->nbytes % p->up.granularity == 0);
        mp_assert(jobs[i].u->ptr >= jobs[i].u->seg->ptr &&
                  jobs[i].u->ptr + jobs[i].u->nbytes <= jobs[i].u->seg->ptr + jobs[i].u->seg->nbytes);
        if (jobs[i].ok) jobs[i].ok = p->up.unmap(p->up.ctx, jobs[i].u->ptr, jobs[i].u->nbytes) == MP_OK;
    }
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    p->inflight_bytes -= released;
    mp_publish_held_locked(p);
    /* One at a time: a later job's block stays busy (so unmerged and valid) until its turn. */
    for (size_t i = 0; i < n; i++) {
        mp_block *u = jobs[i].u;
        if (jobs[i].ok) {
            u->busy = 0;
            if (unmaps)   /* physical allocations, several to a call */
                *unmaps += extent_at(u->seg, u->ptr + u->nbytes) - extent_at(u->seg, u->ptr);
            extents_remove(u->seg, u->ptr, u->ptr + u->nbytes);
            p->stats.num_device_free++;
            mp_trace_segment_locked(p, MP_TRACE_SEGMENT_UNMAP, u->ptr, u->nbytes,
                                    jobs[i].parts[0].owner->handle);
            ex_merge_unmapped_locked(p, u);
        } else {
            released -= u->nbytes;
            restore_run_locked(p, &jobs[i], jobs[i].unsynced);
        }
        free(jobs[i].parts);
    }
    free(jobs);
    free(owners);
    free(synced);
    free(handles);
    return released;
}

size_t mp_expand_release_locked(mp_pool *p, size_t target) {
    return ex_release_pages_locked(p, target, 0, 0, 1, NULL, NULL);
}

size_t mp_expand_release_idle_locked(mp_pool *p, size_t target, int *busy, uint64_t *unmaps) {
    return ex_release_pages_locked(p, target, 0, 0, 0, busy, unmaps);
}
