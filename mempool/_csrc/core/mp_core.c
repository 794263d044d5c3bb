/* The allocate/free path of the core: pool lifetime and the fallback chain (hot block, free
 * lists, other streams' blocks, a new segment, release and retry). The size policy is in
 * mp_size.h, blocks (carve, merge, hot blocks) in mp_block.c, streams and events (pending
 * frees, record/forget) in mp_stream.c, free lists in mp_freelist.c, release of cached
 * memory in mp_release.c, invariants and layout copies in mp_inspect.c, trace recording in
 * mp_trace.c, expandable segments in mp_expand.c. */

/* Note [Lock order]
 * One lock per pool (a spinlock that yields, mp_lock.h: an uncontended round trip is one
 * atomic exchange and one store) guards the core. The GIL, if held, comes before the pool
 * lock; nothing in the core takes the GIL, so the PyTorch allocator entry points and DLPack
 * deleters run without it.
 *
 * The lock is dropped around every call that may take long or block (segment allocation and
 * release, stream synchronization, page map and unmap) through the *_unlocked helpers, with
 * in-flight bytes counted against `limit` and unmapped blocks being mapped marked busy; a
 * Pool method lets the GIL go there too (Note [Blocking upstream calls]). Events are made
 * with the lock dropped too (Note [Events outside the lock]); recording, querying and
 * waiting on them are short and made with the lock held. Where no event can be had (event
 * creation or recording fails), the stream it was for is synchronized instead, and never
 * under the lock either: a free marks its block busy (pending, so no other thread completes
 * it), drops the lock to sync, and completes the free after; a segment release notes the
 * stream in the detached segment and syncs it before the upstream free (the sim's
 * fail_events and hold_syncs test both). Functions that expect the lock held end in _locked. */

#include <stdlib.h>
#include <string.h>

#include "mp_block.h"
#include "mp_capture.h"
#include "mp_expand.h"
#include "mp_stream.h"

/* ---------------------------------------------------------------- config */

void mp_config_default(mp_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->max_split_size = MP_UNLIMITED;
    cfg->cross_stream_reuse = 1;
    cfg->release_threshold = MP_UNLIMITED;
    cfg->limit = MP_UNLIMITED;
}

void mp_set_capture_reuse(mp_pool *p, int on) {
    mp_lock_acquire(&p->lock);
    p->cfg.capture_reuse = on != 0;   /* blocks marked before keep their markers */
    mp_lock_release(&p->lock);
}

/* Note [No split]
 * PyTorch's MemPool(no_split=True) asks that no block of its pool be split: each request
 * takes a whole free block, or a whole new segment sized by the usual policy (2 MiB for a
 * small request, 20 MiB up to 10 MiB, the request rounded to 2 MiB above), so that every
 * tensor starts a segment of its own, as memory registered segment by segment (NCCL's
 * symmetric memory) wants. The pool then carves nothing off a block it hands out; best fit,
 * merging (nothing is split, so nothing merges) and releases are as before, and a block's
 * size in the statistics is the whole block, as in PyTorch's. Expandable pools refuse it:
 * their free blocks include the unmapped rest of a range. */
int mp_set_no_split(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    int ok = !p->cfg.expandable_segments;
    if (ok) p->cfg.no_split = 1;
    mp_lock_release(&p->lock);
    return ok ? MP_OK : MP_EINVAL;
}

/* Note [Size policy at run time]
 * PyTorch lets a program change roundup_power2_divisions, max_split_size and
 * garbage_collection_threshold while it runs (torch.cuda.memory._set_allocator_settings), and
 * mp_set_size_policy does the same for a pool. Each is read only under the pool lock (the
 * rounding of a request too), so a change applies from the next request on, and blocks and
 * segments already made keep their sizes. max_split_size also decides what the oversize
 * counters count, and a block counted as oversize when it was handed out must be
 * uncounted at its free whatever the threshold is by then (PyTorch's allocator compares
 * with the threshold of the moment, and its counters drift): so each block and segment
 * remembers whether it was counted. Expandable pools ignore max_split_size, as at
 * creation: it must stay unlimited there. */
int mp_set_size_policy(mp_pool *p, const size_t divisions[MP_ROUNDUP_INTERVALS],
                       size_t max_split_size, double gc_threshold) {
    if (!(gc_threshold >= 0 && gc_threshold < 1)) return MP_EINVAL;   /* NaN too */
    if (p->cfg.expandable_segments && max_split_size != MP_UNLIMITED) return MP_EINVAL;
    mp_lock_acquire(&p->lock);
    /* A parked block would serve the next request of its size as the old policy left it,
     * unmerged: folded in, the free lists answer under the new one (Note [Hot blocks]). */
    mp_hot_flush_locked(p);
    memcpy(p->cfg.roundup_divisions, divisions, sizeof p->cfg.roundup_divisions);
    p->cfg.max_split_size = max_split_size;
    p->cfg.gc_threshold = gc_threshold;
    mp_lock_release(&p->lock);
    return MP_OK;
}

/* ---------------------------------------------------------------- pool lifetime */

int mp_pool_create(const mp_config *cfg, const mp_upstream *up, mp_pool **out) {
    if (cfg->gc_threshold < 0 || cfg->gc_threshold >= 1) return MP_EINVAL;
    if (cfg->expandable_segments && !up->map) return MP_EUNSUPPORTED;
    mp_pool *p = mp_calloc_lines(sizeof *p);   /* Note [Hot lines] */
    if (!p) return MP_ENOMEM;
    mp_lock_init(&p->lock);
    mp_fork_register(p);   /* Note [Pools across fork] */
    p->refcount = 1;
    p->cfg = *cfg;
    p->up = *up;
    if (mp_ptrmap_init(&p->live, 1024) != MP_OK) {
        mp_fork_unregister(p);
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
    mp_fork_unregister(p);
    if (p->inherited) return;   /* Note [Pools across fork]: the parent's; nothing is ours */
    mp_mapper_stop(p);   /* Note [Mapper]: before anything it may touch goes */
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
            free(b->markers);
            b = bn;
        }
        seg->release_stream = legacy ? 0 : seg->stream->handle;
        mp_trace_segment_gone_locked(p, seg);   /* Note [Segment events at destroy] */
        if (__atomic_load_n(&mp_release_observer_fn, __ATOMIC_ACQUIRE)) {
            mp_lock_drop(p);   /* Note [Release observer] (mp_core.h): told with no lock held;
                                  nothing else can reach a pool being destroyed */
            mp_tell_release_observer(p);
            mp_lock_retake(p);
        }
        mp_segment_release_upstream(p, seg);
        free(seg->extents);
        free(seg);
        seg = next;
    }
    for (size_t i = 0; i < p->nevent_cache; i++) p->up.event_destroy(p->up.ctx, p->event_cache[i]);
    free(p->event_cache);
    for (size_t i = 0; i < p->nstreams; i++) free(p->streams[i]);
    free(p->streams);
    free(p->stab);
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
    int kept = p->keep_struct;
    /* Note [Shared limit]: its segments went upstream without their counters: take its
     * share of the owner's limit back, and the reference it held. */
    mp_pool *owner = p->limit_owner;
    if (owner) {
        __atomic_sub_fetch(&owner->limit_held, p->limit_published, __ATOMIC_RELAXED);
        __atomic_sub_fetch(&owner->limit_members, 1, __ATOMIC_RELAXED);
    }
    mp_lock_release(&p->lock);
    if (owner) mp_pool_release(owner);
    mp_share_close_all(p);
    if (p->up.destroy) p->up.destroy(p->up.ctx);
    /* Note [Block tallies]: a pool that was in a table leaves its struct behind, for a
     * caller that read it from the table just before it left. */
    if (!kept) free(p);
}

void mp_pool_keep_struct(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    p->keep_struct = 1;
    mp_lock_release(&p->lock);
}

void mp_pool_retain(mp_pool *p) { __atomic_add_fetch(&p->refcount, 1, __ATOMIC_RELAXED); }

void mp_pool_release(mp_pool *p) {
    if (__atomic_sub_fetch(&p->refcount, 1, __ATOMIC_ACQ_REL) == 0) mp_pool_destroy(p);
}

/* ---------------------------------------------------------------- allocation */

/* Note [Released before a growth]
 * A fixed segment goes upstream in stream order (cudaFreeAsync): the cudaMemPool holds its
 * memory until the work queued before the free has run, and gives it back to the device at
 * a synchronization (the Pool sets its release threshold to 0). A growth that first
 * releases idle segments (garbage collection, the limit, release beyond need,
 * Note [Reserved high water], an OOM's retry) asks for a segment none of them could hold,
 * so the driver cannot reuse their memory for it: while their streams still had work
 * queued, the device held the released segments and the new one at once, more than the
 * Pool counted (training loops, whose streams are busy, showed it; replays, whose streams
 * are idle, did not: bench/results/history.md). So once the frees are queued, each stream
 * they were queued on that still has work (cuStreamQuery) is synchronized, not while
 * capturing (Note [Graph capture]), and the segment is allocated after: the device holds
 * what the Pool counts. An idle stream is not: its frees have run, and the driver reuses
 * their memory for the new segment without giving it back first, which a sync (with
 * threshold 0) would make it do, only to map new memory again. At most one sync per stream
 * and growth that releases; such growths set records or follow a change of sizes, never a
 * steady loop (PyTorch's allocator synchronizes the device at every cudaFree). The sim
 * keeps frees behind queued work as the driver does (Note [Frees the driver keeps],
 * mp_sim.c), so tests see the difference. */
/* Drop the lock, free what `rel` detached, ask the upstream for a segment, take the lock
 * again. The bytes in flight count against the limit meanwhile. */
static int upstream_segment_unlocked(mp_pool *p, mp_stream *s, size_t nbytes,
                                     mp_release_list *rel, uintptr_t *ptr) {
    p->inflight_bytes += nbytes;
    mp_publish_held_locked(p);
    uintptr_t handle = s->handle;
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    if (rel->head) {   /* Note [Released before a growth] */
        size_t n;
        uintptr_t *streams = mp_release_streams(rel, &n);   /* before the segments are gone */
        rel->waited = streams != NULL;   /* their streams are waited for below */
        mp_release_finish(p, rel);
        rel->waited = 0;
        for (size_t j = 0; j < n; j++) {
            if (mp_capture_handle(p, streams[j])) continue;   /* Note [Graph capture] */
            /* idle: the frees have run, nothing to wait for */
            if (p->up.stream_query && mp_up_query(p, streams[j]) == MP_OK) continue;
            mp_up_sync(p, streams[j]);
        }
        free(streams);
    }
    int rc = p->up.segment_alloc(p->up.ctx, nbytes, handle, ptr);
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    p->inflight_bytes -= nbytes;
    mp_publish_held_locked(p);
    return rc;
}

/* Block the host on every stream that pending blocks wait for, then return those blocks.
 * The last resort before an OOM: it syncs only the streams that hold memory back. */
void mp_sync_pending_unlocked(mp_pool *p) {
    if (!p->npending || mp_capture_stream_locked(p, NULL)) return;   /* Note [Graph capture] */
    size_t n = 0, cap = 0;
    uintptr_t *handles = NULL;   /* best effort without host memory: fewer streams synced */
    for (mp_block *b = p->pending_head; b; b = b->fnext)
        for (uint16_t i = 0; i < b->nuses; i++)
            (void)mp_add_distinct_handle(&handles, &n, &cap, b->uses[i]->handle);
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

/* Note [The last try waits for the device]
 * Segments released earlier behind queued work (a release threshold's or a trim's frees,
 * stream-ordered and never waited for) stay the device's until that work has run (Note
 * [Frees the driver keeps], mp_sim.c): a growth on another stream can then find the device
 * full with nothing left to release, and fail although one wait would make it fit. So the
 * last try of the out-of-memory retry waits for the whole device first, as PyTorch's ends
 * in a cudaFree, which does. It waits only when some plain segment was released behind
 * work that nobody waited for since the last such wait (released_unwaited, set where the
 * release is finished), so an out-of-memory with nothing of the kind costs no wait, and
 * never during a capture (the caller checks): a capture refuses the wait. Counted in
 * num_sync_all_streams. */
static void sync_device_unlocked(mp_pool *p) {
    if (!p->up.device_synchronize || !__atomic_load_n(&p->released_unwaited, __ATOMIC_RELAXED))
        return;
    p->stats.num_sync_all_streams++;
    __atomic_store_n(&p->released_unwaited, 0, __ATOMIC_RELAXED);
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    (void)p->up.device_synchronize(p->up.ctx);
    mp_blocking_end(blocking);
    mp_lock_retake(p);
}

size_t mp_reserved_now_locked(const mp_pool *p) {
    return (size_t)mp_stat3_current(p->stats.reserved_bytes) + p->inflight_bytes +
           p->releasing_bytes;   /* Note [Releases in flight] */
}

mp_block *mp_search_lists_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    mp_block *b = mp_freelist_find_fit(p, &s->lists[kind], size);
    if (b) return b;   /* still in its list: mp_carve_locked takes it out, or shrinks it */
    if (p->cfg.cross_stream_reuse && p->nstreams > 1) {
        if (p->nhot) mp_hot_flush_locked(p);   /* Note [Hot blocks]: other streams' too */
        return mp_take_from_other_stream_locked(p, s, kind, size);
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
    mp_block_join(b, seg);
    b->stream = s;
    b->state = MP_BLOCK_FREE;
    mp_segment_idle_push_locked(p, seg);   /* idle until its first block is handed out */
    p->stats.num_device_alloc++;
    mp_stat3_inc(p->stats.segment, kind, 1);
    mp_stat3_inc(p->stats.reserved_bytes, kind, (int64_t)nbytes);
    mp_publish_held_locked(p);
    if (mp_reserved_now_locked(p) > p->reserved_high_water)
        p->reserved_high_water = mp_reserved_now_locked(p);
    seg->oversize = nbytes >= p->cfg.max_split_size;
    if (seg->oversize) mp_stat_inc(&p->stats.oversize_segments, 1);
    mp_trace_segment_locked(p, MP_TRACE_SEGMENT_ALLOC, ptr, nbytes, s->handle);
    return b;
}

static size_t rounded_segment(const mp_pool *p, int kind, size_t request, size_t plain);

int mp_reserve_initial(mp_pool *p, size_t nbytes) {
    /* Expandable pools map it into their growing range, where it merges with what grows. */
    if (p->cfg.expandable_segments) return mp_expand_reserve_initial(p, nbytes);
    size_t plain = (nbytes + MP_LARGE_ROUND - 1) & ~(MP_LARGE_ROUND - 1);
    mp_lock_acquire(&p->lock);
    /* Note [Segment rounding]: sized as every other segment, unless the pool has a limit or
     * the device refuses it. */
    nbytes = rounded_segment(p, KIND_LARGE, SIZE_MAX, plain);   /* serves no one request */
    mp_stream *s = mp_stream_get_locked(p, 0);
    int rc = MP_ENOMEM;
    if (s) {
        mp_release_list none = {0};
        uintptr_t ptr = 0;
        rc = upstream_segment_unlocked(p, s, nbytes, &none, &ptr);
        if (rc == MP_ENOMEM && nbytes > plain) {
            nbytes = plain;
            rc = upstream_segment_unlocked(p, s, nbytes, &none, &ptr);
        }
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

/* Note [Reserved high water]
 * Best fit leaves idle segments of sizes the work no longer asks for, and "release beyond
 * need" gives them back only when they hold a whole new segment's worth, so a peak could be
 * set with a large segment idle beside it. Before a pool of fixed segments reserves more
 * than it ever held at once (reserved_high_water, the pool's own mark, never reset), it
 * gives back every idle segment of the request's kind, none of which could serve it, when
 * the idle segments hold at least MP_HIGH_WATER_MIN_IDLE and 1/MP_HIGH_WATER_IDLE_DIV of
 * the mark, as the expandable high-water rule (Note [Expandable segments]). It acts only
 * while the footprint sets records, so a steady loop never pays for it. Figures:
 * bench/results/history.md. */

/* Note [Keep idle]
 * A pool with keep_idle gives no idle segment back on its own: a growth neither releases
 * beyond need nor at the high-water mark, and garbage collection and the limit release
 * nothing (over the limit it refuses). mp_empty_cache, mp_trim and a release threshold the
 * owner sets give memory back, and out of memory outside a capture still releases and
 * retries, as PyTorch's allocator frees a pool's cached blocks before it reports one
 * (during a capture nothing is released in any pool, Note [Graph capture]).
 * The private pools of the torch glue are made so (mp_torch_private_config, mp_torch.c):
 * the free blocks of a live CUDA graph's pool are the capture's intermediates, which every
 * replay writes, and a segment of them given back would be memory the graph writes after
 * it is freed. PyTorch's allocator gives a graph's pool back only once the graph is gone;
 * the glue empties a private pool only then (emptyCache, releasePool). Fixed segments
 * only: private pools are never expandable. */

/* Note [Segment rounding]
 * A plain fixed segment of the large pool is the request rounded to 2 MiB (20 MiB under
 * 10 MiB), and of the small pool 2 MiB, as PyTorch's allocator makes them. The
 * segment_rounding option makes fixed segments whole multiples of its value once the pool
 * is large: fewer and larger segments, so fewer upstream calls, and tails that later
 * requests split. On cuda the segments come from a cudaMemPool that backs them with chunks
 * of its own, and by default the Pool rounds to that chunk (Note [The cudaMemPool's unit],
 * mempool/_cuda.py), so that each segment is whole chunks and what the Pool reserves is
 * what the device holds.
 *
 * A small pool keeps plain segments: while the pool with the new segment holds at most
 * MP_PLAIN_UNITS units, the segment is the plain one. There the cudaMemPool packs plain
 * segments into its chunks side by side, so the device holds what the pool reserves
 * rounded up to one chunk, where whole-unit segments would each hold a part-used unit (a
 * unit for the small requests, one for the mid-size ones, ...), several times what a pool
 * of a few tens of MiB uses.
 *
 * Beyond it, every segment is whole units: large ones rounded up to one, small ones
 * exactly one, mid-size requests (1-10 MiB, a 20 MiB plain segment)
 * MP_ROUNDED_MID_SEGMENT (64 MiB) rounded up to the unit rather than one unit, as they come
 * in runs and one segment for twice as many of them leaves fewer part-used tails at the
 * peak. And while what the pool reserves is not whole units (the plain segments of its
 * small start, a plain fallback), the segment is made larger by what the total lacks of
 * the next unit. The cudaMemPool lays segments out back to back, and one that ends off a
 * chunk boundary sets every segment after it off the boundaries, where each shares a chunk
 * with its neighbour and a freed one leaves a piece of chunk the driver holds and the Pool
 * does not count (bench/driver_model.py models the cudaMemPool; docs/decisions.md). Small
 * segments are rounded for the same reason: one 2 MiB segment among the large ones would
 * set those after it off the boundaries.
 *
 * The initial_pool_size segment follows the same rule. With max_split_size, only segments
 * that stay below it are rounded. 2 MiB asks for plain segments.
 * Under a limit below the device's capacity every segment is plain, whatever the option
 * says (set_limit included): a rounded segment's tail counts against the limit while only
 * requests that fit in it can use it, so rounded segments refuse what plain ones fit
 * (docs/decisions.md). The device may then hold a little more than the pool counts: what
 * freed plain segments leave of chunks they shared. A rounded segment the device refuses
 * falls back to the plain one. */
static size_t rounded_segment(const mp_pool *p, int kind, size_t request, size_t plain) {
    size_t unit = p->cfg.segment_round;
    if (unit <= MP_LARGE_ROUND) return plain;
    /* A limit of the whole device (set_per_process_memory_fraction(1.0)) limits nothing. */
    size_t limit = mp_effective_limit(p);
    if (limit != MP_UNLIMITED && (!p->capacity || limit < p->capacity)) return plain;
    size_t held = mp_reserved_now_locked(p);
    if (plain <= MP_PLAIN_UNITS * unit && held <= MP_PLAIN_UNITS * unit - plain)
        return plain;   /* a small pool */
    size_t rounded = kind != KIND_LARGE ? unit : mp_round_up(plain, unit);
    if (kind == KIND_LARGE && request < MP_MIN_LARGE_ALLOC) {
        /* Mid-size requests (1-10 MiB) share segments of MP_ROUNDED_MID_SEGMENT. */
        size_t mid = mp_round_up(MP_ROUNDED_MID_SEGMENT, unit);
        if (mid < p->cfg.max_split_size) rounded = mid;
    }
    if (rounded < plain) return plain;
    /* A block of max_split_size or more is never split, and a request below it never takes
     * one: a segment rounded up to it would hold its tail where nothing can reach it, one
     * whole segment a request. */
    if (rounded > plain && rounded >= p->cfg.max_split_size) return plain;
    /* What the pool reserves back on whole units: the segment ends on a chunk boundary. */
    size_t short_by = (unit - held % unit) % unit;
    if (short_by && rounded + short_by < p->cfg.max_split_size) rounded += short_by;
    return rounded;
}

/* The fallback chain once the lists have no fit: garbage collection, the limit, the
 * upstream, then release what is cached and retry, then sync pending frees and retry.
 * Returns a free block in no list (a new segment's, or one that became free meanwhile). */
static int grow_locked(mp_pool *p, mp_stream *s, int kind, size_t size, mp_release_list *rel,
                       mp_block **out) {
    size_t plain = mp_segment_size(size);
    size_t seg_size = rounded_segment(p, kind, size, plain);
    /* Note [Graph capture]: during a capture releases skip themselves, and neither the sync
     * of pending frees nor the retries run: the limit, a capture-safe segment, else out of
     * memory. Asked only there (rel keeps the answer): a growth alone asks nothing. */

    if (p->nhot) {   /* Note [Hot blocks]: parked blocks may serve, or merge into, this */
        mp_hot_flush_locked(p);
        if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
    }
    /* Note [Keep idle]: such a pool grows or fails; it gives nothing back on its own. */
    int may_release = !p->cfg.keep_idle;
    size_t threshold = mp_gc_threshold_bytes(p);
    if (may_release && mp_reserved_now_own_locked(p, rel) + seg_size > threshold)
        mp_release_idle_locked(p, mp_reserved_now_own_locked(p, rel) + seg_size - threshold, rel);
    size_t excess = mp_limit_excess_own_locked(p, seg_size, rel);   /* Note [Shared limit] */
    if (excess) {
        if (!may_release) return MP_ELIMIT;
        mp_release_idle_locked(p, excess, rel);
        if (mp_limit_excess_own_locked(p, seg_size, rel)) {
            if (mp_capture_call_locked(p, rel)) return MP_ELIMIT;
            if (p->npending) {
                mp_sync_pending_unlocked(p);
                if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
            }
            mp_release_idle_locked(p, SIZE_MAX, rel);
            if (mp_limit_excess_own_locked(p, seg_size, rel)) return MP_ELIMIT;
        }
    }

    /* Release cached segments beyond need: idle segments cannot serve this request (the
     * search found nothing), so when they hold a new segment's worth, give that much back,
     * oldest first, before growing. Reserved memory then tracks what the work needs instead
     * of piling up segments of sizes it no longer asks for. */
    if (may_release && p->idle_bytes >= seg_size)
        mp_release_idle_kind_locked(p, kind, seg_size, rel);
    /* Note [Reserved high water]: before reserving more than it ever
     * held, the pool gives back every idle segment of this kind, none of which could serve
     * the request, so a new peak is not set with idle segments beside it. */
    if (may_release && p->idle_bytes >= MP_HIGH_WATER_MIN_IDLE &&
        p->idle_bytes >= p->reserved_high_water / MP_HIGH_WATER_IDLE_DIV &&
        mp_reserved_now_own_locked(p, rel) + seg_size > p->reserved_high_water)
        mp_release_idle_kind_locked(p, kind, 0, rel);
    /* Note [Events outside the lock]: those releases may have dropped the lock to make an
     * event, and other threads grown meanwhile: the limit holds still (it did, else). */
    if (mp_limit_excess_own_locked(p, seg_size, rel)) return MP_ELIMIT;

    uintptr_t ptr = 0;
    int rc = upstream_segment_unlocked(p, s, seg_size, rel, &ptr);
    if (rc == MP_ENOMEM && seg_size > plain) {   /* Note [Segment rounding] */
        seg_size = plain;
        rc = upstream_segment_unlocked(p, s, seg_size, rel, &ptr);
    }
    /* Out of memory outside a capture releases and retries even with keep_idle, as
     * PyTorch's allocator frees a pool's cached blocks before it gives up. */
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
            if (attempt == 1) sync_device_unlocked(p);   /* Note [The last try waits for the device] */
            if (mp_limit_excess_own_locked(p, seg_size, rel)) return MP_ELIMIT;   /* others grew */
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

/* The release of a tallied allocation's count that could not be dropped under the lock it
 * held (Note [Block tallies]): it must be the caller's last touch of the pool. */
__attribute__((cold)) static void tally_uncount(mp_pool *p, mp_tally *t) {
    mp_lock_acquire(&p->lock);
    t->blocks--;
    mp_lock_release(&p->lock);
}

/* alloc_impl's request that no hot block serves: a free block of the lists, or a new
 * segment (or pages). Out of line, so that the round trip through a hot block runs
 * through fewer lines of code (Note [Hot lines] in mp_internal.h). */
__attribute__((noinline)) static int alloc_from_lists_locked(mp_pool *p, mp_stream *s, int kind,
                                                             size_t size, size_t nbytes,
                                                             mp_tally *tally,
                                                             mp_release_list *rel,
                                                             uintptr_t *out) {
    mp_block *b = NULL;
    int rc = MP_OK;
    if (p->cfg.expandable_segments) {
        rc = mp_expand_alloc_locked(p, s, kind, size, rel, &b);
    } else {
        b = mp_search_lists_locked(p, s, kind, size);
        if (!b) rc = grow_locked(p, s, kind, size, rel, &b);
        /* Note [Releases in flight]: refused while other threads' releases still count. */
        for (int w = 0; rc == MP_ELIMIT && w < MP_RELEASE_WAITS && mp_wait_releases_locked(p, rel); w++) {
            b = mp_search_lists_locked(p, s, kind, size);
            rc = b ? MP_OK : grow_locked(p, s, kind, size, rel, &b);
        }
    }
    if (rc != MP_OK) return rc;
    b = mp_carve_locked(p, b, size, nbytes, s);
    mp_mapper_after_alloc_locked(p, b);   /* Note [Mapper] */
    b->tally = tally;
    mp_trace_locked(p, MP_TRACE_ALLOC, b->ptr, b->requested, s->handle);
    *out = b->ptr;
    mp_apply_release_threshold_locked(p, rel);
    return MP_OK;
}

/* mp_alloc, and with a tally mp_alloc_tallied: the allocation counts in it from the closed
 * check on, so the client cannot close it while this runs (the lock is dropped to grow),
 * and the block it returns carries it until its free. */
static inline int alloc_impl(mp_pool *p, size_t nbytes, uintptr_t stream, mp_tally *tally,
                             uintptr_t *out) {
    mp_release_list rel = {0};
    int rc = MP_OK;
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    /* Under the lock: the size policy may change at run time (Note [Size policy at run
     * time]). */
    size_t size = nbytes > MP_MAX_ALLOC ? nbytes : mp_round_size(&p->cfg, nbytes);
    if (tally) {
        if (MP_UNLIKELY(tally->closed)) {
            mp_lock_release(&p->lock);
            return MP_ERETIRED;
        }
        tally->blocks++;
    }
    p->tick++;
    if (MP_UNLIKELY(size > MP_MAX_ALLOC)) {
        rc = MP_ENOMEM;
        goto oom;
    }
    mp_stream *s = mp_stream_get_locked(p, stream);
    if (MP_UNLIKELY(!s)) {
        rc = MP_ENOMEM;
        goto oom;
    }
    rel.stream = s;   /* Note [Graph capture] */
    /* Make room in the live map first, so nothing can fail after a block is chosen. */
    if (MP_UNLIKELY(mp_ptrmap_reserve(&p->live, 1) != MP_OK)) {
        rc = MP_ENOMEM;
        goto oom;
    }
    if (MP_UNLIKELY(p->npending)) {
        if (!mp_capture_call_locked(p, &rel)) mp_process_pending_locked(p);
        else if (p->nmarked) mp_capture_reclaim_locked(p, s);   /* Note [Capture reuse] */
    }

    int kind = size <= MP_SMALL_SIZE ? KIND_SMALL : KIND_LARGE;
    mp_block *b = s->hot ? mp_take_hot_locked(p, s, size) : NULL;
    if (b) {
        /* Note [Hot blocks]: its segment stayed busy and it is in no list. */
        mp_hand_out_locked(p, b, nbytes);
        b->tally = tally;
        mp_trace_locked(p, MP_TRACE_ALLOC, b->ptr, b->requested, stream);
        *out = b->ptr;
        mp_lock_release(&p->lock);
        return MP_OK;
    }
    rc = alloc_from_lists_locked(p, s, kind, size, nbytes, tally, &rel, out);
    if (rc != MP_OK) goto oom;
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return MP_OK;

oom:
    p->stats.num_ooms++;
    mp_oom_record_locked(p, rc, nbytes, size, stream);
    mp_trace_locked(p, MP_TRACE_OOM, 0, nbytes, stream);
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    if (tally) tally_uncount(p, tally);
    return rc;
}

mp_blocking_begin_fn mp_blocking_begin_hook;
mp_blocking_end_fn mp_blocking_end_hook;

void mp_set_blocking_hooks(mp_blocking_begin_fn begin, mp_blocking_end_fn end) {
    mp_blocking_begin_hook = begin;
    mp_blocking_end_hook = end;
}

int mp_alloc(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    return alloc_impl(p, nbytes, stream, NULL, out);
}

int mp_alloc_tallied(mp_pool *p, size_t nbytes, uintptr_t stream, mp_tally *t, uintptr_t *out) {
    return alloc_impl(p, nbytes, stream, t, out);
}

int mp_tally_close(mp_pool *p, mp_tally *t) {
    mp_lock_acquire(&p->lock);
    int busy = t->blocks != 0;
    if (!busy) t->closed = 1;
    mp_lock_release(&p->lock);
    return busy ? MP_EBUSY : MP_OK;
}

int64_t mp_tally_blocks(mp_pool *p, const mp_tally *t) {
    mp_lock_acquire(&p->lock);
    int64_t n = t->blocks;
    mp_lock_release(&p->lock);
    return n;
}

/* ---------------------------------------------------------------- free */

int mp_free(mp_pool *p, uintptr_t ptr, uintptr_t stream, int has_stream) {
    mp_release_list rel = {0};
    int tries = 0;
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    p->tick++;
again:;
    mp_block *b = mp_live_block_locked(p, ptr);
    if (MP_UNLIKELY(!b)) {
        int rc = mp_classify_bad_pointer_locked(p, ptr);
        mp_lock_release(&p->lock);
        return rc == MP_OK ? MP_ENOTFOUND : rc;
    }
    mp_stream *fs = has_stream ? mp_stream_get_locked(p, stream) : b->stream;
    /* Freed on another stream: that stream's use is the last one ordered by the caller,
     * but work the owner queued may still be pending, so the owner becomes a use, waited
     * for like a recorded stream, and the block then belongs to the freeing stream. */
    int moving = fs && fs != b->stream;
    int rc = fs ? MP_OK : MP_ENOMEM;
    if (moving) rc = mp_use_reserve(b);
    size_t nuses_after = b->nuses + (size_t)moving - (size_t)(moving && mp_use_has(b, fs));
    uintptr_t *events = NULL;
    if (MP_UNLIKELY(nuses_after) && rc == MP_OK && !(events = malloc(nuses_after * sizeof *events)))
        rc = MP_ENOMEM;
    if (MP_UNLIKELY(rc != MP_OK)) {
        mp_lock_release(&p->lock);
        return rc;   /* nothing changed: the block is still live */
    }
    /* Note [Events outside the lock]: an event per use (mp_free_pending_locked), made with
     * the lock dropped before anything changes, then the block is looked up again. Not for
     * a free that a capture defers, which records nothing now (Note [Graph capture]). */
    if (MP_UNLIKELY(nuses_after > p->nevent_cache) && tries < MP_EVENT_TRIES &&
        !mp_capture_uses_locked(p, b) && !(moving && mp_capture_stream_locked(p, fs))) {
        free(events);
        tries = mp_event_stock_locked(p, nuses_after) == MP_OK ? tries + 1 : MP_EVENT_TRIES;
        goto again;
    }
    if (MP_UNLIKELY(moving)) {
        mp_use_remove(b, fs);
        b->uses[b->nuses++] = b->stream;
    }
    /* Nothing can fail from here on. */
    rel.stream = fs;   /* Note [Graph capture] */
    mp_tally *tally = b->tally;   /* Note [Block tallies]: uncounted at the very end */
    b->tally = NULL;
    int park = !b->nuses && mp_hot_allowed(p);   /* Note [Hot blocks]: keeps its map entry */
    if (!park) mp_ptrmap_remove(&p->live, ptr);
    int kind = b->kind;
    mp_hot_dec(p, MP_HOT_ALLOCATION, kind, 1);
    mp_hot_dec(p, MP_HOT_ALLOCATED_BYTES, kind, (int64_t)b->nbytes);
    if (b->oversize) mp_stat_dec(&p->stats.oversize_allocations, 1);
    b->oversize = 0;
    mp_trace_locked(p, MP_TRACE_FREE_REQUESTED, b->ptr, b->requested, fs->handle);
    /* The freeing stream owns the block from now on (stream-ordered free, as cudaFreeAsync). */
    b->stream = fs;
    if (!b->nuses) {
        if (park) mp_park_hot_locked(p, b);
        else mp_complete_free_locked(p, b);
    } else {
        mp_free_pending_locked(p, b, events);
    }
    mp_apply_release_threshold_locked(p, &rel);
    if (tally && !rel.head) {   /* nothing left to do with the pool after the unlock */
        tally->blocks--;
        tally = NULL;
    }
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    if (tally) tally_uncount(p, tally);
    return MP_OK;
}

int mp_block_info(mp_pool *p, uintptr_t ptr, size_t *nbytes, size_t *requested,
                  uintptr_t *stream) {
    mp_lock_acquire(&p->lock);
    mp_block *b = mp_live_block_locked(p, ptr);
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
