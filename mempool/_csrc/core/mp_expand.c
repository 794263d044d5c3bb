/* Note [Expandable segments]
 *
 * Why: a caching pool fragments when a freed block cannot serve a larger request next to
 * it: memory sits reserved but unusable. With address space reserved far beyond what is
 * mapped, every block of a stream lives in one contiguous range, so free neighbours always
 * merge, and growth maps pages at a free edge or into an unmapped hole instead of taking a
 * new segment. reserved_bytes counts mapped bytes; the address space shows in
 * va_reserved_bytes.
 *
 * Layout: one range per (stream, small/large), reserved on the stream's first request of
 * that kind, as large as the device (p->capacity, or the request if larger), released when
 * its stream is forgotten or, once no stream grows it, when nothing in it is mapped (Note
 * [Forgotten streams] in mp_stream.c), else when the pool is destroyed. Per stream, because a block may be reused in its stream's
 * order at once, so free neighbours of one stream merge without any event; per size kind,
 * because small blocks left live among large ones would pin pages and split large free
 * runs (one range per stream for both kinds measured no better on the transformer loop:
 * docs/expandable.md). A range holds blocks in three states: allocated or pending, free
 * (mapped, in its owner's free list) and unmapped (in no list, page-aligned). A block taken
 * by another stream (cross-stream reuse, or freed there) stays where it is and merges only
 * with free blocks of its new owner. Should a range's address space be used up (its holes
 * too small for a request the device could still hold), a new range takes over the growth
 * and the old one keeps its blocks.
 *
 * Growth, when no free list has a fit: among the unmapped blocks of the stream's range,
 * take the one that, joined with the free blocks of the stream on either side of it, holds
 * the request with the fewest new bytes (the lowest address on a tie), and map just those
 * pages next to the free neighbour they extend. Without releases that is the edge of the
 * mapped part, extended by the request less the free block already there; after releases,
 * holes are refilled before the edge moves whenever that maps less.
 *
 * Release unmaps whole physical allocations inside runs of free blocks (Note [Growth
 * extents]; adjacent free blocks of any owners: blocks of two streams never merge, but a page
 * they share is free all the same), the largest runs first (fewest unmap calls and splits
 * per byte), taking from a run's high end only as many as are still wanted. Unmapping does
 * not wait for queued work, so the streams that freed those pages are synchronized first,
 * each once; pages of a stream that cannot be synchronized, or that fail to unmap, become
 * free blocks of their owners again.
 * Releases happen on demand (empty_cache, trim, release_threshold), before growing past the
 * limit (required) or the garbage collection threshold (best effort), when the device is
 * out of memory, and under the high-water rule below. The pages a growth is about to join
 * are never released for it: that would only map them again. initial_pool_size pages are
 * mapped at the start of stream 0's large range and stay mapped (its pinned prefix).
 *
 * The high-water rule: a growth that would map more bytes than the pool has ever held at
 * once first releases every idle whole allocation outside the growth, provided they add up
 * to at least MP_HIGH_WATER_MIN_IDLE and 1/MP_HIGH_WATER_IDLE_DIV of that high-water mark.
 * Best fit leaves holes between live blocks (freed temporaries; state created once, such as an
 * optimizer's, among the first step's blocks), and without the rule the footprint ratchets
 * up over them: peak reserved / peak live 1.019 on the shipped transformer trace, up to
 * 1.033 on other seeds of its generator. With it, physical pages move from idle holes to
 * where they are needed: 1.012, at most 1.013, for 1 to 13 stream syncs per run, all while
 * the footprint set a new record (docs/expandable.md), measured with one allocation per
 * page; it acts on whole allocations only (Note [Growth extents]). The floor keeps the syncs
 * few: with none, 1.007 for 17 to 37. The mark is the pool's own: reset_peak_stats() does
 * not move it. A growth past the mark while live bytes set no record of their own is held
 * to stricter terms (Note [Layout records]).
 *
 * A large growth is an exception (Note [Large growths] below).
 *
 * Failures: map is all or nothing (the upstream undoes a partial map), so a failed growth
 * leaves its range unmapped as before; out of device memory, free pages elsewhere are
 * released and the map is tried once more, then pending frees are waited for.
 *
 * Threads: the lock is dropped around map, unmap and stream syncs. Pages being mapped or
 * unmapped form a block of their own marked busy: no other thread maps, merges or releases
 * it meanwhile, and the rest of the range stays open to them. Pages being unmapped stay
 * counted against the limit (inflight_bytes) until they are gone.
 *
 * Limits: max_split_size has no meaning with expandable segments (the configuration refuses
 * the pair). A range that a stream still grows is never given back before the stream is
 * forgotten or the pool destroyed. Each release
 * costs a sync of the streams it takes pages from, which makes a release_threshold that is
 * crossed at every free expensive. A stream sync or query inside a CUDA graph capture would
 * break it: no page is unmapped while a capture is under way (Note [Graph capture] in
 * mp_capture.h), growth maps pages as usual.
 */

/* Note [Large growths]
 *
 * Why: the high-water rule's floor (MP_HIGH_WATER_MIN_IDLE, and 1/MP_HIGH_WATER_IDLE_DIV of
 * the mark) keeps its syncs few over a warm-up's many growths. A growth of a large share of
 * the mark is another matter: cuDNN's benchmark (torch.backends.cudnn.benchmark) tries
 * workspaces of several GiB while a ResNet-50 holds 10 GiB, and the growth for one maps GiBs
 * at the range's end while idle allocations sit in holes below it, too few for the floor.
 * The footprint's peak is then the workspace plus those holes.
 *
 * Approach: a growth past the mapped mark held to the high-water rule's own terms (it sets
 * a live record, or drifts past the live mark's slack) that needs at least
 * 1/MP_HIGH_WATER_LARGE_DIV of the mark and MP_HIGH_WATER_LARGE_MIN first gives back every
 * idle whole allocation outside it, however few bytes they hold. Such growths are rare (a
 * few per run), and each already costs the driver more than the sync and unmaps a release
 * adds. A layout's record (Note [Layout records]) keeps its own terms.
 *
 * Measured on sim with cuda's 8 MiB pages, replaying recorded runs (docs/expandable.md): the
 * two ResNet-50 recordings (cuDNN benchmark on) peak 16 and 56 MiB lower, for one more sync
 * each in warm-up; the GPT, GPT-2 and Llama recordings, and the shipped transformer, vision
 * and small traces, make the same calls and peak where they did.
 * tests/test_expandable_large_growth.py.
 */

/* Note [Layout records]
 *
 * Why: a training loop whose steps recur in random order (lengths padded to buckets, say)
 * lays its blocks out anew each step, so once in a while a growth passes the mapped mark
 * with no more live bytes than before. Releasing every idle allocation then gives back the
 * previous step's pages, which the next steps map again: Hugging Face GPT-2 and Llama loops
 * of 30 and 60 bucketed steps made 24 to 289 physical allocations, 11 to 64 unmaps and 3 to
 * 8 stream syncs after their warm-up, where PyTorch's expandable segments made one
 * allocation and the default path none (bench/results/2026-12-05-late.md).
 *
 * Approach: the pool keeps its own live mark (the most bytes ever allocated at once;
 * reset_peak_stats() does not move it). A growth past the mapped mark that also takes live
 * bytes past their mark releases as before. One that does not (a layout's record) releases
 * only with 1/MP_LAYOUT_IDLE_DIV of the mapped mark idle, and once until live bytes set a
 * new record (layout_release_mark: the live mark of the last such release). One large
 * release, such as the previous step's activations between two warm-up steps, lays the
 * later steps out compactly; more restart the cycle of releases and maps. A smaller share (1/96, 1/128)
 * spends that one release on a small compaction early in the warm-up, and the GPT runs then
 * drift to 1.12-1.15 of their live peak. So that a loop whose layouts never settle cannot
 * ratchet its footprint up unchecked, a growth that would map more than
 * 1/MP_LAYOUT_SLACK_DIV past the live mark releases as before, whatever the budget.
 *
 * Measured on sim, replaying the recorded runs with cuda's 8 MiB pages: the timed steps of
 * eight bucketed runs made 0 to 2 physical allocations, no unmap and no sync, for peak
 * reserved / peak live 1.095-1.107 (1.078-1.121 before); the shipped traces and ResNet-50
 * are unchanged; GPT with a new length every step holds 1.069 (1.062 before; PyTorch's
 * expandable segments 1.103). With 2 MiB pages the GPT runs map 18-19 allocations in their
 * timed steps, still growing, and unmap nothing. A random alloc/free loop whose layouts
 * never settle holds at most 1.125 of its live mark for 7 to 17 syncs (17 to 40 before, at
 * 1.03-1.08; with no slack, 1.25-1.40 for one). tests/test_expandable_layout_records.py.
 */

/* Note [Growth extents]
 *
 * Why: a driver's time for expandable segments follows the number of physical allocations,
 * not their bytes (a cuMemCreate and a cuMemMap each), and it maps and unmaps a physical
 * allocation only whole: cuMemMap at an offset into a larger one is not supported, and
 * cuMemUnmap refuses part of a mapping. One allocation per page made a page the unit of both
 * growth and release, and the page size a choice between driver calls and memory (2 MiB
 * pages: 4,145 physical allocations on the shipped transformer trace; docs/expandable.md).
 *
 * Approach: a growth of N pages is one map call, one physical allocation (cut into pieces of
 * max_map_size, default MP_DEFAULT_MAX_MAP, when larger, so that a huge growth is a few).
 * Each segment keeps its allocations ("extents") in address order; they tile its mapped
 * bytes exactly, so the edges between mapped and unmapped blocks are extent edges. Every
 * release (empty_cache, trim, release_threshold, the limit, garbage collection, out of
 * memory, the high-water rule, forget_stream, destroy) unmaps only extents wholly inside a
 * run of free blocks (run_pages), taking from a run's high end as few as cover what is
 * wanted; the high-water rule counts only those as idle. Pages and blocks are as before:
 * growth is planned in pages, blocks split and merge across extents freely. An extent being
 * mapped or unmapped is busy (inside the busy unmapped block), so that check_invariants,
 * which checks the tiling, holds while the lock is dropped. sim and host keep the driver's
 * rule (mp_mappings_whole in mp_budget.h): an unmap that cuts an allocation is refused.
 *
 * Limits: a free page of an allocation that still holds a block cannot be released; that is
 * the price of fewer driver calls. Best fit reuses the start of large free blocks, so free
 * tails sit in allocations in use, and the high-water rule finds few idle allocations whole:
 * on the shipped transformer trace with 2 MiB pages it no longer fires and the footprint is
 * that of no rule; with 8 MiB pages, and on the vision trace, the ratio stays within a page
 * of the page-per-allocation figure (docs/expandable.md, "Where the time goes", has the
 * counts). Under a limit that costs more: the pool gives back less when it must, and on the
 * shipped transformer trace under a limit below its live peak it refused 10 requests where
 * one allocation per page refused 1. So a pool with a limit maps one allocation per page
 * unless max_map_size is set; max_map_size = the page gives that to any pool.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mp_capture.h"
#include "mp_expand.h"

static size_t round_down(size_t n, size_t g) { return n / g * g; }

/* The end of a segment's pinned prefix: initial_pool_size pages, never unmapped before the
 * pool is destroyed. */
static uintptr_t pinned_end(const mp_pool *p, const mp_segment *seg) {
    return seg->pinned ? seg->ptr + mp_round_up(p->cfg.initial_pool_size, p->up.granularity) : seg->ptr;
}

/* Link new block n into b's segment, just before b (or after it). */
static void link_block(mp_block *b, mp_block *n, int after) {
    mp_block_join(n, b->seg);
    if (after) {
        n->prev = b;
        n->next = b->next;
        if (b->next) b->next->prev = n;
        b->next = n;
    } else {
        n->next = b;
        n->prev = b->prev;
        if (b->prev) b->prev->next = n;
        else b->seg->first = n;
        b->prev = n;
    }
}

/* Fold unmapped neighbours that are not busy into u (unmapped, not busy); u may go. */
static void merge_unmapped_locked(mp_pool *p, mp_block *u) {
    mp_assert(u->state == MP_BLOCK_UNMAPPED && !u->busy);
    mp_block *n = u->next;
    if (n && n->state == MP_BLOCK_UNMAPPED && !n->busy) {
        u->nbytes += n->nbytes;
        u->next = n->next;
        if (n->next) n->next->prev = u;
        mp_block_delete_locked(p, n);
    }
    mp_block *q = u->prev;
    if (q && q->state == MP_BLOCK_UNMAPPED && !q->busy) {
        q->nbytes += u->nbytes;
        q->next = u->next;
        if (u->next) u->next->prev = q;
        mp_block_delete_locked(p, u);
    }
}

static void count_mapped_locked(mp_pool *p, mp_segment *seg, size_t nbytes, int mapped) {
    if (mapped) {
        seg->mapped_bytes += nbytes;
        mp_stat3_inc(p->stats.reserved_bytes, seg->kind, (int64_t)nbytes);
        mp_publish_held_locked(p);
        mp_stat_inc(&p->stats.mapped_bytes, (int64_t)nbytes);
        if ((size_t)p->stats.mapped_bytes.current > p->mapped_high_water)
            p->mapped_high_water = (size_t)p->stats.mapped_bytes.current;
    } else {
        mp_check(seg->mapped_bytes >= nbytes);   /* unmapping more than is mapped */
        seg->mapped_bytes -= nbytes;
        mp_stat3_dec(p->stats.reserved_bytes, seg->kind, (int64_t)nbytes);
        mp_publish_held_locked(p);
        mp_stat_dec(&p->stats.mapped_bytes, (int64_t)nbytes);
    }
}

/* ---------------------------------------------------------------- extents */

/* Note [Growth extents]: seg->extents, the physical allocations mapped in a range. */
typedef struct mp_extent mp_extent;

/* The index of the first extent of seg at or above addr. */
static size_t extent_at(const mp_segment *seg, uintptr_t addr) {
    size_t lo = 0, hi = seg->nextents;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (seg->extents[mid].ptr < addr) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* The largest physical allocation one map call makes: whole pages, at least one. Unless
 * max_map_size says, a pool under a limit maps one per page: there every free page must be
 * able to go (Note [Growth extents], Limits). */
static size_t max_map_bytes(const mp_pool *p) {
    size_t g = p->up.granularity;
    if (!p->cfg.max_map_size && mp_effective_limit(p) != MP_UNLIMITED) return g;
    size_t m = round_down(p->cfg.max_map_size ? p->cfg.max_map_size : MP_DEFAULT_MAX_MAP, g);
    return m ? m : g;
}

/* Room for n more extents in seg; 0 (nothing changed) when out of host memory. */
static int extents_reserve(mp_segment *seg, size_t n) {
    if (seg->nextents + n <= seg->cap_extents) return 1;
    size_t cap = seg->cap_extents ? 2 * seg->cap_extents : 16;
    while (cap < seg->nextents + n) cap *= 2;
    mp_extent *grown = realloc(seg->extents, cap * sizeof *grown);
    if (!grown) return 0;
    seg->extents = grown;
    seg->cap_extents = cap;
    return 1;
}

/* Note [Growth extents]: how a growth of nbytes is cut into physical allocations: pieces of
 * max_map_bytes from the low end, the last one the rest. Piece i is [off(i), off(i + 1)). */
typedef struct growth_cut {
    size_t nbytes, max;
    size_t n;                   /* pieces */
} growth_cut;

static growth_cut cut_growth(const mp_pool *p, size_t nbytes) {
    size_t max = max_map_bytes(p);
    growth_cut c = {nbytes, max, (nbytes + max - 1) / max};
    return c;
}

static size_t cut_off(const growth_cut *c, size_t i) {
    return i >= c->n ? c->nbytes : i * c->max;
}

/* The pieces of growth c at `at`, as busy extents, in room extents_reserve made. */
static void extents_insert(mp_segment *seg, uintptr_t at, const growth_cut *c) {
    size_t i = extent_at(seg, at);
    memmove(&seg->extents[i + c->n], &seg->extents[i], (seg->nextents - i) * sizeof *seg->extents);
    for (size_t k = 0; k < c->n; k++)
        seg->extents[i + k] = (mp_extent){at + cut_off(c, k), cut_off(c, k + 1) - cut_off(c, k), 1};
    seg->nextents += c->n;
}

/* Drop the extents inside [lo, hi) (whole ones: lo and hi are extent edges). */
static void extents_remove(mp_segment *seg, uintptr_t lo, uintptr_t hi) {
    size_t i = extent_at(seg, lo), j = extent_at(seg, hi);
    memmove(&seg->extents[i], &seg->extents[j], (seg->nextents - j) * sizeof *seg->extents);
    seg->nextents -= j - i;
}

static void extents_set_busy(mp_segment *seg, uintptr_t lo, uintptr_t hi, int busy) {
    for (size_t i = extent_at(seg, lo); i < seg->nextents && seg->extents[i].ptr < hi; i++)
        seg->extents[i].busy = busy;
}

int mp_expand_check_extents_locked(const mp_pool *p, const mp_segment *seg, char *why, size_t n) {
    size_t g = p->up.granularity, held = 0;
    uintptr_t end = seg->ptr;
    const mp_block *b = seg->first;
    for (size_t i = 0; i < seg->nextents; i++) {
        const mp_extent *e = &seg->extents[i];
        uintptr_t e_end = e->ptr + e->nbytes;
        if (e->ptr < end || !e->nbytes || e->ptr % g || e->nbytes % g ||
            e_end > seg->ptr + seg->nbytes) {
            snprintf(why, n, "segment %#lx: extent [%#lx, +%zu) misplaced or overlapping",
                     (unsigned long)seg->ptr, (unsigned long)e->ptr, e->nbytes);
            return 1;
        }
        end = e_end;
        if (!e->busy) held += e->nbytes;
        while (b && b->ptr + b->nbytes <= e->ptr) b = b->next;
        /* Mapped blocks lie on idle extents; a busy extent inside a busy unmapped block. */
        for (const mp_block *c = b; c && c->ptr < e_end; c = c->next) {
            int ok = e->busy ? c->state == MP_BLOCK_UNMAPPED && c->busy : c->state != MP_BLOCK_UNMAPPED;
            if (!ok) {
                snprintf(why, n, "segment %#lx: extent [%#lx, +%zu)%s holds block %#lx in state %d",
                         (unsigned long)seg->ptr, (unsigned long)e->ptr, e->nbytes,
                         e->busy ? " (busy)" : "", (unsigned long)c->ptr, c->state);
                return 1;
            }
        }
    }
    if (held != seg->mapped_bytes) {
        snprintf(why, n, "segment %#lx: extents hold %zu bytes, %zu mapped", (unsigned long)seg->ptr,
                 held, seg->mapped_bytes);
        return 1;
    }
    return 0;
}

/* An address-space call, made with the lock dropped: it may wait on the driver's own locks
 * (Note [Events outside the lock]). */
static int va_call_unlocked(mp_pool *p, int reserve, size_t nbytes, uintptr_t *base) {
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    int rc = reserve ? p->up.va_reserve(p->up.ctx, nbytes, base)
                     : p->up.va_release(p->up.ctx, *base, nbytes);
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    return rc;
}

/* The growing range of (s, kind), reserved on first use: address space for the whole
 * device (or for `size`, if larger), nothing mapped. The reservation drops the lock; when
 * another thread gave s a range meanwhile, this one goes back and that one serves (NULL:
 * none could be reserved and none was given). */
static mp_segment *segment_of_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    if (s->expandable[kind]) return s->expandable[kind];
    size_t g = p->up.granularity;
    size_t va = p->cfg.expandable_reserve ? p->cfg.expandable_reserve : p->capacity;
    if (!va) va = (size_t)1 << 40;
    va = mp_round_up(va > size ? va : size, g);
    mp_segment *seg = calloc(1, sizeof *seg);
    mp_block *u = seg ? mp_block_new_locked(p) : NULL;
    uintptr_t base = 0;
    int rc = u ? va_call_unlocked(p, 1, va, &base) : MP_ENOMEM;
    if (rc == MP_OK && s->expandable[kind]) {
        va_call_unlocked(p, 0, va, &base);
        rc = MP_EBUSY;
    }
    if (rc != MP_OK) {
        if (u) mp_block_delete_locked(p, u);
        free(seg);
        return s->expandable[kind];
    }
    seg->ptr = base;
    seg->nbytes = va;
    seg->stream = s;
    seg->kind = kind;
    seg->expandable = 1;
    seg->growing = 1;
    seg->first = u;
    seg->next = p->segments;
    if (p->segments) p->segments->prev = seg;
    p->segments = seg;
    p->nsegments++;
    u->ptr = base;
    u->nbytes = va;
    mp_block_join(u, seg);
    u->stream = s;
    u->state = MP_BLOCK_UNMAPPED;
    s->expandable[kind] = seg;
    mp_stat3_inc(p->stats.segment, kind, 1);
    mp_stat_inc(&p->stats.va_reserved_bytes, (int64_t)va);
    return seg;
}

/* ---------------------------------------------------------------- ranges that go */

int mp_expand_detach_range_locked(mp_pool *p, mp_segment *seg, mp_stream *only,
                                  mp_release_list *out) {
    if (seg->pinned) return 0;
    size_t nruns = 0;
    for (mp_block *b = seg->first; b; b = b->next) {
        if (b->state == MP_BLOCK_UNMAPPED) {
            if (b->busy) return 0;   /* being mapped by another thread */
            continue;
        }
        if (b->state != MP_BLOCK_FREE || b->stream != only) return 0;
        if (!b->prev || b->prev->state == MP_BLOCK_UNMAPPED) nruns++;
    }
    struct mp_run *runs = nruns ? malloc(nruns * sizeof *runs) : NULL;
    if (nruns && !runs) return 0;
    /* Mapped runs are whole allocations (Note [Growth extents]): note them for the
     * unmap, which runs without the lock (mp_release_finish). */
    size_t r = 0;
    for (mp_block *b = seg->first, *next; b; b = next) {
        next = b->next;
        if (b->state == MP_BLOCK_FREE) {
            if (!b->prev || b->prev->state == MP_BLOCK_UNMAPPED) runs[r++] = (struct mp_run){b->ptr, 0};
            runs[r - 1].nbytes += b->nbytes;
            mp_remove_free_locked(p, b);
        }
        mp_block_delete_locked(p, b);
    }
    seg->first = NULL;
    for (size_t i = 0; i < nruns; i++)
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_UNMAP, runs[i].ptr, runs[i].nbytes,
                                seg->stream->handle);
    p->stats.num_device_free += nruns;
    out->nbytes += seg->mapped_bytes;
    if (seg->mapped_bytes) count_mapped_locked(p, seg, seg->mapped_bytes, 0);
    mp_stat3_dec(p->stats.segment, seg->kind, 1);
    mp_stat_dec(&p->stats.va_reserved_bytes, (int64_t)seg->nbytes);
    if (seg->prev) seg->prev->next = seg->next;
    else p->segments = seg->next;
    if (seg->next) seg->next->prev = seg->prev;
    p->nsegments--;
    seg->release_stream = seg->stream->handle;
    seg->release_runs = runs;
    seg->nrelease_runs = nruns;
    seg->inext = out->head;
    out->head = seg;
    return 1;
}

void mp_expand_drop_empty_locked(mp_pool *p, mp_release_list *out) {
    for (mp_segment *seg = p->segments, *next; seg; seg = next) {
        next = seg->next;
        if (seg->expandable && !seg->growing && !seg->mapped_bytes)
            mp_expand_detach_range_locked(p, seg, NULL, out);
    }
}

/* ---------------------------------------------------------------- release */

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

static size_t idle_bytes_locked(const mp_pool *p, uintptr_t keep_lo, uintptr_t keep_hi) {
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
    count_mapped_locked(p, u->seg, u->nbytes, 1);
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
 * sync]), setting *busy when some page stayed for a busy stream. Drops and retakes the lock.
 * Returns the bytes released. */
static size_t release_pages_locked(mp_pool *p, size_t target, uintptr_t keep_lo, uintptr_t keep_hi,
                                   int wait, int *busy) {
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
        count_mapped_locked(p, jobs[n].u->seg, hi - lo, 0);
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
            extents_remove(u->seg, u->ptr, u->ptr + u->nbytes);
            p->stats.num_device_free++;
            mp_trace_segment_locked(p, MP_TRACE_SEGMENT_UNMAP, u->ptr, u->nbytes,
                                    jobs[i].parts[0].owner->handle);
            merge_unmapped_locked(p, u);
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
    return release_pages_locked(p, target, 0, 0, 1, NULL);
}

size_t mp_expand_release_idle_locked(mp_pool *p, size_t target, int *busy) {
    return release_pages_locked(p, target, 0, 0, 0, busy);
}

/* ---------------------------------------------------------------- growth */

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
 * A driver's time follows its physical allocations, not their bytes (Note [Growth extents]),
 * and most growths of a training loop's warm-up extend a range at its end by a few pages
 * for one request: on the shipped transformer trace 250 of its 254 growths, mostly 8-16 MiB.
 * min_map_size makes a growth at the end of a range (into the unmapped tail, from its low
 * end) map at least that much, as one allocation; the rest is a free block at the edge that
 * the next requests take without a growth. Holes between mapped pages are still filled to the
 * page, so what they cost in memory does not change; the price is what lies unused at the
 * edge at the peak, at most min_map_size a range. On sim with cuda's 8 MiB page, 64 MiB took
 * the transformer trace from 254 allocations to 89 and the vision trace from 280 to 65 (the
 * default path's fixed segments on cuda: 108 and 100), for a peak of 1.0271 against 1.0155
 * and 1.0079 against 1.0079 of peak live (bench/results/2026-12-06-cpu-sim-edge-growth.md);
 * on an H100 the same peaks, and 0.76x / 0.73x the default path's time per event against
 * 1.18x / 1.67x with exact growths, but PyTorch's GPT and ResNet-50 peaked 32 and 120 MiB
 * over PyTorch's expandable segments (bench/results/2026-12-06-h100-edge-growth.md), so it
 * stays off by default: expandable segments are chosen for memory.
 * Under a limit every free page must be able to go (max_map_bytes), so there it is ignored;
 * it is opportunistic besides: it never takes the pool past the garbage collection
 * threshold, and the room a growth makes (that threshold, the high-water rule) is for what
 * the request needs, so the rounding gives nothing back of its own (grow_locked).
 * The device may not hold the rounded growth where it holds the request: a rounded map the
 * device refuses is not followed by releases or a wait but by the exact growth at once (the
 * caller's `exact`, mp_expand_alloc_locked), so the option never makes a request fail that
 * would fit without it. */
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
    if (!extents_reserve(seg, cut.n)) return MP_ENOMEM;
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
    extents_insert(seg, m->ptr, &cut);
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
        merge_unmapped_locked(p, m);
        if (rc == MP_ENOMEM && plan->nbytes == plan->need &&   /* Note [Edge growth] */
            !mp_capture_stream_locked(p, s) &&                  /* Note [Graph capture] */
            release_pages_locked(p, plan->nbytes, plan->lo, plan->hi, 1, NULL)) {
            p->stats.num_alloc_retries++;
            return MP_OK;
        }
        return rc;
    }
    m->stream = s;
    extents_set_busy(seg, m->ptr, m->ptr + m->nbytes, 0);
    count_mapped_locked(p, seg, m->nbytes, 1);
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
    mp_segment *seg = segment_of_locked(p, s, kind, size);
    if (!seg) return MP_ENOMEM;
    if (reserving) return MP_OK;
    grow_plan plan = {0};
    if (!plan_growth_locked(p, seg, s, size, exact, &plan)) {
        /* The range's address space is used up (by blocks, or by holes too small for the
         * request): a new range takes over the growth; the old one keeps its blocks. */
        if (!seg->mapped_bytes || size > seg->nbytes) return MP_ENOMEM;
        s->expandable[kind] = NULL;
        mp_segment *fresh = segment_of_locked(p, s, kind, size);
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
        size_t idle = div ? idle_bytes_locked(p, plan.lo, plan.hi) : 0;
        if (div && idle &&
            (large || (idle >= MP_HIGH_WATER_MIN_IDLE && idle >= p->mapped_high_water / div)))
            excess = idle > excess ? idle : excess;
        else
            layout_mark = 0;
    }
    if (excess && !mp_capture_stream_locked(p, s) &&   /* Note [Graph capture] */
        release_pages_locked(p, excess, plan.lo, plan.hi, 1, NULL)) {
        if (layout_mark) p->layout_release_mark = layout_mark;
        return MP_OK;   /* re-plan */
    }
    if (mp_limit_excess_locked(p, plan.nbytes)) return MP_ELIMIT;
    int rc = map_locked(p, seg, s, &plan, size, out);
    *rounded = rc == MP_ENOMEM && plan.nbytes > plan.need;
    return rc;
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
    mp_segment *seg = s ? segment_of_locked(p, s, KIND_LARGE, nbytes) : NULL;
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

/* Note [Segment events at destroy]
 * A pool destroyed with segments still cached frees them with no release list, so nothing
 * told the trace or the observer of them (Note [Segment observer], mp_core.h), and PyTorch's
 * memory history and trace trackers (NCCL's registration of a MemPool's segments) kept them
 * for ever: a MemPool's or a graph's pool is destroyed that way once it is released and its
 * last block freed. Destroy tells of each segment here, as a release would: one
 * segment_free per plain segment, one segment_unmap per mapped run of a range. */
/* The next maximal run of mapped blocks from *b on, [*lo, *hi) (runs start and end on page
 * boundaries); *b moves past it. 0 when no mapped block is left. */
static int next_mapped_run(const mp_block **b, uintptr_t *lo, uintptr_t *hi) {
    const mp_block *x = *b;
    while (x && x->state == MP_BLOCK_UNMAPPED) x = x->next;
    if (!x) {
        *b = NULL;
        return 0;
    }
    *lo = x->ptr;
    *hi = x->ptr + x->nbytes;
    for (x = x->next; x && x->state != MP_BLOCK_UNMAPPED; x = x->next) *hi = x->ptr + x->nbytes;
    *b = x;
    return 1;
}

void mp_trace_segment_gone_locked(mp_pool *p, const mp_segment *seg) {
    if (!mp_segment_events_wanted(p)) return;
    uintptr_t stream = seg->stream->handle;
    if (!seg->expandable) {
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_FREE, seg->ptr, seg->nbytes, stream);
        return;
    }
    const mp_block *b = seg->first;
    uintptr_t lo, hi;
    while (next_mapped_run(&b, &lo, &hi))
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_UNMAP, lo, hi - lo, stream);
}

void mp_segment_release_upstream(mp_pool *p, mp_segment *seg) {
    if (!seg->expandable) {
        p->up.segment_free(p->up.ctx, seg->ptr, seg->nbytes, seg->release_stream);
        return;
    }
    if (!seg->first) {   /* detached: its mapped runs were noted (mp_expand_detach_range_locked) */
        for (size_t i = 0; i < seg->nrelease_runs; i++)
            p->up.unmap(p->up.ctx, seg->release_runs[i].ptr, seg->release_runs[i].nbytes);
        p->up.va_release(p->up.ctx, seg->ptr, seg->nbytes);
        return;
    }
    /* Maximal mapped runs start and end on page boundaries: unmap each, then the range. */
    const mp_block *b = seg->first;
    uintptr_t lo, hi;
    while (next_mapped_run(&b, &lo, &hi)) {
        mp_assert(lo % p->up.granularity == 0 && hi % p->up.granularity == 0 && lo < hi);
        p->up.unmap(p->up.ctx, lo, hi - lo);
    }
    p->up.va_release(p->up.ctx, seg->ptr, seg->nbytes);
}
