/* Streams and events: the pool's streams and its event cache, cross-stream reuse (Note
 * [Stream reuse]), frees that wait for other streams (pending frees, record_stream), and
 * streams going away (Note [Forgotten streams]). Every function expects the pool lock
 * unless its name ends in _unlocked or it is a public entry point. */
/* Note [Stream reuse]
 * Each free block has an owner stream; freeing on S (the default is the block's own stream)
 * puts it on S's lists, where S may reuse it at once. `free(ptr, stream=T)` moves it to T,
 * with the old owner treated as a recorded stream: an event on it, and the block reaches
 * T's lists once that event has completed (at once when the old owner has no work queued).
 * When S's lists have no fit and `cross_stream_reuse` is on, S takes the best fit among
 * other streams' free blocks: an event is recorded on the owner, and if it has not already
 * completed S waits on it (stream_wait_event): no host sync. Only the part handed out
 * changes owner; the remainder of a split stays with the old owner, and free neighbours of
 * different owners do not merge.
 *
 * Blocks with recorded streams become pending at free: an event per recorded stream, polled
 * at the next allocations; once all completed the block is freed into its owner's lists.
 * The trade-off of cross-stream reuse: S's later work is ordered after the owner's work up
 * to that point; turn it off where streams must never serialize.
 *
 * A segment whose blocks are all free is idle and can be released. Its upstream free runs
 * in the order of the segment's own stream, so blocks owned by other streams first make
 * that stream wait on an event of theirs. */

/* Note [Forgotten streams]
 * A stream-per-request program makes streams without end, and each one the pool saw would
 * cost its state (two free lists, 27 KB since the classes stop at 1 TiB) and, with
 * expandable segments, a range of address space as large as the device, until the pool
 * died. forget_stream(s) ends all of it: after the sync it hands s's blocks, segments and
 * pending uses to the legacy stream (events recorded on s have completed), releases each of
 * s's expandable ranges that holds nothing but free pages of s (its runs unmapped, its
 * address space given back, without the lock), hands a range that still holds blocks to the
 * legacy stream (as its growing range when it has none, else to go once nothing in it is
 * mapped: empty_cache, trim, an OOM's release), and frees the stream.
 * stats()["num_streams"] counts the streams kept; mempool/bench/test_stream_churn.py makes,
 * uses and forgets 100,000 streams with host memory and address space flat.
 *
 * An operation that drops the lock in its middle may hold a pointer to the stream (a growth
 * mapping pages for it, a release syncing it). Such drops go through mp_lock_drop /
 * mp_lock_retake, which count them (nunlocked); a stream forgotten while any is under way
 * is kept, on the legacy handle, in `dead`, and freed by the next forget_stream that finds
 * none under way, after handing over what those operations gave it meanwhile.
 *
 * A call on a destroyed stream handle crashes the driver, so the pool never makes one on
 * its own: mp_pool_destroy synchronizes the device (device_synchronize, which needs no
 * handle) and frees every segment on the legacy stream. */

#include <stdlib.h>
#include <string.h>

#include "mp_block.h"
#include "mp_capture.h"
#include "mp_expand.h"
#include "mp_stream.h"

/* ---------------------------------------------------------------- events */

/* Note [Events outside the lock]
 * Creating an event can wait on a lock of the driver's own. Under compute-sanitizer a
 * thread in Pool.alloc (the GIL held, as the hot path keeps it) waited in
 * cuEventCreate for a driver lock, holding the pool lock too, while a thread launching a
 * kernel held that driver lock and, in the sanitizer's launch callback, waited for the GIL:
 * a deadlock. Any tool or library whose driver callback takes the GIL (CUPTI profilers
 * that take Python stacks) closes the same cycle. So the pool makes no event with its lock
 * held, and a Pool method lets the GIL go meanwhile (Note [Blocking upstream calls]).
 *
 * Events come from the cache only: mp_event_get_locked never makes one. A path that finds
 * too few calls mp_event_stock_locked, which drops the lock, makes them in a blocking pair
 * (what is missing plus as many as the pool has, up to MP_EVENT_BATCH: a rising peak
 * costs few drops), takes the lock back and adds them; the path then starts again from a
 * point where it had changed nothing: cross-stream reuse searches again, mp_free looks its
 * block up again, a deferred free restarts the pending walk, a release restarts its walk of
 * the idle list. After MP_EVENT_TRIES stockings, or when creation fails, the path takes
 * the fallbacks it always had (a fresh segment instead of reuse, a sync without the lock
 * instead of an event). Steady work only draws on the cache: reuse and release put their
 * event back at once, a pending free its events when it completes, so the cache grows to
 * the work's peak and nothing is made after warm-up. The cache has room for every event
 * the pool made (cap_event_cache >= nevents), so a put never grows it nor, out of host
 * memory, destroys an event under the lock; events are destroyed at the pool's end only
 * (mp_pool_destroy, when no other thread can reach the pool; the GIL of a Pool's dealloc
 * is still held there).
 *
 * The address-space reservation of an expandable range (cuMemAddressReserve: it changes
 * the context's address space, not one object) is made the same way (segment_of_locked in
 * mp_expand.c: a range another thread gave the stream meanwhile wins, the one reserved in
 * vain goes back, and the growth searches the lists again before it plans a map).
 *
 * What stays under the lock: recording, querying and waiting on events that exist, stream
 * queries (Note [Threshold releases without a sync]) and capture queries. They act on one
 * object each, and none was seen waiting in the stacks; moving them out would cost a lock
 * drop on every cross-stream reuse. Out of host memory only, a fallback may still sync a
 * stream under the lock (mp_detach_segment_locked, sync_uses_unlocked). The sim holds
 * creations and reservations on request (hold_event_creates, hold_va_reserves), and
 * tests/core/test_events_outside_lock.py checks that another thread runs Python and uses the
 * pool meanwhile at each place; the debug build asserts it for events
 * (mp_up_event_create). */

#define MP_EVENT_BATCH 32   /* the most events made beyond a path's need at once */

int mp_event_get_locked(mp_pool *p, uintptr_t *ev) {
    if (!p->nevent_cache) return MP_ENOTREADY;   /* made only by mp_event_stock_locked */
    *ev = p->event_cache[--p->nevent_cache];
    return MP_OK;
}

void mp_event_put_locked(mp_pool *p, uintptr_t ev) {
    mp_check(p->nevent_cache < p->cap_event_cache);   /* room for every event made */
    p->event_cache[p->nevent_cache++] = ev;
}

/* Make and destroy events with the lock dropped, the GIL let go in a marked thread. */
static int events_make_unlocked(mp_pool *p, uintptr_t *evs, size_t n, size_t *made) {
    int rc = MP_OK;
    *made = 0;
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    while (*made < n && (rc = mp_up_event_create(p, &evs[*made])) == MP_OK) (*made)++;
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    return rc;
}

static void events_destroy_unlocked(mp_pool *p, const uintptr_t *evs, size_t n) {
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    for (size_t i = 0; i < n; i++) p->up.event_destroy(p->up.ctx, evs[i]);
    mp_blocking_end(blocking);
    mp_lock_retake(p);
}

int mp_event_stock_locked(mp_pool *p, size_t want) {
    if (p->nevent_cache >= want) return MP_OK;
    size_t extra = p->nevents < MP_EVENT_BATCH ? p->nevents : MP_EVENT_BATCH;
    size_t n = want - p->nevent_cache + extra;
    uintptr_t few[8], *evs = n <= 8 ? few : malloc(n * sizeof *evs);
    if (!evs) return MP_ENOMEM;
    size_t made;
    int rc = events_make_unlocked(p, evs, n, &made);
    /* Room for all of them in the cache, now, so that no put ever needs it. */
    size_t cap = p->cap_event_cache ? p->cap_event_cache : 16;
    while (cap < p->nevents + made) cap *= 2;
    if (cap != p->cap_event_cache) {
        uintptr_t *grown = realloc(p->event_cache, cap * sizeof *grown);
        if (grown) {
            p->event_cache = grown;
            p->cap_event_cache = cap;
        } else {
            events_destroy_unlocked(p, evs, made);
            made = 0;
            rc = MP_ENOMEM;
        }
    }
    for (size_t i = 0; i < made; i++) p->event_cache[p->nevent_cache++] = evs[i];
    p->nevents += made;
    if (evs != few) free(evs);
    return rc;
}

/* ---------------------------------------------------------------- streams */

/* Cross-stream reuse without a host sync (Note [Stream reuse]): the best fit among other
 * streams' free blocks, made safe for `s` by an event recorded on its owner that `s` waits
 * on. */
mp_block *mp_take_from_other_stream_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    mp_block *best;
    for (int tries = 0;; tries++) {
        /* After a stocking the lock was dropped: s's own lists come first again. */
        if (tries && (best = mp_freelist_find_fit(p, &s->lists[kind], size))) return best;
        best = NULL;
        /* Note [Streams without end]: the streams that may hold blocks, not all of them. */
        for (mp_stream *t = p->holding, *next; t; t = next) {
            next = t->hnext;
            if (!mp_stream_holds(t)) {
                mp_stream_unhold_locked(p, t);
                continue;
            }
            if (t == s || t->index == MP_STREAM_DEAD) continue;
            mp_block *b = mp_freelist_find_fit(p, &t->lists[kind], size);
            if (b && (!best || b->nbytes < best->nbytes)) best = b;
        }
        if (!best) return NULL;
        /* Note [Graph capture]: the event would be recorded, queried or waited on across a
         * capture's edge. */
        if (mp_capture_stream_locked(p, s) || mp_capture_handle(p, best->stream->handle))
            return NULL;
        if (p->nevent_cache) break;
        /* Note [Events outside the lock]: the lock goes while the event is made, and the
         * search starts again; a fresh segment when none can be made. */
        if (tries == MP_EVENT_TRIES || mp_event_stock_locked(p, 1) != MP_OK) return NULL;
    }
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


/* ---------------------------------------------------------------- pending frees */

static void pending_push_locked(mp_pool *p, mp_block *b) {
    b->fprev = p->pending_tail;
    b->fnext = NULL;
    if (p->pending_tail) p->pending_tail->fnext = b;
    else p->pending_head = b;
    p->pending_tail = b;
    p->npending++;
}

/* Note [Capture reuse]: b's markers are over (its free completes, or records events). */
static void drop_markers_locked(mp_pool *p, mp_block *b) {
    if (!b->markers) return;
    free(b->markers);
    b->markers = NULL;
    b->nmarkers = 0;
    p->nmarked--;
}

static void pending_remove_locked(mp_pool *p, mp_block *b) {
    if (b->fprev) b->fprev->fnext = b->fnext;
    else p->pending_head = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    else p->pending_tail = b->fprev;
    b->fprev = b->fnext = NULL;
    p->npending--;
    drop_markers_locked(p, b);
}

/* Note [Capture reuse]
 * A free with recorded streams during a graph capture cannot record events to wait on
 * (they would be graph nodes, never queried: Note [Graph capture]), so by default it stays
 * pending until the capture ends, and the capture's later requests cannot reuse the block.
 * A capture records its own order, though: with capture_reuse on (PyTorch's
 * graph_capture_record_stream_reuse), the free remembers the nodes that the block's stream
 * and each recorded stream had reached in the capture's graph (their frontiers, the
 * "markers"; upstream capture_frontier). Later, when the block's stream asks for memory
 * during the capture and each marker is its frontier or an ancestor of it (the streams have
 * joined it since: upstream capture_follows, which walks the graph's dependencies), all work
 * queued next on it runs after every use of the block, in the graph as in each replay: the
 * free completes then, with no event, and the request may take the block. Only the block's
 * own stream asks (its free list is where the block goes). A stream that was not capturing
 * at the free (its work is outside the graph), or an upstream without the two calls, leaves
 * the free to wait for the capture's end as before. The walk is made only while such blocks
 * exist (p->nmarked) and on a request that the capture makes, once for all of the stream's
 * marked blocks; it runs with the pool lock held, as the capture's other queries do, and
 * asks the driver for each node's dependencies, so it takes longer as the graph grows
 * (PyTorch's allocator holds its own lock across the same walk:
 * c10/cuda/CUDACachingAllocator.cpp, free_safe_blocks_in_capture). */

/* The frontier of capturing stream s appended to *nodes (*n of them, room for *cap), the
 * capture's id checked against *graph (0: not set yet). 0 when s does not capture, the
 * capture differs or memory ran out: no markers then. */
static int frontier_append_locked(mp_pool *p, mp_stream *s, uint64_t *graph, uintptr_t **nodes,
                                  size_t *n, size_t *cap) {
    for (;;) {
        size_t got = 0;
        uint64_t id = 0;
        if (p->up.capture_frontier(p->up.ctx, s->handle, &id, *nodes + *n, *cap - *n,
                                   &got) != MP_OK)
            return 0;
        if (*graph && id != *graph) return 0;   /* another capture: its order is not ours */
        *graph = id;
        if (got <= *cap - *n) {
            *n += got;
            return 1;
        }
        size_t want = *n + got;
        uintptr_t *more = realloc(*nodes, want * sizeof *more);
        if (!more) return 0;
        *nodes = more;
        *cap = want;
    }
}

/* Give pending block b (deferred during a capture) the markers of Note [Capture reuse],
 * when its stream and every recorded stream capture in one graph. */
static void capture_mark_locked(mp_pool *p, mp_block *b) {
    if (!p->cfg.capture_reuse || !p->up.capture_frontier || !p->up.capture_follows) return;
    size_t n = 0, cap = 4 + (size_t)b->nuses;
    uint64_t graph = 0;
    uintptr_t *nodes = malloc(cap * sizeof *nodes);
    if (!nodes) return;
    int ok = frontier_append_locked(p, b->stream, &graph, &nodes, &n, &cap);
    for (uint16_t i = 0; ok && i < b->nuses; i++)
        ok = frontier_append_locked(p, b->uses[i], &graph, &nodes, &n, &cap);
    if (!ok || !n) {   /* n == 0: nothing captured yet to order the uses by (as PyTorch) */
        free(nodes);
        return;
    }
    b->markers = nodes;
    b->nmarkers = n;
    p->nmarked++;
}

void mp_capture_reclaim_locked(mp_pool *p, mp_stream *s) {
    /* One walk of the graph for every marker of s's blocks (the upstream answers per node). */
    size_t n = 0;
    for (mp_block *b = p->pending_head; b; b = b->fnext)
        if (b->markers && b->stream == s) n += b->nmarkers;
    if (!n) return;
    uintptr_t *nodes = malloc(n * sizeof *nodes);
    unsigned char *followed = malloc(n);
    size_t k = 0;
    for (mp_block *b = p->pending_head; nodes && followed && b; b = b->fnext) {
        if (!b->markers || b->stream != s) continue;
        memcpy(nodes + k, b->markers, b->nmarkers * sizeof *nodes);
        k += b->nmarkers;
    }
    if (nodes && followed &&
        p->up.capture_follows(p->up.ctx, s->handle, nodes, n, followed) == MP_OK) {
        k = 0;
        for (mp_block *b = p->pending_head, *next; b; b = next) {
            next = b->fnext;   /* pending too: a completed free merges only free neighbours */
            if (!b->markers || b->stream != s) continue;
            int all = 1;
            for (size_t i = 0; i < b->nmarkers; i++) all &= followed[k + i];
            k += b->nmarkers;
            if (!all) continue;
            pending_remove_locked(p, b);   /* frees the markers */
            b->nuses = 0;                  /* the graph orders them: no event, no wait */
            mp_complete_free_locked(p, b);
        }
    }
    free(nodes);
    free(followed);
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

static int record_deferred_locked(mp_pool *p, mp_block *b, int *stocked);

int mp_process_pending_locked(mp_pool *p) {
    if (mp_capture_stream_locked(p, NULL)) return MP_OK;   /* Note [Graph capture]: no query */
    mp_block *b = p->pending_head;
    int stocked = 0;
    while (b) {
        mp_block *next = b->fnext;
        if (!b->events) {
            int r = record_deferred_locked(p, b, &stocked);
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
            mp_complete_free_locked(p, b);
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
        mp_complete_free_locked(p, b);
    }
}

/* Note [Graph capture]: the events of a free deferred during a capture, recorded once no
 * capture touches its streams. 0: still deferred; 1: recorded; 2: a stream had to be
 * synchronized, with the lock dropped meanwhile (the caller's list walk starts again). */
static int record_deferred_locked(mp_pool *p, mp_block *b, int *stocked) {
    if (mp_capture_uses_locked(p, b)) return 0;
    drop_markers_locked(p, b);   /* the capture is over: events order it now */
    /* Note [Events outside the lock]: made with the lock dropped for every deferred free at
     * once, then the walk starts again; once per walk, so that a creation that fails (or
     * another thread's draw meanwhile) ends in the sync below, not in a loop. */
    if (b->nuses > p->nevent_cache && !*stocked) {
        size_t want = 0;
        for (mp_block *d = p->pending_head; d; d = d->fnext)
            if (!d->events) want += d->nuses;
        *stocked = 1;
        mp_event_stock_locked(p, want);
        return 2;
    }
    uintptr_t *events = malloc(b->nuses * sizeof *events);
    if (!events) return 0;
    uint16_t nsync = record_uses_locked(p, b, events);
    if (!nsync) {
        if (!b->nuses) {
            pending_remove_locked(p, b);
            mp_complete_free_locked(p, b);
            return 2;   /* the walk's next pointer may have been merged away */
        }
        return 1;
    }
    sync_uses_unlocked(p, b, nsync);
    return 2;
}


/* mp_free of a block that other streams used (record_stream): it stays pending until they
 * pass the free (Note [Stream reuse]). `events` has room for one event per use and is
 * taken. May drop the lock and take it again (sync_uses_unlocked). */
void mp_free_pending_locked(mp_pool *p, mp_block *b, uintptr_t *events) {
    b->state = MP_BLOCK_PENDING;
    if (mp_capture_uses_locked(p, b)) {
        free(events);   /* Note [Graph capture]: recorded once the capture is over */
        pending_push_locked(p, b);
        capture_mark_locked(p, b);   /* Note [Capture reuse] */
        return;
    }
    uint16_t nsync = record_uses_locked(p, b, events);
    if (nsync) {
        pending_push_locked(p, b);
        sync_uses_unlocked(p, b, nsync);
    } else if (b->nuses) {
        pending_push_locked(p, b);
    } else {
        mp_complete_free_locked(p, b);
    }
}

int mp_record_stream(mp_pool *p, uintptr_t ptr, uintptr_t stream) {
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    mp_block *b = mp_live_block_locked(p, ptr);
    int rc = MP_OK;
    if (!b) {
        rc = mp_classify_bad_pointer_locked(p, ptr);
        if (rc == MP_OK) rc = MP_ENOTFOUND;
        goto done;
    }
    mp_stream *s = mp_stream_get_locked(p, stream);
    if (!s) {
        rc = MP_ENOMEM;
        goto done;
    }
    if (s == b->stream || mp_use_has(b, s)) goto done;
    if ((rc = mp_use_reserve(b)) == MP_OK) b->uses[b->nuses++] = s;
done:
    mp_lock_release(&p->lock);
    return rc;
}

/* ---------------------------------------------------------------- streams going away */

/* Note [Forgotten streams]: hand everything the pool keeps on s,
 * which has no work left, to the legacy stream, and release s's expandable ranges that hold
 * nothing else. Afterwards nothing of the pool refers to s. */
static void hand_over_stream_locked(mp_pool *p, mp_stream *s, mp_stream *legacy,
                                    mp_release_list *rel) {
    if (s->hot) mp_hot_flush_stream_locked(p, s);
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
        mp_use_remove(b, s);
        if (!b->nuses) {
            pending_remove_locked(p, b);
            mp_complete_free_locked(p, b);
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
            if (b->state == MP_BLOCK_ALLOCATED) mp_use_remove(b, s);
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
        if (moved) mp_remerge_segment_locked(p, seg);
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
        mp_stream_unhold_locked(p, d);
        free(d);
    }
}

int mp_forget_stream(mp_pool *p, uintptr_t handle) {
    if (handle == 0) return MP_OK;   /* the legacy stream is never destroyed */
    mp_release_list rel = {0};
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    reap_dead_locked(p, &rel);
    mp_stream *known = mp_stream_find_locked(p, handle);
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
    mp_stream *s = mp_stream_find_locked(p, handle);
    mp_stream *legacy = s && rc == MP_OK ? mp_stream_get_locked(p, 0) : NULL;
    if (!legacy) {
        mp_lock_release(&p->lock);
        if (!s) return MP_OK;
        return rc == MP_OK ? MP_ENOMEM : rc;
    }
    hand_over_stream_locked(p, s, legacy, &rel);
    /* Its pending frees may have dropped the lock (an event to make, a stream to sync), and
     * other threads added or forgotten streams meanwhile: its index is found again, and a
     * forget of the same handle that took it then has handed it over already. */
    if (s->index == MP_STREAM_DEAD) {
        mp_lock_release(&p->lock);
        mp_release_finish(p, &rel);
        return MP_OK;
    }
    mp_stream_remove_locked(p, s);
    mp_stream_unhold_locked(p, s);   /* holds nothing now; a dead one is linked again if it gets some */
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

