/* The allocate/free path of the core: size policy, streams, blocks, split and merge, the
 * fallback chain. Release of cached memory is in mp_release.c, invariants and layout copies
 * in mp_inspect.c, trace recording in mp_trace.c, expandable segments in mp_expand.c.
 *
 * Note [Lock order]: the GIL (if the caller holds it) comes before the pool lock; nothing
 * here acquires the GIL. The pool lock is never held across a call that may take long or
 * block: segment allocation and release, stream synchronization, mapping and unmapping go
 * through the *_unlocked helpers, which drop it and take it again. Event calls are short and
 * are made with the lock held.
 */
#include <stdlib.h>
#include <string.h>

#include "mp_capture.h"
#include "mp_expand.h"
#include "mp_internal.h"

/* ---------------------------------------------------------------- size policy */

void mp_config_default(mp_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->max_split_size = MP_UNLIMITED;
    cfg->cross_stream_reuse = 1;
    cfg->release_threshold = MP_UNLIMITED;
    cfg->limit = MP_UNLIMITED;
}

static int log2_floor(size_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

/* PyTorch's roundup_power2_next_division: cut [2^k, 2^(k+1)) into `divisions` steps. */
static size_t next_division(size_t size, size_t divisions) {
    if ((size & (size - 1)) == 0) return size;
    size_t floor2 = (size_t)1 << log2_floor(size);
    size_t step = floor2 >> log2_floor(divisions);
    if (step == 0) return floor2 << 1;
    size_t below = size & ~(step - 1);
    return below == size ? size : below + step;
}

size_t mp_round_size(const mp_config *cfg, size_t nbytes) {
    if (nbytes < MP_MIN_BLOCK) return MP_MIN_BLOCK;
    int index = log2_floor(nbytes) - 20;   /* intervals start at 1 MiB */
    if (index < 0) index = 0;
    if (index > MP_ROUNDUP_INTERVALS - 1) index = MP_ROUNDUP_INTERVALS - 1;
    size_t divisions = cfg->roundup_divisions[index];
    if (divisions > 1 && nbytes > MP_MIN_BLOCK * divisions) return next_division(nbytes, divisions);
    return (nbytes + MP_MIN_BLOCK - 1) & ~(MP_MIN_BLOCK - 1);
}

size_t mp_segment_size(size_t rounded) {
    if (rounded <= MP_SMALL_SIZE) return MP_SMALL_SEGMENT;
    if (rounded < MP_MIN_LARGE_ALLOC) return MP_LARGE_SEGMENT;
    return (rounded + MP_LARGE_ROUND - 1) & ~(MP_LARGE_ROUND - 1);
}

/* ---------------------------------------------------------------- block structs */

#define SLAB_BLOCKS 256

mp_block *mp_block_new_locked(mp_pool *p) {
    if (!p->spare_blocks) {
        mp_block_slab *slab = malloc(sizeof(mp_block_slab) + SLAB_BLOCKS * sizeof(mp_block));
        if (!slab) return NULL;
        slab->next = p->slabs;
        p->slabs = slab;
        for (int i = 0; i < SLAB_BLOCKS; i++) {
            slab->blocks[i].fnext = p->spare_blocks;
            p->spare_blocks = &slab->blocks[i];
        }
    }
    mp_block *b = p->spare_blocks;
    p->spare_blocks = b->fnext;
    /* Every field set (cheaper than a memset of the struct on the hot path). */
    b->ptr = 0;
    b->nbytes = b->requested = 0;
    b->seg = NULL;
    b->prev = b->next = b->fprev = b->fnext = NULL;
    b->stream = NULL;
    b->cls = MP_NOT_LISTED;
    b->state = MP_BLOCK_FREE;
    b->split_counted = b->busy = b->torch = 0;
    b->nuses = 0;
    b->cap_uses = MP_INLINE_USES;
    b->uses = b->inline_uses;
    b->events = NULL;
    return b;
}

void mp_block_delete_locked(mp_pool *p, mp_block *b) {
    if (b->uses != b->inline_uses) free(b->uses);
    free(b->events);
    b->fnext = p->spare_blocks;
    p->spare_blocks = b;
}

/* ---------------------------------------------------------------- events */

int mp_event_get_locked(mp_pool *p, uintptr_t *ev) {
    if (p->nevent_cache) {
        *ev = p->event_cache[--p->nevent_cache];
        return MP_OK;
    }
    return p->up.event_create(p->up.ctx, ev);
}

void mp_event_put_locked(mp_pool *p, uintptr_t ev) {
    if (p->nevent_cache == p->cap_event_cache) {
        size_t cap = p->cap_event_cache ? p->cap_event_cache * 2 : 16;
        uintptr_t *grown = realloc(p->event_cache, cap * sizeof *grown);
        if (!grown) {
            p->up.event_destroy(p->up.ctx, ev);
            return;
        }
        p->event_cache = grown;
        p->cap_event_cache = cap;
    }
    p->event_cache[p->nevent_cache++] = ev;
}

/* ---------------------------------------------------------------- streams */

mp_stream *mp_stream_get_locked(mp_pool *p, uintptr_t handle) {
    if (p->last_stream && p->last_stream->handle == handle) return p->last_stream;
    for (size_t i = 0; i < p->nstreams; i++) {
        if (p->streams[i]->handle == handle) return p->last_stream = p->streams[i];
    }
    if (p->nstreams == p->cap_streams) {
        size_t cap = p->cap_streams ? p->cap_streams * 2 : 8;
        mp_stream **grown = realloc(p->streams, cap * sizeof *grown);
        if (!grown) return NULL;
        p->streams = grown;
        p->cap_streams = cap;
    }
    mp_stream *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->handle = handle;
    p->streams[p->nstreams++] = s;
    return p->last_stream = s;
}

/* ---------------------------------------------------------------- free lists */

void mp_insert_free_locked(mp_pool *p, mp_block *b) {
    b->state = MP_BLOCK_FREE;
    mp_freelist_insert(&b->stream->lists[b->seg->kind], b);
    if (b->prev || b->next) {
        b->split_counted = 1;
        mp_stat3_inc(p->stats.inactive_split, b->seg->kind, 1);
        mp_stat3_inc(p->stats.inactive_split_bytes, b->seg->kind, (int64_t)b->nbytes);
    }
}

void mp_remove_free_locked(mp_pool *p, mp_block *b) {
    mp_freelist_remove(&b->stream->lists[b->seg->kind], b);
    if (b->split_counted) {
        b->split_counted = 0;
        mp_stat3_dec(p->stats.inactive_split, b->seg->kind, 1);
        mp_stat3_dec(p->stats.inactive_split_bytes, b->seg->kind, (int64_t)b->nbytes);
    }
}

/* The smallest size a class can hold: the inverse of mp_size_class. */
static size_t class_min_bytes(uint32_t c) {
    if (c < MP_EXACT_CLASSES) return ((size_t)c + 1) << 9;
    if (c == MP_NCLASSES - 1) return (((size_t)1 << (MP_TOP_K + 1)) + 1) << 9;
    uint32_t k = 7 + (c - MP_EXACT_CLASSES) / MP_SUBCLASSES;
    uint64_t sub = (c - MP_EXACT_CLASSES) % MP_SUBCLASSES;
    return ((size_t)((MP_SUBCLASSES + sub) << (k - 6)) + 1) << 9;
}

/* max_split_size policy, as PyTorch's: small requests never take oversize blocks (which
 * would then be split), and oversize requests take blocks at most MP_LARGE_BUFFER larger. */
static inline int split_policy_allows(size_t max_split, size_t size, size_t block) {
    if (max_split == MP_UNLIMITED) return 1;
    if (size < max_split) return block < max_split;
    return block < size + MP_LARGE_BUFFER;
}

static int classes_exhausted(size_t max_split, size_t size, uint32_t c) {
    if (max_split == MP_UNLIMITED) return 0;
    size_t lo = class_min_bytes(c);
    return size < max_split ? lo >= max_split : lo >= size + MP_LARGE_BUFFER;
}

static mp_block *find_fit(const mp_pool *p, const mp_freelist *fl, size_t size) {
    if (!fl->count) return NULL;
    size_t max_split = p->cfg.max_split_size;
    for (uint32_t c = mp_freelist_next_class(fl, mp_class_of(size)); c < MP_NCLASSES;
         c = mp_freelist_next_class(fl, c + 1)) {
        if (classes_exhausted(max_split, size, c)) return NULL;
        mp_block *best = NULL;
        for (mp_block *b = fl->head[c]; b; b = b->fnext) {
            if (b->nbytes < size || !split_policy_allows(max_split, size, b->nbytes)) continue;
            if (!best || b->nbytes < best->nbytes) {
                best = b;
                if (b->nbytes == size) break;
            }
        }
        if (best) return best;
    }
    return NULL;
}

/* Cross-stream reuse without a host sync: the best fit among other streams' free blocks,
 * made safe for `s` by an event recorded on its owner that `s` waits on. See
 * docs/architecture.md "Note [Stream reuse]". */
static mp_block *take_from_other_stream_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    mp_block *best = NULL;
    for (size_t i = 0; i < p->nstreams; i++) {
        mp_stream *t = p->streams[i];
        if (t == s) continue;
        mp_block *b = find_fit(p, &t->lists[kind], size);
        if (b && (!best || b->nbytes < best->nbytes)) best = b;
    }
    if (!best) return NULL;
    /* Note [Graph capture]: the event would be recorded, queried or waited on across a
     * capture's edge. */
    if (mp_capture_stream_locked(p, s) || mp_capture_handle(p, best->stream->handle)) return NULL;
    uintptr_t ev;
    if (mp_event_get_locked(p, &ev) != MP_OK) return NULL;
    int rc = mp_up_record(p, ev, best->stream->handle);
    /* When the owner has no work queued, nothing needs waiting for: skip the wait, which
     * would otherwise order all of s's later work after the owner's. */
    int waited = 0;
    if (rc == MP_OK && p->up.event_query(p->up.ctx, ev) != MP_OK) {
        rc = p->up.stream_wait_event(p->up.ctx, s->handle, ev);
        waited = 1;
    }
    /* A wait captures the event's state when issued, so the event is reusable at once. */
    mp_event_put_locked(p, ev);
    if (rc != MP_OK) return NULL;
    p->stats.num_cross_stream_reuse++;
    p->stats.num_event_waits += waited;
    return best;
}

/* ---------------------------------------------------------------- split and merge */

static int should_split(const mp_pool *p, const mp_block *b, size_t size) {
    size_t remaining = b->nbytes - size;
    if (b->seg->kind == KIND_SMALL || b->seg->expandable) return remaining >= MP_MIN_BLOCK;
    return size < p->cfg.max_split_size && remaining > MP_SMALL_SIZE;
}

/* The block b, taken for a request of `requested` bytes, becomes live: its state and the
 * counters (the caller puts it in the pointer map, or finds it there: Note [Hot blocks]). */
static void hand_out_locked(mp_pool *p, mp_block *b, size_t requested) {
    int kind = b->seg->kind;
    b->state = MP_BLOCK_ALLOCATED;
    b->requested = requested;
    mp_stat3_inc(p->stats.allocation, kind, 1);
    mp_stat3_inc(p->stats.allocated_bytes, kind, (int64_t)b->nbytes);
    mp_stat3_inc(p->stats.requested_bytes, kind, (int64_t)requested);
    mp_stat3_inc(p->stats.active, kind, 1);
    mp_stat3_inc(p->stats.active_bytes, kind, (int64_t)b->nbytes);
    if (b->nbytes >= p->cfg.max_split_size) mp_stat_inc(&p->stats.oversize_allocations, 1);
}

/* Hand out free block b (in its owner's list, or in none) to stream s, splitting off what
 * it does not need. The remainder stays with b's owner: only the part handed out moves.
 * Returns the block handed out. When the remainder stays in b's size class, b itself
 * shrinks in place and keeps its place in the list (no list operations: the common case of
 * a round trip on a segment's free tail). */
static mp_block *carve_locked(mp_pool *p, mp_block *b, size_t size, size_t requested,
                              mp_stream *s) {
    mp_segment *seg = b->seg;
    int kind = seg->kind;
    int listed = b->cls != MP_NOT_LISTED;
    mp_block *a = NULL;
    if (should_split(p, b, size)) {
        size_t rest = b->nbytes - size;
        if (listed && mp_class_of(rest) == b->cls && (a = mp_block_new_locked(p))) {
            a->ptr = b->ptr;
            a->nbytes = size;
            a->seg = seg;
            a->prev = b->prev;
            a->next = b;
            if (b->prev) b->prev->next = a;
            else seg->first = a;
            b->prev = a;
            b->ptr += size;
            b->nbytes = rest;
            b->stream->lists[kind].nbytes -= size;
            if (b->split_counted) {
                mp_stat3_dec(p->stats.inactive_split_bytes, kind, (int64_t)size);
            } else {
                b->split_counted = 1;
                mp_stat3_inc(p->stats.inactive_split, kind, 1);
                mp_stat3_inc(p->stats.inactive_split_bytes, kind, (int64_t)rest);
            }
            b = a;
        } else {
            if (listed) mp_remove_free_locked(p, b);
            mp_block *r = mp_block_new_locked(p);
            if (r) {   /* out of host memory for a struct: hand out the whole block instead */
                r->ptr = b->ptr + size;
                r->nbytes = rest;
                r->seg = seg;
                r->stream = b->stream;
                r->prev = b;
                r->next = b->next;
                if (b->next) b->next->prev = r;
                b->next = r;
                b->nbytes = size;
                mp_insert_free_locked(p, r);
            }
        }
    } else if (listed) {
        mp_remove_free_locked(p, b);
    }
    b->stream = s;
    if (seg->nbusy++ == 0) mp_segment_idle_remove_locked(p, seg);
    mp_ptrmap_insert(&p->live, b->ptr, b);   /* capacity was reserved by the caller */
    hand_out_locked(p, b, requested);
    return b;
}

static mp_block *merge_locked(mp_pool *p, mp_block *dst, mp_block *src) {
    /* src is dst's neighbour, free, same stream and same mapping: fold it into dst. */
    mp_remove_free_locked(p, src);
    if (src == dst->prev) {
        dst->ptr = src->ptr;
        dst->prev = src->prev;
        if (src->prev) src->prev->next = dst;
        else dst->seg->first = dst;
    } else {
        dst->next = src->next;
        if (src->next) src->next->prev = dst;
    }
    dst->nbytes += src->nbytes;
    mp_block_delete_locked(p, src);
    return dst;
}

static inline int mergeable(const mp_block *b, const mp_block *n) {
    return n && n->state == MP_BLOCK_FREE && n->stream == b->stream;
}

/* Return an allocated (or completed pending) block to its owner's free list. */
/* Fold freed block b into its one free neighbour n of the same owner without list
 * operations, when the merged block stays in n's size class: n grows in place over b.
 * Returns n, or NULL when the general merge is needed. */
static mp_block *absorb_into_neighbour_locked(mp_pool *p, mp_block *b) {
    mp_block *n;
    if (mergeable(b, b->next) && !mergeable(b, b->prev)) n = b->next;
    else if (mergeable(b, b->prev) && !mergeable(b, b->next)) n = b->prev;
    else return NULL;
    if (mp_class_of(n->nbytes + b->nbytes) != n->cls) return NULL;
    mp_segment *seg = b->seg;
    int kind = seg->kind;
    if (n == b->next) {
        n->ptr = b->ptr;
        n->prev = b->prev;
        if (b->prev) b->prev->next = n;
        else seg->first = n;
    } else {
        n->next = b->next;
        if (b->next) b->next->prev = n;
    }
    n->nbytes += b->nbytes;
    n->stream->lists[kind].nbytes += b->nbytes;
    /* n was split (b was its neighbour); it is whole now if it covers the segment */
    if (n->prev || n->next) {
        mp_stat3_inc(p->stats.inactive_split_bytes, kind, (int64_t)b->nbytes);
    } else {
        n->split_counted = 0;
        mp_stat3_dec(p->stats.inactive_split, kind, 1);
        mp_stat3_dec(p->stats.inactive_split_bytes, kind, (int64_t)(n->nbytes - b->nbytes));
    }
    mp_block_delete_locked(p, b);
    return n;
}

void mp_free_block_locked(mp_pool *p, mp_block *b) {
    mp_segment *seg = b->seg;
    b->stream->frees++;   /* Note [Hot blocks]: the stream's lists changed */
    b->state = MP_BLOCK_FREE;
    b->requested = 0;
    if (!absorb_into_neighbour_locked(p, b)) mp_insert_free_merged_locked(p, b);
    if (--seg->nbusy == 0) mp_segment_idle_push_locked(p, seg);
}

/* Put b into its owner's free list, merged with free neighbours of the same owner. */
void mp_insert_free_merged_locked(mp_pool *p, mp_block *b) {
    b->state = MP_BLOCK_FREE;
    b->requested = 0;
    if (mergeable(b, b->prev)) merge_locked(p, b, b->prev);
    if (mergeable(b, b->next)) merge_locked(p, b, b->next);
    mp_insert_free_locked(p, b);
}

/* ---------------------------------------------------------------- hot blocks */

/* Note [Hot blocks] (docs/architecture.md). A block freed with no other stream to wait for
 * is parked on its stream instead of being merged into the free lists: the next request
 * of its exact size on that stream takes it back with none of the split, merge, list and
 * idle-segment work of a round trip. Any other request on the stream, any view of the pool
 * and any path that gives memory back or grows folds it in first, just as the plain free
 * would have done it then. Its counters are those of a free block from the moment it is
 * parked; its segment stays busy and its entry stays in the pointer map (marked by its
 * state: live_block_locked does not see it) until it is taken back or folded in. Not used
 * with expandable segments or a release threshold, whose bookkeeping runs at each free. */

static void hot_flush_stream_locked(mp_pool *p, mp_stream *s) {
    mp_block *h = s->hot;
    if (!h) return;
    s->hot = NULL;
    p->nhot--;
    mp_ptrmap_remove(&p->live, h->ptr);
    mp_free_block_locked(p, h);
}

void mp_hot_flush_locked(mp_pool *p) {
    for (size_t i = 0; p->nhot && i < p->nstreams; i++) hot_flush_stream_locked(p, p->streams[i]);
    for (mp_stream *d = p->dead; p->nhot && d; d = d->next_dead) hot_flush_stream_locked(p, d);
}

static inline int hot_allowed(const mp_pool *p) {
    return p->cfg.release_threshold == MP_UNLIMITED;
}

/* A free of b completes: it is no longer active (counters and trace). */
static void count_free_completed_locked(mp_pool *p, mp_block *b) {
    int kind = b->seg->kind;
    mp_stat3_dec(p->stats.active, kind, 1);
    mp_stat3_dec(p->stats.active_bytes, kind, (int64_t)b->nbytes);
    mp_stat3_dec(p->stats.requested_bytes, kind, (int64_t)b->requested);
    mp_trace_locked(p, MP_TRACE_FREE_COMPLETED, b->ptr, b->requested, b->stream->handle);
}

/* The completed free of b, parked hot instead of folded into the lists. */
static void park_hot_locked(mp_pool *p, mp_block *b) {
    count_free_completed_locked(p, b);
    b->state = MP_BLOCK_HOT;   /* not FREE: no merge may fold it while it is parked */
    b->requested = 0;
    mp_stream *s = b->stream;
    if (s->hot) hot_flush_stream_locked(p, s);
    s->hot = b;
    s->hot_frees = s->frees;
    p->nhot++;
}

/* A request of `size` bytes on s: its hot block when that has exactly the size and no other
 * free has completed on s since it was parked (returned taken out of the stream), else
 * NULL, with the hot block folded in. */
static inline mp_block *take_hot_locked(mp_pool *p, mp_stream *s, size_t size) {
    mp_block *h = s->hot;
    if (!h) return NULL;
    if (h->nbytes != size || s->frees != s->hot_frees) {
        hot_flush_stream_locked(p, s);
        return NULL;
    }
    s->hot = NULL;
    p->nhot--;
    return h;
}

/* ---------------------------------------------------------------- pool lifetime */

int mp_pool_create(const mp_config *cfg, const mp_upstream *up, mp_pool **out) {
    if (cfg->gc_threshold < 0 || cfg->gc_threshold >= 1) return MP_EINVAL;
    if (cfg->expandable_segments && !up->map) return MP_EUNSUPPORTED;
    mp_pool *p = calloc(1, sizeof *p);
    if (!p) return MP_ENOMEM;
    mp_lock_init(&p->lock);
    p->refcount = 1;
    p->cfg = *cfg;
    p->up = *up;
    if (mp_ptrmap_init(&p->live, 1024) != MP_OK) {
        free(p);
        return MP_ENOMEM;
    }
    size_t free_bytes = 0, total = 0;
    if (p->up.mem_info && p->up.mem_info(p->up.ctx, &free_bytes, &total) == MP_OK) p->capacity = total;
    if (cfg->initial_pool_size) {
        int rc = mp_reserve_initial(p, cfg->initial_pool_size);
        if (rc != MP_OK) {
            mp_pool_destroy(p);
            return rc;
        }
    }
    *out = p;
    return MP_OK;
}

void mp_pool_destroy(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    mp_hot_flush_locked(p);
    /* Every block is dropped with its segment: nothing may use the pool's memory now.
     * Streams the pool saw may be destroyed by now (a CuPy stream that went out of scope),
     * and a call on a dead handle crashes the driver: so drain the whole device, which needs
     * no handle, and free every segment on the legacy stream. Only without a device sync
     * are the streams themselves drained (expandable pools: unmap does not wait). */
    mp_stream *legacy = NULL;
    if (p->up.device_synchronize && p->up.device_synchronize(p->up.ctx) == MP_OK)
        legacy = mp_stream_get_locked(p, 0);
    if (!legacy && p->cfg.expandable_segments)
        for (size_t i = 0; i < p->nstreams; i++) mp_up_sync(p, p->streams[i]->handle);
    mp_segment *seg = p->segments;
    while (seg) {
        mp_segment *next = seg->next;
        mp_block *b = seg->first;
        while (b) {
            mp_block *bn = b->next;
            if (b->events) {
                for (uint16_t i = 0; i < b->nuses; i++) p->up.event_destroy(p->up.ctx, b->events[i]);
            }
            if (b->uses != b->inline_uses) free(b->uses);
            free(b->events);
            b = bn;
        }
        seg->release_stream = legacy ? 0 : seg->stream->handle;
        mp_segment_release_upstream(p, seg);
        free(seg);
        seg = next;
    }
    for (size_t i = 0; i < p->nevent_cache; i++) p->up.event_destroy(p->up.ctx, p->event_cache[i]);
    free(p->event_cache);
    for (size_t i = 0; i < p->nstreams; i++) free(p->streams[i]);
    free(p->streams);
    while (p->dead) {
        mp_stream *d = p->dead;
        p->dead = d->next_dead;
        free(d);
    }
    while (p->slabs) {
        mp_block_slab *next = p->slabs->next;
        free(p->slabs);
        p->slabs = next;
    }
    mp_ptrmap_destroy(&p->live);
    free(p->trace);
    int kept = p->torch_kept;
    mp_lock_release(&p->lock);
    if (p->up.destroy) p->up.destroy(p->up.ctx);
    /* Note [Torch table lifetime]: a pool that was in PyTorch's table leaves its struct
     * behind, retired, for an entry point that read it from the table just before. */
    if (!kept) free(p);
}

void mp_pool_retain(mp_pool *p) { __atomic_add_fetch(&p->refcount, 1, __ATOMIC_RELAXED); }

void mp_pool_release(mp_pool *p) {
    if (__atomic_sub_fetch(&p->refcount, 1, __ATOMIC_ACQ_REL) == 0) mp_pool_destroy(p);
}

/* ---------------------------------------------------------------- allocation */

/* Drop the lock, free what `rel` detached, ask the upstream for a segment, take the lock
 * again. The bytes in flight count against the limit meanwhile. */
static int upstream_segment_unlocked(mp_pool *p, mp_stream *s, size_t nbytes,
                                     mp_release_list *rel, uintptr_t *ptr) {
    p->inflight_bytes += nbytes;
    uintptr_t handle = s->handle;
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    mp_release_finish(p, rel);
    int rc = p->up.segment_alloc(p->up.ctx, nbytes, handle, ptr);
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    p->inflight_bytes -= nbytes;
    return rc;
}

/* Block the host on every stream that pending blocks wait for, then return those blocks.
 * The last resort before an OOM: it syncs only the streams that hold memory back. */
void mp_sync_pending_unlocked(mp_pool *p) {
    if (!p->npending || mp_capture_stream_locked(p, NULL)) return;   /* Note [Graph capture] */
    size_t n = 0, cap = 16;
    uintptr_t *handles = malloc(cap * sizeof *handles);
    for (mp_block *b = p->pending_head; b && handles; b = b->fnext) {
        for (uint16_t i = 0; i < b->nuses; i++) {
            uintptr_t h = b->uses[i]->handle;
            size_t j = 0;
            while (j < n && handles[j] != h) j++;
            if (j < n) continue;
            if (n == cap) {
                uintptr_t *grown = realloc(handles, (cap *= 2) * sizeof *grown);
                if (!grown) break;
                handles = grown;
            }
            handles[n++] = h;
        }
    }
    p->stats.num_sync_all_streams++;
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    for (size_t j = 0; j < n; j++)
        if (!mp_capture_handle(p, handles[j])) mp_up_sync(p, handles[j]);
    mp_blocking_end(blocking);
    free(handles);
    mp_lock_retake(p);
    mp_process_pending_locked(p);
}

size_t mp_reserved_now_locked(const mp_pool *p) {
    return (size_t)mp_stat3_current(p->stats.reserved_bytes) + p->inflight_bytes;
}

mp_block *mp_search_lists_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    mp_block *b = find_fit(p, &s->lists[kind], size);
    if (b) return b;   /* still in its list: carve_locked takes it out, or shrinks it */
    if (p->cfg.cross_stream_reuse && p->nstreams > 1) {
        if (p->nhot) mp_hot_flush_locked(p);   /* Note [Hot blocks]: other streams' too */
        return take_from_other_stream_locked(p, s, kind, size);
    }
    return NULL;
}

static mp_block *new_segment_locked(mp_pool *p, mp_stream *s, int kind, uintptr_t ptr,
                                    size_t nbytes) {
    mp_segment *seg = calloc(1, sizeof *seg);
    mp_block *b = seg ? mp_block_new_locked(p) : NULL;
    if (!b) {
        free(seg);
        return NULL;
    }
    seg->ptr = ptr;
    seg->nbytes = seg->mapped_bytes = nbytes;
    seg->stream = s;
    seg->kind = kind;
    seg->first = b;
    seg->next = p->segments;
    if (p->segments) p->segments->prev = seg;
    p->segments = seg;
    p->nsegments++;
    b->ptr = ptr;
    b->nbytes = nbytes;
    b->seg = seg;
    b->stream = s;
    b->state = MP_BLOCK_FREE;
    mp_segment_idle_push_locked(p, seg);   /* idle until its first block is handed out */
    p->stats.num_device_alloc++;
    mp_stat3_inc(p->stats.segment, kind, 1);
    mp_stat3_inc(p->stats.reserved_bytes, kind, (int64_t)nbytes);
    if (mp_reserved_now_locked(p) > p->reserved_high_water)
        p->reserved_high_water = mp_reserved_now_locked(p);
    if (nbytes >= p->cfg.max_split_size) mp_stat_inc(&p->stats.oversize_segments, 1);
    mp_trace_locked(p, MP_TRACE_SEGMENT_ALLOC, ptr, nbytes, s->handle);
    return b;
}

int mp_reserve_initial(mp_pool *p, size_t nbytes) {
    /* Expandable pools map it into their growing range, where it merges with what grows. */
    if (p->cfg.expandable_segments) return mp_expand_reserve_initial(p, nbytes);
    nbytes = (nbytes + MP_LARGE_ROUND - 1) & ~(MP_LARGE_ROUND - 1);
    mp_lock_acquire(&p->lock);
    mp_stream *s = mp_stream_get_locked(p, 0);
    int rc = MP_ENOMEM;
    if (s) {
        mp_release_list none = {0};
        uintptr_t ptr = 0;
        rc = upstream_segment_unlocked(p, s, nbytes, &none, &ptr);
        if (rc == MP_OK) {
            mp_block *b = new_segment_locked(p, s, KIND_LARGE, ptr, nbytes);
            if (b) {
                b->seg->pinned = 1;
                p->idle_bytes -= nbytes;   /* counted as idle unpinned when it was made */
                mp_insert_free_locked(p, b);
            } else {
                p->up.segment_free(p->up.ctx, ptr, nbytes, 0);
                rc = MP_ENOMEM;
            }
        }
    }
    mp_lock_release(&p->lock);
    return rc;
}

/* The fallback chain once the lists have no fit: garbage collection, the limit, the
 * upstream, then release what is cached and retry, then sync pending frees and retry.
 * Returns a free block in no list (a new segment's, or one that became free meanwhile). */
static int grow_locked(mp_pool *p, mp_stream *s, int kind, size_t size, mp_release_list *rel,
                       mp_block **out) {
    size_t seg_size = mp_segment_size(size);
    size_t limit = p->cfg.limit;
    /* Note [Graph capture]: during a capture releases skip themselves, and neither the sync
     * of pending frees nor the retries run: the limit, a capture-safe segment, else out of
     * memory. Asked only there (rel keeps the answer): a growth alone asks nothing. */

    if (p->nhot) {   /* Note [Hot blocks]: parked blocks may serve, or merge into, this */
        mp_hot_flush_locked(p);
        if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
    }
    if (p->cfg.gc_threshold > 0) {
        size_t base = limit != MP_UNLIMITED ? limit : p->capacity;
        size_t threshold = (size_t)(p->cfg.gc_threshold * (double)base);
        if (base && mp_reserved_now_locked(p) + seg_size > threshold)
            mp_release_idle_locked(p, mp_reserved_now_locked(p) + seg_size - threshold, rel);
    }
    if (limit != MP_UNLIMITED && mp_reserved_now_locked(p) + seg_size > limit) {
        mp_release_idle_locked(p, mp_reserved_now_locked(p) + seg_size - limit, rel);
        if (mp_reserved_now_locked(p) + seg_size > limit) {
            if (mp_capture_call_locked(p, rel)) return MP_ELIMIT;
            if (p->npending) {
                mp_sync_pending_unlocked(p);
                if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
            }
            mp_release_idle_locked(p, SIZE_MAX, rel);
            if (mp_reserved_now_locked(p) + seg_size > limit) return MP_ELIMIT;
        }
    }

    /* Release cached segments beyond need: idle segments cannot serve this request (the
     * search found nothing), so when they hold a new segment's worth, give that much back,
     * oldest first, before growing. Reserved memory then tracks what the work needs instead
     * of piling up segments of sizes it no longer asks for. */
    if (p->idle_bytes >= seg_size) mp_release_idle_kind_locked(p, kind, seg_size, rel);
    /* Note [Reserved high water] (docs/architecture.md): before reserving more than it ever
     * held, the pool gives back every idle segment of this kind, none of which could serve
     * the request, so a new peak is not set with idle segments beside it. */
    if (p->idle_bytes >= MP_HIGH_WATER_MIN_IDLE &&
        p->idle_bytes >= p->reserved_high_water / MP_HIGH_WATER_IDLE_DIV &&
        mp_reserved_now_locked(p) + seg_size > p->reserved_high_water)
        mp_release_idle_kind_locked(p, kind, 0, rel);

    uintptr_t ptr = 0;
    int rc = upstream_segment_unlocked(p, s, seg_size, rel, &ptr);
    if (rc == MP_ENOMEM && !mp_capture_call_locked(p, rel)) {
        /* Release just enough cached memory first, then everything, syncing pending frees. */
        for (int attempt = 0; attempt < 2 && rc == MP_ENOMEM; attempt++) {
            p->stats.num_alloc_retries++;
            if (attempt == 1) {
                mp_sync_pending_unlocked(p);
                if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
            }
            mp_release_idle_locked(p, attempt == 0 ? seg_size : SIZE_MAX, rel);
            if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
            rc = upstream_segment_unlocked(p, s, seg_size, rel, &ptr);
        }
    }
    if (rc != MP_OK) return rc;
    mp_block *b = new_segment_locked(p, s, kind, ptr, seg_size);
    if (!b) {
        /* No host memory for the bookkeeping: give the segment straight back (not during a
         * capture, Note [Graph capture]: then it is lost). */
        int capture = mp_capture_call_locked(p, rel);
        uintptr_t handle = s->handle;
        mp_lock_drop(p);
        void *blocking = mp_blocking_begin();
        if (!capture) p->up.segment_free(p->up.ctx, ptr, seg_size, handle);
        mp_blocking_end(blocking);
        mp_lock_retake(p);
        return MP_ENOMEM;
    }
    *out = b;
    return MP_OK;
}

/* The release of a torch allocation's count that could not be dropped under the lock it
 * held (Note [Torch table lifetime]): it must be the caller's last touch of the pool. */
static void torch_uncount(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    p->torch_blocks--;
    mp_lock_release(&p->lock);
}

/* mp_alloc, and for torch != 0 mp_alloc_torch: the allocation counts in torch_blocks from
 * the retired check on, so the table cannot retire the pool while it runs (the lock is
 * dropped to grow), and the block it returns is PyTorch's. */
static inline int alloc_impl(mp_pool *p, size_t nbytes, uintptr_t stream, int torch,
                             uintptr_t *out) {
    size_t size = nbytes > MP_MAX_ALLOC ? nbytes : mp_round_size(&p->cfg, nbytes);
    mp_release_list rel = {0};
    int rc = MP_OK;
    mp_lock_acquire(&p->lock);
    if (torch) {
        if (p->torch_retired) {
            mp_lock_release(&p->lock);
            return MP_ERETIRED;
        }
        p->torch_blocks++;
    }
    p->tick++;
    if (size > MP_MAX_ALLOC) {
        rc = MP_ENOMEM;
        goto oom;
    }
    mp_stream *s = mp_stream_get_locked(p, stream);
    if (!s) {
        rc = MP_ENOMEM;
        goto oom;
    }
    rel.stream = s;   /* Note [Graph capture] */
    /* Make room in the live map first, so nothing can fail after a block is chosen. */
    if (mp_ptrmap_reserve(&p->live, 1) != MP_OK) {
        rc = MP_ENOMEM;
        goto oom;
    }
    if (p->npending && !mp_capture_call_locked(p, &rel)) mp_process_pending_locked(p);

    int kind = size <= MP_SMALL_SIZE ? KIND_SMALL : KIND_LARGE;
    mp_block *b = s->hot ? take_hot_locked(p, s, size) : NULL;
    if (b) {
        /* Note [Hot blocks]: its segment stayed busy and it is in no list. */
        hand_out_locked(p, b, nbytes);
        b->torch = (uint8_t)torch;
        mp_trace_locked(p, MP_TRACE_ALLOC, b->ptr, b->requested, stream);
        *out = b->ptr;
        mp_lock_release(&p->lock);
        return MP_OK;
    }
    if (p->cfg.expandable_segments) {
        rc = mp_expand_alloc_locked(p, s, kind, size, &rel, &b);
    } else {
        b = mp_search_lists_locked(p, s, kind, size);
        if (!b) rc = grow_locked(p, s, kind, size, &rel, &b);
    }
    if (rc != MP_OK) goto oom;
    b = carve_locked(p, b, size, nbytes, s);
    b->torch = (uint8_t)torch;
    mp_trace_locked(p, MP_TRACE_ALLOC, b->ptr, b->requested, stream);
    *out = b->ptr;
    mp_apply_release_threshold_locked(p, &rel);
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return MP_OK;

oom:
    p->stats.num_ooms++;
    mp_trace_locked(p, MP_TRACE_OOM, 0, nbytes, stream);
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    if (torch) torch_uncount(p);
    return rc;
}

mp_blocking_begin_fn mp_blocking_begin_hook;
mp_blocking_end_fn mp_blocking_end_hook;

void mp_set_blocking_hooks(mp_blocking_begin_fn begin, mp_blocking_end_fn end) {
    mp_blocking_begin_hook = begin;
    mp_blocking_end_hook = end;
}

int mp_alloc(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    return alloc_impl(p, nbytes, stream, 0, out);
}

int mp_alloc_torch(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    return alloc_impl(p, nbytes, stream, 1, out);
}

int mp_torch_retire(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    int busy = p->torch_blocks != 0;
    if (!busy) p->torch_retired = 1;
    mp_lock_release(&p->lock);
    return busy ? MP_EBUSY : MP_OK;
}

void mp_torch_admit(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    p->torch_retired = 0;
    p->torch_kept = 1;
    mp_lock_release(&p->lock);
}

int64_t mp_torch_blocks(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    int64_t n = p->torch_blocks;
    mp_lock_release(&p->lock);
    return n;
}

/* ---------------------------------------------------------------- free */

/* The live block at ptr, or NULL. The pointer map also holds hot blocks (Note [Hot
 * blocks]), which are not live. */
static inline mp_block *live_block_locked(mp_pool *p, uintptr_t ptr) {
    mp_block *b = mp_ptrmap_get(&p->live, ptr);
    return b && b->state == MP_BLOCK_ALLOCATED ? b : NULL;
}

/* Why a pointer is not a live block: unknown, inside a block, or already freed. */
static int classify_bad_pointer_locked(mp_pool *p, uintptr_t ptr) {
    for (mp_segment *seg = p->segments; seg; seg = seg->next) {
        if (ptr < seg->ptr || ptr >= seg->ptr + seg->nbytes) continue;
        for (mp_block *b = seg->first; b; b = b->next) {
            if (ptr < b->ptr || ptr >= b->ptr + b->nbytes) continue;
            /* In free memory: freed already (its block may have merged since). */
            if (b->state != MP_BLOCK_ALLOCATED) return MP_EDOUBLEFREE;
            return ptr == b->ptr ? MP_OK : MP_EINTERIOR;
        }
        return MP_ENOTFOUND;   /* in an unmapped part of an expandable segment */
    }
    return MP_ENOTFOUND;
}

static void remove_use(mp_block *b, mp_stream *s) {
    for (uint16_t i = 0; i < b->nuses; i++) {
        if (b->uses[i] == s) {
            b->uses[i] = b->uses[--b->nuses];
            return;
        }
    }
}

static int has_use(const mp_block *b, const mp_stream *s) {
    for (uint16_t i = 0; i < b->nuses; i++)
        if (b->uses[i] == s) return 1;
    return 0;
}

/* Room for one more recorded stream on b (MP_ENOMEM / MP_EINVAL when there is none). */
static int reserve_use(mp_block *b) {
    if (b->nuses < b->cap_uses) return MP_OK;
    if (b->cap_uses >= MP_MAX_RECORDED_STREAMS) return MP_EINVAL;
    uint16_t cap = (uint16_t)(b->cap_uses * 2);
    mp_stream **grown = malloc(cap * sizeof *grown);
    if (!grown) return MP_ENOMEM;
    memcpy(grown, b->uses, b->nuses * sizeof *grown);
    if (b->uses != b->inline_uses) free(b->uses);
    b->uses = grown;
    b->cap_uses = cap;
    return MP_OK;
}

static void pending_push_locked(mp_pool *p, mp_block *b) {
    b->fprev = p->pending_tail;
    b->fnext = NULL;
    if (p->pending_tail) p->pending_tail->fnext = b;
    else p->pending_head = b;
    p->pending_tail = b;
    p->npending++;
}

static void pending_remove_locked(mp_pool *p, mp_block *b) {
    if (b->fprev) b->fprev->fnext = b->fnext;
    else p->pending_head = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    else p->pending_tail = b->fprev;
    b->fprev = b->fnext = NULL;
    p->npending--;
}

static void complete_free_locked(mp_pool *p, mp_block *b) {
    count_free_completed_locked(p, b);
    mp_free_block_locked(p, b);
}

/* Note [Stream reuse]: record an event on each stream that used b (events[], one per use),
 * keeping the uses whose stream has not yet passed this point. A use whose event cannot be
 * had keeps events[i] == 0 and must be synchronized instead, without the lock (Note [Lock
 * order]): the count of those is returned, for sync_uses_unlocked. Sets b->nuses and
 * b->events (NULL, with events freed, when no use is left). */
static uint16_t record_uses_locked(mp_pool *p, mp_block *b, uintptr_t *events) {
    uint16_t n = 0, nsync = 0;
    for (uint16_t i = 0; i < b->nuses; i++) {
        uintptr_t ev;
        int got = mp_event_get_locked(p, &ev) == MP_OK;
        if (got && mp_up_record(p, ev, b->uses[i]->handle) == MP_OK) {
            if (p->up.event_query(p->up.ctx, ev) == MP_OK) {
                mp_event_put_locked(p, ev);   /* that stream is past the free already */
                continue;
            }
        } else {
            if (got) mp_event_put_locked(p, ev);
            ev = 0;
            nsync++;
        }
        b->uses[n] = b->uses[i];
        events[n++] = ev;
    }
    b->nuses = n;
    b->events = n ? events : NULL;
    if (!n) free(events);
    return nsync;
}

static int record_deferred_locked(mp_pool *p, mp_block *b);

int mp_process_pending_locked(mp_pool *p) {
    if (mp_capture_stream_locked(p, NULL)) return MP_OK;   /* Note [Graph capture]: no query */
    mp_block *b = p->pending_head;
    while (b) {
        mp_block *next = b->fnext;
        if (!b->events) {
            int r = record_deferred_locked(p, b);
            if (r == 0) {
                b = next;
                continue;
            }
            if (r == 2) {   /* the lock was dropped to synchronize: the list may have changed */
                b = p->pending_head;
                continue;
            }
        }
        int done = !b->busy;   /* busy: its freeing thread is synchronizing a stream */
        for (uint16_t i = 0; i < b->nuses && done; i++) {
            if (p->up.event_query(p->up.ctx, b->events[i]) != MP_OK) done = 0;
        }
        if (done) {
            pending_remove_locked(p, b);
            for (uint16_t i = 0; i < b->nuses; i++) mp_event_put_locked(p, b->events[i]);
            free(b->events);
            b->events = NULL;
            b->nuses = 0;
            complete_free_locked(p, b);
        }
        b = next;
    }
    return MP_OK;
}

/* mp_free's fallback for the streams of pending block b it had no event for (events[i] ==
 * 0, nsync of them): synchronize them with the lock dropped (Note [Lock order]), then drop
 * those uses and complete the free when no other use is left. The block is marked busy
 * meanwhile, so that no other thread completes it; a forget_stream of one of those streams
 * may drop its use meanwhile (Note [Forgotten streams]). */
static void sync_uses_unlocked(mp_pool *p, mp_block *b, uint16_t nsync) {
    uintptr_t handles[8], *h = nsync <= 8 ? handles : malloc(nsync * sizeof *h);
    uint16_t n = 0;
    for (uint16_t i = 0; i < b->nuses; i++) {
        if (b->events[i]) continue;
        if (h) h[n++] = b->uses[i]->handle;
        else mp_up_sync(p, b->uses[i]->handle);   /* no host memory */
    }
    if (n) {
        b->busy = 1;
        mp_lock_drop(p);
        void *blocking = mp_blocking_begin();
        for (uint16_t i = 0; i < n; i++) mp_up_sync(p, h[i]);
        mp_blocking_end(blocking);
        mp_lock_retake(p);
        b->busy = 0;
    }
    if (h != handles) free(h);
    uint16_t kept = 0;
    for (uint16_t i = 0; i < b->nuses; i++) {
        if (!b->events[i]) continue;
        b->uses[kept] = b->uses[i];
        b->events[kept++] = b->events[i];
    }
    b->nuses = kept;
    if (!kept) {
        pending_remove_locked(p, b);
        free(b->events);
        b->events = NULL;
        complete_free_locked(p, b);
    }
}

/* Note [Graph capture]: the events of a free deferred during a capture, recorded once no
 * capture touches its streams. 0: still deferred; 1: recorded; 2: a stream had to be
 * synchronized, with the lock dropped meanwhile (the caller's list walk starts again). */
static int record_deferred_locked(mp_pool *p, mp_block *b) {
    if (mp_capture_uses_locked(p, b)) return 0;
    uintptr_t *events = malloc(b->nuses * sizeof *events);
    if (!events) return 0;
    uint16_t nsync = record_uses_locked(p, b, events);
    if (!nsync) {
        if (!b->nuses) {
            pending_remove_locked(p, b);
            complete_free_locked(p, b);
            return 2;   /* the walk's next pointer may have been merged away */
        }
        return 1;
    }
    sync_uses_unlocked(p, b, nsync);
    return 2;
}

int mp_free(mp_pool *p, uintptr_t ptr, uintptr_t stream, int has_stream) {
    mp_release_list rel = {0};
    mp_lock_acquire(&p->lock);
    p->tick++;
    mp_block *b = live_block_locked(p, ptr);
    if (!b) {
        int rc = classify_bad_pointer_locked(p, ptr);
        mp_lock_release(&p->lock);
        return rc == MP_OK ? MP_ENOTFOUND : rc;
    }
    mp_stream *fs = has_stream ? mp_stream_get_locked(p, stream) : b->stream;
    /* Freed on another stream: that stream's use is the last one ordered by the caller,
     * but work the owner queued may still be pending, so the owner becomes a use, waited
     * for like a recorded stream, and the block then belongs to the freeing stream. */
    int moving = fs && fs != b->stream;
    int rc = fs ? MP_OK : MP_ENOMEM;
    if (moving) rc = reserve_use(b);
    size_t nuses_after = b->nuses + (size_t)moving - (size_t)(moving && has_use(b, fs));
    uintptr_t *events = NULL;
    if (rc == MP_OK && nuses_after && !(events = malloc(nuses_after * sizeof *events))) rc = MP_ENOMEM;
    if (rc != MP_OK) {
        mp_lock_release(&p->lock);
        return rc;   /* nothing changed: the block is still live */
    }
    if (moving) {
        remove_use(b, fs);
        b->uses[b->nuses++] = b->stream;
    }
    /* Nothing can fail from here on. */
    rel.stream = fs;   /* Note [Graph capture] */
    int torch = b->torch;   /* Note [Torch table lifetime]: uncounted at the very end */
    b->torch = 0;
    int park = !b->nuses && hot_allowed(p);   /* Note [Hot blocks]: keeps its map entry */
    if (!park) mp_ptrmap_remove(&p->live, ptr);
    int kind = b->seg->kind;
    mp_stat3_dec(p->stats.allocation, kind, 1);
    mp_stat3_dec(p->stats.allocated_bytes, kind, (int64_t)b->nbytes);
    if (b->nbytes >= p->cfg.max_split_size) mp_stat_dec(&p->stats.oversize_allocations, 1);
    mp_trace_locked(p, MP_TRACE_FREE_REQUESTED, b->ptr, b->requested, fs->handle);
    /* The freeing stream owns the block from now on (stream-ordered free, as cudaFreeAsync). */
    b->stream = fs;
    if (!b->nuses) {
        if (park) park_hot_locked(p, b);
        else complete_free_locked(p, b);
    } else {
        b->state = MP_BLOCK_PENDING;
        if (mp_capture_uses_locked(p, b)) {
            free(events);   /* Note [Graph capture]: recorded once the capture is over */
            pending_push_locked(p, b);
        } else {
            uint16_t nsync = record_uses_locked(p, b, events);
            if (nsync) {
                pending_push_locked(p, b);
                sync_uses_unlocked(p, b, nsync);
            } else if (b->nuses) {
                pending_push_locked(p, b);
            } else {
                complete_free_locked(p, b);
            }
        }
    }
    mp_apply_release_threshold_locked(p, &rel);
    if (torch && !rel.head) {   /* nothing left to do with the pool after the unlock */
        p->torch_blocks--;
        torch = 0;
    }
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    if (torch) torch_uncount(p);
    return MP_OK;
}

int mp_record_stream(mp_pool *p, uintptr_t ptr, uintptr_t stream) {
    mp_lock_acquire(&p->lock);
    mp_block *b = live_block_locked(p, ptr);
    int rc = MP_OK;
    if (!b) {
        rc = classify_bad_pointer_locked(p, ptr);
        if (rc == MP_OK) rc = MP_ENOTFOUND;
        goto done;
    }
    mp_stream *s = mp_stream_get_locked(p, stream);
    if (!s) {
        rc = MP_ENOMEM;
        goto done;
    }
    if (s == b->stream || has_use(b, s)) goto done;
    if ((rc = reserve_use(b)) == MP_OK) b->uses[b->nuses++] = s;
done:
    mp_lock_release(&p->lock);
    return rc;
}

int mp_block_info(mp_pool *p, uintptr_t ptr, size_t *nbytes, size_t *requested,
                  uintptr_t *stream) {
    mp_lock_acquire(&p->lock);
    mp_block *b = live_block_locked(p, ptr);
    int rc = MP_ENOTFOUND;
    if (b) {
        if (nbytes) *nbytes = b->nbytes;
        if (requested) *requested = b->requested;
        if (stream) *stream = b->stream->handle;
        rc = MP_OK;
    }
    mp_lock_release(&p->lock);
    return rc;
}

/* ---------------------------------------------------------------- streams going away */

/* Re-merge free neighbours of one owner after ownership moved (in lists, classes right). */
static void remerge_segment_locked(mp_pool *p, mp_segment *seg) {
    for (mp_block *b = seg->first; b; b = b->next) {
        while (b->state == MP_BLOCK_FREE && mergeable(b, b->next)) {
            mp_remove_free_locked(p, b);
            merge_locked(p, b, b->next);
            mp_insert_free_locked(p, b);
        }
    }
}

/* Note [Forgotten streams] (docs/architecture.md): hand everything the pool keeps on s,
 * which has no work left, to the legacy stream, and release s's expandable ranges that hold
 * nothing else. Afterwards nothing of the pool refers to s. */
static void hand_over_stream_locked(mp_pool *p, mp_stream *s, mp_stream *legacy,
                                    mp_release_list *rel) {
    if (s->hot) hot_flush_stream_locked(p, s);
    /* Pending frees waiting on s: its events have completed (s was synchronized). */
    for (mp_block *b = p->pending_head; b; b = b->fnext) {
        if (!b->events) continue;   /* deferred during a capture: below */
        for (uint16_t i = 0; i < b->nuses;) {
            if (b->uses[i] != s) {
                i++;
                continue;
            }
            if (b->events[i]) mp_event_put_locked(p, b->events[i]);
            b->nuses--;
            b->uses[i] = b->uses[b->nuses];
            b->events[i] = b->events[b->nuses];
        }
    }
    /* Note [Graph capture]: a free deferred during a capture would record an event on s
     * later, on a dead handle; s is synchronized, so its use is over now. */
    for (mp_block *b = p->pending_head, *next; b; b = next) {
        next = b->fnext;   /* pending too: a completed free merges only free neighbours */
        if (b->events) continue;
        remove_use(b, s);
        if (!b->nuses) {
            pending_remove_locked(p, b);
            complete_free_locked(p, b);
        }
    }
    if (p->npending) mp_process_pending_locked(p);
    for (mp_segment *seg = p->segments, *next; seg; seg = next) {
        next = seg->next;
        if (seg->expandable && seg->stream == s && mp_expand_detach_range_locked(p, seg, s, rel)) {
            for (int k = 0; k < 2; k++)
                if (s->expandable[k] == seg) s->expandable[k] = NULL;
        }
    }
    for (mp_segment *seg = p->segments; seg; seg = seg->next) {
        int moved = 0;
        if (seg->stream == s) seg->stream = legacy;
        for (mp_block *b = seg->first; b; b = b->next) {
            if (b->state == MP_BLOCK_ALLOCATED) remove_use(b, s);
            if (b->stream != s) continue;
            moved = 1;
            if (b->state == MP_BLOCK_FREE) {
                mp_remove_free_locked(p, b);
                b->stream = legacy;
                mp_insert_free_locked(p, b);
            } else {
                b->stream = legacy;
            }
        }
        if (moved) remerge_segment_locked(p, seg);
    }
    /* A range that keeps blocks grows on for the legacy stream when that has none of its
     * kind; otherwise it grows no more, and goes once empty (mp_release_idle_locked). */
    for (int k = 0; k < 2; k++) {
        mp_segment *seg = s->expandable[k];
        if (!seg) continue;
        if (!legacy->expandable[k]) legacy->expandable[k] = seg;
        else seg->growing = 0;
        s->expandable[k] = NULL;
    }
}

/* Note [Forgotten streams]: free the structs of forgotten streams once no operation that
 * dropped the lock may still hold a pointer to one; hand over first what such operations
 * gave them meanwhile. */
static void reap_dead_locked(mp_pool *p, mp_release_list *rel) {
    if (!p->dead || p->nunlocked) return;
    mp_stream *legacy = mp_stream_get_locked(p, 0);
    if (!legacy) return;   /* out of host memory: a later call reaps them */
    while (p->dead) {
        mp_stream *d = p->dead;
        p->dead = d->next_dead;
        p->ndead--;
        hand_over_stream_locked(p, d, legacy, rel);
        free(d);
    }
}

static mp_stream *find_stream_locked(mp_pool *p, uintptr_t handle, size_t *index) {
    for (size_t i = 0; i < p->nstreams; i++) {
        if (p->streams[i]->handle == handle) {
            *index = i;
            return p->streams[i];
        }
    }
    return NULL;
}

int mp_forget_stream(mp_pool *p, uintptr_t handle) {
    if (handle == 0) return MP_OK;   /* the legacy stream is never destroyed */
    mp_release_list rel = {0};
    size_t i;
    mp_lock_acquire(&p->lock);
    reap_dead_locked(p, &rel);
    mp_stream *known = find_stream_locked(p, handle, &i);
    /* Note [Graph capture]: a capturing stream cannot be synchronized. */
    int capture = known && mp_capture_stream_locked(p, known);
    if (known && !capture && p->capture_seen == known) p->capture_seen = NULL;   /* may die */
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    if (!known) return MP_OK;
    if (capture) return MP_EBUSY;
    /* The stream is still alive here: let its queued work finish, then nothing of the pool
     * needs ordering on it again. */
    void *blocking = mp_blocking_begin();
    int rc = mp_up_sync(p, handle);
    mp_blocking_end(blocking);
    mp_lock_acquire(&p->lock);
    /* Found again: another thread may have forgotten it meanwhile. */
    mp_stream *s = find_stream_locked(p, handle, &i);
    mp_stream *legacy = s && rc == MP_OK ? mp_stream_get_locked(p, 0) : NULL;
    if (!legacy) {
        mp_lock_release(&p->lock);
        if (!s) return MP_OK;
        return rc == MP_OK ? MP_ENOMEM : rc;
    }
    hand_over_stream_locked(p, s, legacy, &rel);
    p->streams[i] = p->streams[--p->nstreams];
    if (p->last_stream == s) p->last_stream = NULL;
    if (p->nunlocked) {
        /* Another operation dropped the lock holding stream pointers, maybe this one:
         * keep the struct until none does, on the legacy handle, which never dies. */
        s->handle = 0;
        s->next_dead = p->dead;
        p->dead = s;
        p->ndead++;
    } else {
        free(s);
    }
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return MP_OK;
}

/* ---------------------------------------------------------------- allocation at an address */

/* Note [Allocation at an address] (docs/architecture.md): PyTorch's cudagraph trees restore a
 * graph pool to a checkpoint, which puts blocks back at the addresses a recorded graph uses.
 * The block holding [ptr, ptr + nbytes) must be free: its head, when ptr is inside it, stays
 * free with its owner; the rest is carved as any allocation on `stream`. */
int mp_alloc_at(mp_pool *p, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    if (nbytes == 0 || (ptr & (MP_MIN_BLOCK - 1)) || nbytes > MP_MAX_ALLOC) return MP_EINVAL;
    size_t size = (nbytes + MP_MIN_BLOCK - 1) & ~(MP_MIN_BLOCK - 1);
    int rc = MP_OK;
    mp_lock_acquire(&p->lock);
    mp_stream *s = mp_stream_get_locked(p, stream);
    if (!s || mp_ptrmap_reserve(&p->live, 1) != MP_OK) {
        rc = MP_ENOMEM;
        goto out;
    }
    mp_hot_flush_locked(p);
    if (p->npending) mp_process_pending_locked(p);
    mp_segment *seg = p->segments;
    while (seg && !(ptr >= seg->ptr && ptr < seg->ptr + seg->nbytes)) seg = seg->next;
    mp_block *b = seg ? seg->first : NULL;
    while (b && !(ptr >= b->ptr && ptr < b->ptr + b->nbytes)) b = b->next;
    if (!b) {
        rc = MP_ENOTFOUND;
        goto out;
    }
    if (b->state != MP_BLOCK_FREE || ptr + size > b->ptr + b->nbytes) {
        rc = MP_EBUSY;
        goto out;
    }
    if (b->ptr < ptr) {
        mp_block *head = mp_block_new_locked(p);
        if (!head) {
            rc = MP_ENOMEM;
            goto out;
        }
        if (b->cls != MP_NOT_LISTED) mp_remove_free_locked(p, b);
        head->ptr = b->ptr;
        head->nbytes = ptr - b->ptr;
        head->seg = seg;
        head->stream = b->stream;
        head->prev = b->prev;
        head->next = b;
        if (b->prev) b->prev->next = head;
        else seg->first = head;
        b->prev = head;
        b->ptr = ptr;
        b->nbytes -= head->nbytes;
        mp_insert_free_locked(p, head);
    }
    p->tick++;
    b = carve_locked(p, b, size, size, s);
    mp_trace_locked(p, MP_TRACE_ALLOC, b->ptr, b->requested, stream);
out:
    mp_lock_release(&p->lock);
    return rc;
}
