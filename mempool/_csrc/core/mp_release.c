/* Releasing cached memory back to the upstream: the idle-segment list (oldest first),
 * release_threshold, trim and empty_cache. Oldest means longest idle: a segment joins the
 * tail of the idle list when its last busy block is freed and leaves it when a block of it
 * is handed out, so the head has gone unused longest.
 *
 * Segments are detached under the pool lock (bookkeeping and stats change at once, so the
 * memory is no longer counted or reachable) and freed upstream after the lock is dropped
 * (mp_release_finish), see Note [Lock order] in mp_core.c. */
/* Note [Threshold releases without a sync]
 * An unmap does not wait for queued work, so releasing a free page of an expandable segment
 * means first knowing that no stream that used it still has work queued. empty_cache, trim,
 * limit and the growth rules synchronize those streams: they are rare, or the caller asked.
 * release_threshold is checked after every alloc and free, so a sync there would block
 * constantly. A threshold release never blocks: under the lock it asks each owner stream of
 * a candidate run once (stream_query, optional in the upstream contract: cuStreamQuery, the
 * sim's queue, always idle on host; an upstream without it releases nothing this way) and
 * carves only runs whose owners are all idle; the pages' frees came before the query, so
 * nothing can still use them. Runs of busy streams stay where they are, untouched.
 *
 * An attempt that found only busy runs makes the next checks skip (1, 2, 4, ... up to
 * MP_THRESHOLD_BACKOFF_MAX in a row, reset by an attempt that releases and by
 * set_release_threshold), so a pool whose stream is never idle does not walk its blocks at
 * every free. This is the spirit of the driver's own cudaMemPool threshold, which releases
 * at synchronization points. The sim's device.counters()["stream_queries"] counts the
 * queries; tests check that a busy stream's pages stay without a sync, go once it is idle,
 * and that a stream waiting on another stream's event counts as busy. */

#include <sched.h>
#include <stdlib.h>

#include "mp_capture.h"
#include "mp_expand.h"
#include "mp_internal.h"

#define MP_RELEASE_WAIT_YIELDS (1u << 20)   /* Note [Releases in flight]: a wait's bound */

void mp_segment_idle_push_locked(mp_pool *p, mp_segment *s) {
    if (s->expandable) return;   /* expandable segments release pages, never whole */
    s->idle_since = p->tick;
    if (!s->pinned) p->idle_bytes += s->nbytes;
    s->inext = NULL;
    s->iprev = p->idle_tail;
    if (p->idle_tail) p->idle_tail->inext = s;
    else p->idle_head = s;
    p->idle_tail = s;
}

void mp_segment_idle_remove_locked(mp_pool *p, mp_segment *s) {
    if (s->expandable) return;
    if (!s->pinned) p->idle_bytes -= s->nbytes;
    if (s->iprev) s->iprev->inext = s->inext;
    else p->idle_head = s->inext;
    if (s->inext) s->inext->iprev = s->iprev;
    else p->idle_tail = s->iprev;
    s->iprev = s->inext = NULL;
}

/* Detach an idle segment: every block in it is free. The upstream frees in the order of
 * the segment's own stream, so blocks that other streams own (taken over by cross-stream
 * reuse or freed there) first make that stream wait for theirs: no host sync. */
void mp_detach_segment_locked(mp_pool *p, mp_segment *seg, mp_release_list *out) {
    mp_segment_idle_remove_locked(p, seg);
    seg->release_stream = seg->stream->handle;
    if (seg->prev) seg->prev->next = seg->next;
    else p->segments = seg->next;
    if (seg->next) seg->next->prev = seg->prev;
    p->nsegments--;

    mp_stream *waited[8];
    int nwaited = 0;
    mp_block *b = seg->first;
    while (b) {
        mp_block *next = b->next;
        mp_stream *owner = b->stream;
        int seen = owner == seg->stream;
        for (int i = 0; i < nwaited && !seen; i++) seen = waited[i] == owner;
        if (!seen) {
            uintptr_t ev;
            int rc = mp_event_get_locked(p, &ev);
            if (rc == MP_OK) {
                rc = mp_up_record(p, ev, owner->handle);
                if (rc == MP_OK) rc = p->up.stream_wait_event(p->up.ctx, seg->stream->handle, ev);
                mp_event_put_locked(p, ev);
                p->stats.num_event_waits++;
            }
            if (rc != MP_OK) {
                /* No event to order the free after the owner's work: the owner is
                 * synchronized before the free, without the lock (Note [Lock order]). */
                uintptr_t *grown = realloc(seg->release_sync,
                                           (seg->nrelease_sync + 1) * sizeof *grown);
                if (grown) {
                    seg->release_sync = grown;
                    seg->release_sync[seg->nrelease_sync++] = owner->handle;
                } else {
                    mp_up_sync(p, owner->handle);   /* no host memory */
                }
            }
            if (nwaited < 8) waited[nwaited++] = owner;
        }
        /* remove from its free list (and the inactive_split counters) */
        mp_freelist_remove(&owner->lists[seg->kind], b);
        if (b->split_counted) {
            mp_stat3_dec(p->stats.inactive_split, seg->kind, 1);
            mp_stat3_dec(p->stats.inactive_split_bytes, seg->kind, (int64_t)b->nbytes);
        }
        mp_block_delete_locked(p, b);
        b = next;
    }
    seg->first = NULL;
    p->stats.num_device_free++;
    mp_stat3_dec(p->stats.segment, seg->kind, 1);
    mp_stat3_dec(p->stats.reserved_bytes, seg->kind, (int64_t)seg->nbytes);
    /* Note [Releases in flight]: still the upstream's until its free returns. */
    __atomic_add_fetch(&p->releasing_bytes, seg->nbytes, __ATOMIC_RELAXED);
    out->counted += seg->nbytes;
    if (seg->oversize) mp_stat_dec(&p->stats.oversize_segments, 1);
    mp_trace_segment_locked(p, MP_TRACE_SEGMENT_FREE, seg->ptr, seg->nbytes, seg->stream->handle);
    seg->inext = out->head;
    out->head = seg;
    out->nbytes += seg->nbytes;
}

/* Note [Events outside the lock]: mp_detach_segment_locked orders the free after each other
 * owner of seg's blocks through an event. When the cache has none, make one with the lock
 * dropped and return 1: the caller's walk of the idle list starts again, as it may have
 * changed. After MP_EVENT_TRIES, or when none can be made, the detach syncs the owner. */
static int stock_for_detach_locked(mp_pool *p, const mp_segment *seg, int *tries) {
    if (p->nevent_cache || *tries >= MP_EVENT_TRIES) return 0;
    const mp_block *b = seg->first;
    while (b && b->stream == seg->stream) b = b->next;
    if (!b) return 0;   /* one owner: no event */
    *tries = mp_event_stock_locked(p, 1) == MP_OK ? *tries + 1 : MP_EVENT_TRIES;
    return 1;
}

size_t mp_release_idle_locked(mp_pool *p, size_t target, mp_release_list *out) {
    size_t released = 0;
    int tries = 0;
    /* Note [Graph capture]: nothing goes while a capture is under way; later calls see it. */
    if ((p->idle_bytes || p->cfg.expandable_segments) && mp_capture_call_locked(p, out)) return 0;
    mp_segment *seg = p->idle_head;
    while (seg && released < target) {
        mp_segment *next = seg->inext;
        if (!seg->pinned && !mp_capture_segment_locked(p, out, seg)) {
            if (stock_for_detach_locked(p, seg, &tries)) {
                seg = p->idle_head;
                continue;
            }
            released += seg->nbytes;
            mp_detach_segment_locked(p, seg, out);
        }
        seg = next;
    }
    if (released < target && p->cfg.expandable_segments) {
        released += mp_expand_release_locked(p, target - released);
        mp_expand_drop_empty_locked(p, out);
    }
    return released;
}

size_t mp_release_idle_kind_locked(mp_pool *p, int kind, size_t target, mp_release_list *out) {
    size_t idle = 0;
    for (mp_segment *seg = p->idle_head; seg; seg = seg->inext)
        if (!seg->pinned && seg->kind == kind) idle += seg->nbytes;
    if (idle < target) return 0;   /* not a new segment's worth of this kind: keep them */
    size_t released = 0, want = target ? target : SIZE_MAX;   /* 0: every one */
    int tries = 0;
    mp_segment *seg = p->idle_head;
    while (seg && released < want) {
        mp_segment *next = seg->inext;
        if (!seg->pinned && seg->kind == kind && !mp_capture_segment_locked(p, out, seg)) {
            if (stock_for_detach_locked(p, seg, &tries)) {
                seg = p->idle_head;
                continue;
            }
            released += seg->nbytes;
            mp_detach_segment_locked(p, seg, out);
        }
        seg = next;
    }
    return released;
}

/* Add h to the distinct handles (*v)[0 .. *n), growing the array; 0 when there was no host
 * memory for it (the array stays as it was). */
int mp_add_distinct_handle(uintptr_t **v, size_t *n, size_t *cap, uintptr_t h) {
    for (size_t j = 0; j < *n; j++)
        if ((*v)[j] == h) return 1;
    if (*n == *cap) {
        size_t grown_cap = *cap ? 2 * *cap : 4;
        uintptr_t *grown = realloc(*v, grown_cap * sizeof *grown);
        if (!grown) return 0;
        *v = grown;
        *cap = grown_cap;
    }
    (*v)[(*n)++] = h;
    return 1;
}

/* The distinct streams the fixed segments of `rel` are freed on, in a malloc'd array (best
 * effort: without host memory fewer, or none, are synchronized: Note [Released before a
 * growth], mp_core.c). */
uintptr_t *mp_release_streams(const mp_release_list *rel, size_t *n) {
    uintptr_t *out = NULL;
    size_t cap = 0;
    *n = 0;
    for (const mp_segment *seg = rel->head; seg; seg = seg->inext)
        if (!seg->expandable)   /* expandable pages are unmapped after their streams' syncs */
            (void)mp_add_distinct_handle(&out, n, &cap, seg->release_stream);
    return out;
}

void mp_release_finish_slow(mp_pool *p, mp_release_list *list) {
    mp_segment *seg = list->head;
    mp_tell_release_observer(p);   /* Note [Release observer] (mp_core.h) */
    void *blocking = mp_blocking_begin();
    while (seg) {
        mp_segment *next = seg->inext;
        for (size_t i = 0; i < seg->nrelease_sync; i++)
            mp_up_sync(p, seg->release_sync[i]);
        /* A plain segment's free is stream-ordered: freed behind work nobody waits for,
         * its bytes stay the device's until that work has run (Note [The last try waits
         * for the device], mp_core.c). Expandable pages are unmapped only once idle. */
        if (!seg->expandable && !seg->nrelease_sync && !list->waited)
            __atomic_store_n(&p->released_unwaited, 1, __ATOMIC_RELAXED);
        if (!seg->expandable)   /* Note [Giving back to the device] */
            __atomic_store_n(&p->released_since_give_back, 1, __ATOMIC_RELAXED);
        mp_segment_release_upstream(p, seg);
        free(seg->release_sync);
        free(seg->release_runs);
        free(seg->extents);
        free(seg);
        seg = next;
    }
    if (list->counted) {   /* Note [Releases in flight]: before the GIL is asked for again */
        mp_lock_acquire(&p->lock);
        __atomic_sub_fetch(&p->releasing_bytes, list->counted, __ATOMIC_RELAXED);
        mp_publish_held_locked(p);
        mp_lock_release(&p->lock);
        list->counted = 0;
    }
    mp_blocking_end(blocking);
    list->head = NULL;
    list->nbytes = 0;
}

static size_t cached_locked(const mp_pool *p) {
    return (size_t)(mp_stat3_current(p->stats.reserved_bytes) -
                    mp_hot_current(p, MP_HOT_ACTIVE_BYTES));
}

/* Note [Threshold releases without a sync]: pages of idle streams only, down to the
 * threshold, and after an attempt that found only busy ones, fewer attempts until one
 * releases again. Where a mapper runs (Note [Mapper]), on its thread. */
uint64_t mp_release_threshold_pages_locked(mp_pool *p) {
    size_t threshold = p->cfg.release_threshold, cached = cached_locked(p);
    if (threshold == MP_UNLIMITED || cached <= threshold) return 0;
    int busy = 0;
    uint64_t unmaps = 0;
    size_t released = mp_expand_release_idle_locked(p, cached - threshold, &busy, &unmaps);
    if (released || !busy) {
        p->threshold_backoff = 0;
    } else {
        p->threshold_backoff = p->threshold_backoff ? p->threshold_backoff * 2 : 1;
        if (p->threshold_backoff > MP_THRESHOLD_BACKOFF_MAX)
            p->threshold_backoff = MP_THRESHOLD_BACKOFF_MAX;
        p->threshold_skip = p->threshold_backoff;
    }
    return unmaps;
}

void mp_apply_release_threshold_slow_locked(mp_pool *p, mp_release_list *out) {
    size_t threshold = p->cfg.release_threshold;
    size_t cached = cached_locked(p);
    if (cached <= threshold) return;
    if (!p->cfg.expandable_segments) {
        mp_release_idle_locked(p, cached - threshold, out);   /* stream-ordered frees */
        return;
    }
    /* None during a capture (Note [Graph capture]), which the next check after it makes up
     * for. */
    if (mp_capture_call_locked(p, out)) return;
    if (p->threshold_skip) {
        p->threshold_skip--;
        return;
    }
    if (p->cfg.map_ahead && mp_mapper_want_behind_locked(p)) return;   /* Note [Mapper] */
    mp_release_threshold_pages_locked(p);
}

int mp_trim(mp_pool *p, size_t keep) {
    mp_release_list rel = {0};
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    mp_trace_locked(p, MP_TRACE_TRIM, 0, keep, 0);
    mp_process_pending_locked(p);
    size_t cached = cached_locked(p);
    if (cached > keep) mp_release_idle_locked(p, cached - keep, &rel);
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return MP_OK;
}

/* Unlike trim(0), which releases only what is free now, empty_cache first waits for the
 * streams that pending frees wait on (those alone, not every stream), as PyTorch's
 * empty_cache synchronizes its outstanding events: then every segment that nothing uses
 * goes back. Blocks owned by other streams cost an event wait, not a sync (see
 * mp_detach_segment_locked); expandable pages sync their owners before the unmap. */
int mp_empty_cache(mp_pool *p) {
    mp_release_list rel = {0};
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    mp_trace_locked(p, MP_TRACE_EMPTY_CACHE, 0, 0, 0);
    mp_process_pending_locked(p);
    mp_sync_pending_unlocked(p);
    mp_release_idle_locked(p, SIZE_MAX, &rel);
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return MP_OK;
}

/* Note [Giving back to the device]
 * mp_empty_cache frees idle segments in stream order and waits for none of them, so the
 * device may count them as used afterwards. A cudaMemPool keeps a freed segment until the
 * work queued before its free has run, and then, with a release threshold of 0 (the pools
 * a Pool makes), until the next synchronization; with a higher threshold it keeps up to
 * that many bytes for good. nvidia-smi, NVML and cudaMemGetInfo show the memory as used
 * until then. PyTorch's torch.cuda.empty_cache() promises it back, "so that it can be used
 * by other GPU applications and visible in nvidia-smi": its native allocator frees with
 * cudaFree, which waits, and its cudaMallocAsync backend synchronizes the device and trims
 * its pool to 0. Under the torch glue PyTorch's own test_device_memory_used failed after
 * earlier tests had left memory cached, as this gap would make it: the device's used bytes
 * did not grow by a new tensor's size from one empty_cache to the next.
 *
 * mp_give_back is called after mp_empty_cache or mp_trim by the Pool's own empty_cache and
 * trim (on cuda) and by the torch glue's empty_cache. It waits for the whole device, but
 * only when a plain segment was freed to the upstream since its last call
 * (released_since_give_back: a free is stream-ordered even when the work before it was
 * waited for, and the cudaMemPool sees it done only at a sync), so a program that empties
 * an empty cache every step pays no sync. Then the
 * upstream gives back what it still keeps beyond `keep` bytes (its trim). On sim and host
 * the sync alone returns the kept frees. Expandable pages need none of this: their unmap
 * releases the physical memory at once. A capture refuses a device sync and is broken by
 * one: while the pool knows of a capture (mp_capture_known), nothing is done and MP_EBUSY
 * is returned. The wait counts in num_sync_all_streams, as PyTorch's empty_cache counts
 * its own. */
int mp_give_back(mp_pool *p, size_t keep) {
    if (mp_pool_inherited(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    if (mp_capture_known(p)) return MP_EBUSY;
    if (p->up.device_synchronize &&
        __atomic_exchange_n(&p->released_since_give_back, 0, __ATOMIC_RELAXED)) {
        mp_lock_acquire(&p->lock);
        p->stats.num_sync_all_streams++;
        mp_lock_release(&p->lock);
        __atomic_store_n(&p->released_unwaited, 0, __ATOMIC_RELAXED);   /* waited now */
        void *blocking = mp_blocking_begin();
        int rc = p->up.device_synchronize(p->up.ctx);
        mp_blocking_end(blocking);
        if (rc != MP_OK) return rc;
    }
    return p->up.trim ? p->up.trim(p->up.ctx, keep) : MP_OK;
}

/* Note [Shared limit]
 * PyTorch's set_per_process_memory_fraction caps everything its allocator holds on a
 * device: the device's blocks and the private pools of CUDA graphs and MemPools together.
 * Under the torch glue those private pools are core pools of their own, so the device
 * pool's limit alone let a graph or a MemPool grow past the cap. mp_share_limit makes a
 * pool (the member) count its reserved bytes against another's (the owner's) limit too.
 *
 * Each pool adds every change of its reserved-now bytes (reserved plus in flight, the
 * figure its own limit is checked against) to limit_held of its owner, or of itself when
 * it has none (mp_publish_held_locked, under its own lock; limit_held is atomic because
 * members add to their owner's under theirs). A limit check (mp_limit_excess_locked) takes
 * the owner's limit_held with this pool's own share replaced by its exact reserved-now:
 * for a pool that shares nothing that is its reserved-now, as before, whatever the order
 * of publishing. Other members' shares are as of their last change, so two pools growing
 * at the same moment can pass the shared limit by a segment between them (the owner's
 * lock is not taken: a member would otherwise hold two pool locks). A member gives back
 * only its own idle memory to make room (the torch glue's private pools keep theirs,
 * Note [Keep idle]): when the others hold the room, the request fails with MP_ELIMIT and
 * the glue's out-of-memory path takes over, as PyTorch's does. A member keeps its own
 * limit as well. The member holds a reference to its owner and takes its share back when
 * it is destroyed. */
void mp_publish_held_locked(mp_pool *p) {
    int64_t now = (int64_t)mp_reserved_now_locked(p);
    int64_t delta = now - p->limit_published;
    if (!delta) return;
    p->limit_published = now;
    mp_pool *target = p->limit_owner ? p->limit_owner : p;
    __atomic_add_fetch(&target->limit_held, delta, __ATOMIC_RELAXED);
}

static size_t over_by(size_t held, size_t extra, size_t limit) {
    if (limit == MP_UNLIMITED) return 0;
    if (extra > SIZE_MAX - held) return SIZE_MAX;
    return held + extra > limit ? held + extra - limit : 0;
}

size_t mp_limit_excess_locked(mp_pool *p, size_t extra) {
    return mp_limit_excess_own_locked(p, extra, NULL);
}

size_t mp_limit_excess_own_locked(mp_pool *p, size_t extra, const mp_release_list *own) {
    size_t now = mp_reserved_now_own_locked(p, own);
    mp_pool *owner = p->limit_owner ? p->limit_owner : p;
    size_t limit = __atomic_load_n(&owner->cfg.limit, __ATOMIC_RELAXED);
    int64_t held = __atomic_load_n(&owner->limit_held, __ATOMIC_RELAXED) - p->limit_published +
                   (int64_t)now;
    size_t excess = over_by(held > 0 ? (size_t)held : 0, extra, limit);
    if (p->limit_owner) {   /* a member's own limit holds too */
        size_t own = over_by(now, extra, p->cfg.limit);
        if (own > excess) excess = own;
    }
    return excess;
}

/* Note [Releases in flight]
 * A segment taken off the books (mp_detach_segment_locked) is freed upstream only after the
 * lock is dropped (mp_release_finish), and meanwhile other threads allocate: counting only
 * reserved bytes, the upstream could hold more than the limit at once while the pool's own
 * peak stayed within it (docs/decisions.md). So the bytes of detached segments count in
 * releasing_bytes, part of the reserved-now figure every limit check and Note [Shared
 * limit] use, from the detach until their upstream free has returned (mp_release_finish
 * takes the lock once more for that, before it asks for the GIL back, so a thread waiting
 * with the GIL held cannot stop it). A caller's own detached segments are not counted
 * against its own growth (mp_limit_excess_own_locked): they go upstream before its
 * allocation does (upstream_segment_unlocked). A request that the limit refuses while other
 * threads' releases are in flight waits, with the lock and the GIL let go, for one of them
 * to return, and asks again (at most MP_RELEASE_WAITS times): what would fit once they are
 * gone is not refused. It frees its own detached segments first: two threads each waiting
 * for the other's would otherwise wait out the bound. Expandable pools count their unmaps in flight as inflight_bytes
 * already (mp_expand.c). tests/core/test_limit_threads.py checks the device's peak on sim and
 * host with 16 threads. */
int mp_wait_releases_locked(mp_pool *p, mp_release_list *own) {
    size_t start = p->releasing_bytes, own_counted = own->counted;
    if (start <= own_counted) return 0;   /* none but the caller's own */
    mp_lock_drop(p);
    /* The caller's own go first: another thread may be waiting for them, as for its own. */
    mp_release_finish(p, own);
    start -= own_counted;
    void *blocking = mp_blocking_begin();
    for (unsigned i = 0; i < MP_RELEASE_WAIT_YIELDS &&
                         __atomic_load_n(&p->releasing_bytes, __ATOMIC_RELAXED) >= start; i++)
        sched_yield();
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    return p->releasing_bytes < start;
}

int mp_share_limit(mp_pool *member, mp_pool *owner) {
    if (member == owner || owner->limit_owner) return MP_EINVAL;
    mp_lock_acquire(&member->lock);
    int rc = MP_OK;
    if (member->limit_owner || __atomic_load_n(&member->limit_members, __ATOMIC_RELAXED))
        rc = MP_EINVAL;   /* a member already, or some pool shares this one's limit */
    else if (member->limit_published)
        rc = MP_EBUSY;    /* it holds memory: join before the first segment */
    if (rc == MP_OK) {
        mp_pool_retain(owner);
        __atomic_add_fetch(&owner->limit_members, 1, __ATOMIC_RELAXED);
        member->limit_owner = owner;
    }
    mp_lock_release(&member->lock);
    return rc;
}

int mp_set_limit(mp_pool *p, size_t limit) {
    mp_lock_acquire(&p->lock);
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    /* Pools sharing this limit read it under their own locks (Note [Shared limit]). */
    __atomic_store_n(&p->cfg.limit, limit, __ATOMIC_RELAXED);
    mp_lock_release(&p->lock);
    return MP_OK;
}

int mp_set_release_threshold(mp_pool *p, size_t threshold) {
    mp_release_list rel = {0};
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    p->cfg.release_threshold = threshold;
    p->threshold_skip = p->threshold_backoff = 0;   /* a new threshold is checked at once */
    mp_apply_release_threshold_locked(p, &rel);
    mp_lock_release(&p->lock);
    mp_release_finish(p, &rel);
    return MP_OK;
}
