/* Note [Expandable segments]
 * Why: a caching pool fragments when a freed block cannot serve a larger request next to
 * it. With address space reserved far beyond what is mapped, the blocks of one stream and
 * size kind live in one contiguous range: free neighbours always merge, and growth maps
 * pages into the range instead of taking a new segment.
 * Layout (mp_expand_range.c): one range per (stream, small/large), reserved on the stream's
 * first request of that kind, as large as the device; given back once its stream is
 * forgotten and nothing in it is mapped (Note [Forgotten streams]), else at destroy. A
 * block is allocated or pending, free (mapped, in its owner's free list) or unmapped (in no
 * list, page-aligned); one another stream takes stays in place and merges only with that
 * stream's free blocks. A range whose address space is used up hands growth to a new one.
 * initial_pool_size pages stay mapped at the start of stream 0's large range.
 * Growth (this file): with no fit in the free lists, map the unmapped block that, joined
 * with the stream's free neighbours, holds the request with the fewest new bytes.
 * Release (mp_expand_release.c): unmap whole physical allocations inside runs of free
 * blocks (Note [Growth extents]), largest runs first, after syncing the streams that freed
 * them: on demand, before passing the limit or the gc threshold, when the device is full,
 * and by the high-water rule, where a growth past the most the pool ever held first gives
 * back the idle allocations outside it (Note [Large growths], Note [Layout records]).
 * Threads: the lock is dropped around map, unmap and syncs; pages in flight form a busy
 * block no other thread touches, counted against the limit until unmapped.
 * Limits: max_split_size does not apply; each release costs a sync of the streams it takes
 * pages from; nothing is unmapped during a graph capture (Note [Graph capture]).
 * Why these choices and not others: see docs/decisions.md. */

/* Note [Large growths]
 * The high-water rule's floor (MP_HIGH_WATER_MIN_IDLE, and 1/MP_HIGH_WATER_IDLE_DIV of the
 * mark) keeps its syncs few over many small growths, but lets one large growth (a
 * convolution's workspace, say) map at a range's end while idle allocations sit in holes
 * below it. So a growth past the mapped mark, held to the high-water rule's terms, that
 * needs at least 1/MP_HIGH_WATER_LARGE_DIV of the mark and MP_HIGH_WATER_LARGE_MIN first
 * gives back every idle whole allocation outside it, however few bytes they hold. Such
 * growths are rare, and each costs the driver more than the sync a release adds. A
 * layout's record (Note [Layout records]) keeps its own terms. */

/* Note [Layout records]
 * A loop whose steps recur in random order (lengths padded to buckets) lays its blocks out
 * anew each step, so a growth may pass the mapped mark with no more live bytes than before;
 * releasing every idle allocation then gives back pages the next steps map again. The pool
 * keeps its own live mark (the most bytes ever allocated at once; reset_peak_stats() does
 * not move it). A growth past the mapped mark that also takes live bytes past their mark
 * releases as the high-water rule says. One that does not (a layout's record) releases only
 * with 1/MP_LAYOUT_IDLE_DIV of the mapped mark idle, and once until live bytes set a new
 * record (layout_release_mark: the live mark of the last such release). A growth that would
 * map more than 1/MP_LAYOUT_SLACK_DIV past the live mark releases as before, so that
 * layouts that never settle cannot ratchet the footprint up unchecked. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mp_capture.h"
#include "mp_expand_internal.h"

typedef struct grow_plan {
    mp_block *u;          /* the unmapped block mapped into */
    uintptr_t at;         /* first byte mapped (page-aligned, inside u) */
    size_t nbytes;        /* bytes mapped */
    size_t need;          /* bytes the request needs mapped (< nbytes: Note [Edge growth]) */
    uintptr_t lo, hi;     /* u with the free neighbours it joins: kept out of releases */
} grow_plan;

static int free_of(const mp_block *b, const mp_stream *s) {
    return b && b->state == MP_BLOCK_FREE && b->stream == s;
}

/* Note [Edge growth]
 * Most growths of a warm-up extend a range at its end by a few pages for one request, and
 * each costs a physical allocation (Note [Growth extents]). min_map_size makes a growth at
 * the end of a range (into the unmapped tail, from its low end) map at least that much, as
 * one allocation; the rest is a free block at the edge that the next requests take without
 * a growth. Holes between mapped pages are still filled to the page. The price is what lies
 * unused at the edge at the peak, at most min_map_size a range, so it is off by default.
 * Under a limit every free page must be able to go (max_map_bytes), so there it is ignored;
 * it never takes the pool past the garbage collection threshold, and the room a growth makes
 * (that threshold, the high-water rule) is for what the request needs (grow_locked). A
 * rounded map the device refuses is followed at once by the exact growth (the caller's
 * `exact`, mp_expand_alloc_locked), never by releases or a wait, so the option never makes a
 * request fail that would fit without it. */
static size_t edge_growth(const mp_pool *p, const mp_block *u, uintptr_t at, size_t n,
                          int exact) {
    size_t least = p->cfg.min_map_size;
    if (exact || !least || u->next || at != u->ptr || mp_effective_limit(p) != MP_UNLIMITED)
        return n;
    if (least >= u->nbytes) return u->nbytes;   /* the whole tail (no rounding past it) */
    least = mp_round_up(least, p->up.granularity);   /* <= u->nbytes: a whole number of pages */
    return least > n ? least : n;
}

/* Where to map so that a free block of s holds `size`: the unmapped block that, joined with
 * the free blocks of s beside it, needs the fewest new bytes (the lowest address on a tie),
 * at the end of a range at least min_map_size (Note [Edge growth]). 0 when the range has no
 * room left. */
static int plan_growth_locked(const mp_pool *p, mp_segment *seg, mp_stream *s, size_t size,
                              int exact, grow_plan *out) {
    size_t g = p->up.granularity;
    int found = 0;
    size_t best = 0;   /* the fewest new bytes a candidate needs (before Note [Edge growth]) */
    for (mp_block *u = seg->first; u; u = u->next) {
        if (u->state != MP_BLOCK_UNMAPPED || u->busy) continue;
        size_t left = free_of(u->prev, s) ? u->prev->nbytes : 0;
        size_t right = free_of(u->next, s) ? u->next->nbytes : 0;
        if (left + u->nbytes + right < size) continue;
        size_t n = u->nbytes;   /* the whole hole, joining both neighbours */
        uintptr_t at = u->ptr;
        if (left + u->nbytes >= size && mp_round_up(size - left, g) < n) n = mp_round_up(size - left, g);
        if (right + u->nbytes >= size && mp_round_up(size - right, g) < n) {
            n = mp_round_up(size - right, g);
            at = u->ptr + u->nbytes - n;
        }
        if (found && n >= best) continue;   /* candidates compare by what they need */
        found = 1;
        best = n;
        out->u = u;
        out->at = at;
        out->need = n;
        out->nbytes = edge_growth(p, u, at, n, exact);
        out->lo = left ? u->prev->ptr : u->ptr;
        out->hi = u->ptr + u->nbytes + right;
    }
    return found;
}

/* Map the planned pages and hand out the free block holding them (*out, in no list; NULL
 * when the neighbours it joined changed while the lock was dropped: search again). One
 * physical allocation per max_map_bytes of the growth, each a map call of its own (Note
 * [Growth extents]). */
static int map_locked(mp_pool *p, mp_segment *seg, mp_stream *s, const grow_plan *plan,
                      size_t size, mp_block **out) {
    growth_cut cut = cut_growth(p, plan->nbytes);
    if (!ex_extents_reserve(seg, cut.n)) return MP_ENOMEM;
    /* The pages become a busy block of their own, so that the rest of u stays open to
     * other threads while the lock is dropped. */
    mp_block *u = plan->u, *m = u;
    if (plan->nbytes < u->nbytes) {
        if (!(m = mp_block_new_locked(p))) return MP_ENOMEM;
        m->ptr = plan->at;
        m->nbytes = plan->nbytes;
        m->stream = s;
        m->state = MP_BLOCK_UNMAPPED;
        int after = plan->at > u->ptr;
        link_block(u, m, after);
        if (!after) u->ptr += plan->nbytes;
        u->nbytes -= plan->nbytes;
    }
    m->busy = 1;
    ex_extents_insert(seg, m->ptr, &cut);
    p->inflight_bytes += plan->nbytes;
    mp_publish_held_locked(p);
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    mp_assert(m->state == MP_BLOCK_UNMAPPED && m->nbytes > 0);
    mp_assert(m->ptr % p->up.granularity == 0 && m->nbytes % p->up.granularity == 0);
    mp_assert(m->ptr >= m->seg->ptr && m->ptr + m->nbytes <= m->seg->ptr + m->seg->nbytes);
    int rc = MP_OK;
    size_t done = 0;   /* pieces mapped */
    for (; rc == MP_OK && done < cut.n; done += rc == MP_OK) {
        size_t off = cut_off(&cut, done);
        rc = p->up.map(p->up.ctx, m->ptr + off, cut_off(&cut, done + 1) - off);
    }
    /* All or nothing: the pieces mapped before a failure go again (each whole). */
    for (size_t i = 0; rc != MP_OK && i < done; i++)
        p->up.unmap(p->up.ctx, m->ptr + cut_off(&cut, i), cut_off(&cut, i + 1) - cut_off(&cut, i));
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    p->inflight_bytes -= plan->nbytes;
    mp_publish_held_locked(p);
    m->busy = 0;
    if (rc != MP_OK) {
        /* The upstream undid any pages it had mapped, so the range is unmapped as before.
         * Out of device memory, free pages elsewhere may make room (the caller then comes
         * back). */
        extents_remove(seg, m->ptr, m->ptr + m->nbytes);
        ex_merge_unmapped_locked(p, m);
        if (rc == MP_ENOMEM && plan->nbytes == plan->need &&   /* Note [Edge growth] */
            !mp_capture_stream_locked(p, s) &&                  /* Note [Graph capture] */
            ex_release_pages_locked(p, plan->nbytes, plan->lo, plan->hi, 1, NULL, NULL)) {
            p->stats.num_alloc_retries++;
            return MP_OK;
        }
        return rc;
    }
    m->stream = s;
    extents_set_busy(seg, m->ptr, m->ptr + m->nbytes, 0);
    ex_count_mapped_locked(p, seg, m->nbytes, 1);
    p->stats.num_device_alloc += cut.n;
    for (size_t i = 0; mp_segment_events_wanted(p) && i < cut.n; i++)
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_MAP, m->ptr + cut_off(&cut, i),
                                cut_off(&cut, i + 1) - cut_off(&cut, i), s->handle);
    mp_insert_free_merged_locked(p, m);   /* m absorbs its free neighbours of s */
    if (m->nbytes >= size) {
        mp_remove_free_locked(p, m);
        *out = m;
    }
    return MP_OK;
}

/* The high-water rule's share of the mapped mark that must be idle for a growth of `size`
 * to `need` mapped bytes, past that mark, to release it; 0 for no release. *layout_mark:
 * the live mark a release for a layout's record would spend (Note [Layout records]), else 0. */
static size_t high_water_div_locked(const mp_pool *p, size_t size, size_t need,
                                    size_t *layout_mark) {
    *layout_mark = 0;
    size_t live_mark = mp_live_mark_locked(p);
    if ((size_t)mp_hot_current(p, MP_HOT_ALLOCATED_BYTES) + size > live_mark)
        return MP_HIGH_WATER_IDLE_DIV;                          /* a live record */
    if (need > live_mark + live_mark / MP_LAYOUT_SLACK_DIV)
        return MP_HIGH_WATER_IDLE_DIV;                          /* drifted too far past it */
    if (live_mark <= p->layout_release_mark) return 0;          /* spent at this live mark */
    *layout_mark = live_mark;
    return MP_LAYOUT_IDLE_DIV;
}

/* Make a free block of at least `size` in s's range by mapping pages, and hand it out
 * (*out; NULL when the pool changed meanwhile: search again). MP_ENOMEM / MP_ELIMIT when it
 * cannot grow. exact: map only what the request needs; *rounded: the device refused a
 * growth that Note [Edge growth] had made larger than that. */
static int grow_locked(mp_pool *p, mp_stream *s, int kind, size_t size, int exact,
                       int *rounded, mp_block **out) {
    *out = NULL;
    *rounded = 0;
    /* A new range is reserved with the lock dropped: other threads may have freed blocks
     * of s meanwhile, so the caller searches again before planning in it. */
    int reserving = !s->expandable[kind];
    mp_segment *seg = ex_segment_of_locked(p, s, kind, size);
    if (!seg) return MP_ENOMEM;
    if (reserving) return MP_OK;
    grow_plan plan = {0};
    if (!plan_growth_locked(p, seg, s, size, exact, &plan)) {
        /* The range's address space is used up (by blocks, or by holes too small for the
         * request): a new range takes over the growth; the old one keeps its blocks. */
        if (!seg->mapped_bytes || size > seg->nbytes) return MP_ENOMEM;
        s->expandable[kind] = NULL;
        mp_segment *fresh = ex_segment_of_locked(p, s, kind, size);
        if (!fresh) {
            s->expandable[kind] = seg;
            return MP_ENOMEM;
        }
        seg->growing = 0;   /* released once empty (mp_expand_drop_empty_locked) */
        return MP_OK;       /* the lock was dropped: search again, then plan in `fresh` */
    }
    /* A free block of s that holds `size` beside the hole (it came while the lock was
     * dropped since the search): nothing to map, search again. */
    if (!plan.nbytes) return MP_OK;

    /* Note [Edge growth]: the rounding is opportunistic. It never takes the pool past the
     * garbage collection threshold (under a limit there is none), and the room made below
     * is for what the request needs: the rounding makes no release of its own. */
    size_t threshold = mp_gc_threshold_bytes(p);   /* SIZE_MAX: none */
    if (plan.nbytes > plan.need && mp_reserved_now_locked(p) + plan.nbytes > threshold)
        plan.nbytes = plan.need;

    /* Room first, from free pages elsewhere: down to the limit (required), below the
     * garbage collection threshold (best effort), and all idle pages before a new high
     * water mark when they are many (Note [Expandable segments]). */
    size_t need = mp_reserved_now_locked(p) + plan.need;
    size_t excess = mp_limit_excess_locked(p, plan.nbytes);   /* Note [Shared limit] */
    if (need > threshold && need - threshold > excess) excess = need - threshold;
    size_t layout_mark = 0;   /* a release of the high-water rule for a layout's record */
    if (need > p->mapped_high_water) {
        size_t div = high_water_div_locked(p, size, need, &layout_mark);
        /* Note [Large growths]: no share of the mark, and no floor, for a large one. */
        int large = div == MP_HIGH_WATER_IDLE_DIV &&
                    plan.need >= p->mapped_high_water / MP_HIGH_WATER_LARGE_DIV &&
                    plan.need >= MP_HIGH_WATER_LARGE_MIN;
        size_t idle = div ? ex_idle_bytes_locked(p, plan.lo, plan.hi) : 0;
        if (div && idle &&
            (large || (idle >= MP_HIGH_WATER_MIN_IDLE && idle >= p->mapped_high_water / div)))
            excess = idle > excess ? idle : excess;
        else
            layout_mark = 0;
    }
    if (excess && !mp_capture_stream_locked(p, s) &&   /* Note [Graph capture] */
        ex_release_pages_locked(p, excess, plan.lo, plan.hi, 1, NULL, NULL)) {
        if (layout_mark) p->layout_release_mark = layout_mark;
        return MP_OK;   /* re-plan */
    }
    if (mp_limit_excess_locked(p, plan.nbytes)) return MP_ELIMIT;
    int edge = !plan.u->next && plan.at == plan.u->ptr;   /* into the unmapped tail */
    int rc = map_locked(p, seg, s, &plan, size, out);
    *rounded = rc == MP_ENOMEM && plan.nbytes > plan.need;
    if (rc == MP_OK && edge && p->cfg.map_ahead) mp_mapper_want_ahead_locked(p, seg);
    return rc;
}

/* Note [Mapper]: the bytes stock may add to the pool without passing the limit, the garbage
 * collection threshold or the release threshold (SIZE_MAX: no bound). */
static size_t stock_room_locked(mp_pool *p, size_t want) {
    size_t excess = mp_limit_excess_locked(p, want);   /* Note [Shared limit] */
    size_t room = excess < want ? want - excess : 0;
    size_t reserved = mp_reserved_now_locked(p);
    size_t gc = mp_gc_threshold_bytes(p);
    if (gc != SIZE_MAX && reserved + room > gc) room = gc > reserved ? gc - reserved : 0;
    size_t rt = p->cfg.release_threshold;
    size_t cached = reserved - (size_t)mp_hot_current(p, MP_HOT_ACTIVE_BYTES);
    if (rt != MP_UNLIMITED && cached + room > rt) room = rt > cached ? rt - cached : 0;
    return room;
}

size_t mp_expand_stock_edge_locked(mp_pool *p, mp_segment *seg) {
    mp_stream *s = seg->stream;
    if (!seg->growing || s->expandable[seg->kind] != seg || !seg->first) return 0;
    if (mp_capture_stream_locked(p, s)) return 0;   /* Note [Graph capture] */
    mp_block *u = seg->first;
    while (u->next) u = u->next;
    if (u->state != MP_BLOCK_UNMAPPED || u->busy) return 0;   /* no tail, or one in flight */
    mp_block *e = free_of(u->prev, s) ? u->prev : NULL;   /* the free block at the edge */
    size_t g = p->up.granularity, have = e ? e->nbytes : 0;
    if (have >= p->cfg.map_ahead) return 0;
    size_t want = mp_round_up(p->cfg.map_ahead - have, g);
    if (want > u->nbytes) want = u->nbytes;
    want = round_down(stock_room_locked(p, want), g);
    if (!want) return 0;
    /* need 0: a refused map makes no release (map_locked), and no request waits on it. */
    grow_plan plan = {u, u->ptr, want, 0, e ? e->ptr : u->ptr, u->ptr + u->nbytes};
    size_t pieces = cut_growth(p, want).n;
    mp_block *none = NULL;
    return map_locked(p, seg, s, &plan, SIZE_MAX, &none) == MP_OK ? pieces : 0;
}

int mp_expand_alloc_locked(mp_pool *p, mp_stream *s, int kind, size_t size,
                           mp_release_list *rel, mp_block **out) {
    /* rel: expandable pools release pages here, not whole segments; it tells the capture. */
    int rc = MP_ENOMEM, stage = 0;
    int exact = 0;   /* Note [Edge growth]: the device refused a rounded growth */
    for (int round = 0; round < 32; round++) {
        if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
        if (p->nhot) {
            /* Note [Hot blocks]: a parked block is not free to growth planning nor to
             * releases: fold them in first, as the plain free would have. */
            mp_hot_flush_locked(p);
            if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
        }
        int rounded = 0;
        rc = grow_locked(p, s, kind, size, exact, &rounded, out);
        if (rc == MP_OK) {
            if (*out) return MP_OK;
            continue;
        }
        if (rounded) {   /* the exact growth, before any release or wait */
            exact = 1;
            continue;
        }
        if (rc != MP_ENOMEM && rc != MP_ELIMIT) return rc;
        if (stage == 0 && rc == MP_ENOMEM) {
            /* The device refused (free pages outside the growth were released meanwhile):
             * once more, as the upstream path retries a failed segment allocation. */
            stage = 1;
            p->stats.num_alloc_retries++;
            continue;
        }
        if (stage < 2 && p->npending && !mp_capture_call_locked(p, rel)) {
            /* Last resort: wait for the streams that hold frees pending, then try again. */
            stage = 2;
            p->stats.num_alloc_retries++;
            mp_sync_pending_unlocked(p);
            continue;
        }
        return rc;
    }
    return MP_ENOMEM;   /* the pool kept changing under us */
}

int mp_expand_reserve_initial(mp_pool *p, size_t nbytes) {
    mp_lock_acquire(&p->lock);
    mp_stream *s = mp_stream_get_locked(p, 0);
    mp_segment *seg = s ? ex_segment_of_locked(p, s, KIND_LARGE, nbytes) : NULL;
    mp_block *b = NULL;
    grow_plan plan = {0};
    /* As for plain segments, the initial reservation is not held to the limit. */
    int rc = seg && plan_growth_locked(p, seg, s, nbytes, 1, &plan)
                 ? map_locked(p, seg, s, &plan, nbytes, &b) : MP_ENOMEM;
    if (rc == MP_OK && !b) rc = MP_ENOMEM;
    if (rc == MP_OK) {
        seg->pinned = 1;   /* its pages up to initial_pool_size stay mapped */
        mp_insert_free_locked(p, b);
    }
    mp_lock_release(&p->lock);
    return rc;
}
