/* What the files of expandable segments share (mp_expand.c: growth, mp_expand_range.c: the
 * ranges and their extents, mp_expand_release.c: giving pages back), and nothing else
 * includes. See Note [Expandable segments] in mp_expand.c.
 */
#ifndef MP_EXPAND_INTERNAL_H
#define MP_EXPAND_INTERNAL_H

#include <string.h>

#include "mp_expand.h"

/* Shared between the expandable segments' files only: not exported from the extension. */
#define MP_EXPAND_PRIVATE __attribute__((visibility("hidden")))

static inline size_t round_down(size_t n, size_t g) { return n / g * g; }

/* The end of a segment's pinned prefix: initial_pool_size pages, never unmapped before the
 * pool is destroyed. */
static inline uintptr_t pinned_end(const mp_pool *p, const mp_segment *seg) {
    return seg->pinned ? seg->ptr + mp_round_up(p->cfg.initial_pool_size, p->up.granularity) : seg->ptr;
}

/* Link new block n into b's segment, just before b (or after it). */
static inline void link_block(mp_block *b, mp_block *n, int after) {
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

/* seg->extents (Note [Growth extents]), the physical allocations mapped in a range. */
typedef struct mp_extent mp_extent;

/* The index of the first extent of seg at or above addr. */
static inline size_t extent_at(const mp_segment *seg, uintptr_t addr) {
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
static inline size_t max_map_bytes(const mp_pool *p) {
    size_t g = p->up.granularity;
    if (!p->cfg.max_map_size && mp_effective_limit(p) != MP_UNLIMITED) return g;
    size_t m = round_down(p->cfg.max_map_size ? p->cfg.max_map_size : MP_DEFAULT_MAX_MAP, g);
    return m ? m : g;
}

/* Note [Growth extents]: how a growth of nbytes is cut into physical allocations: pieces of
 * max_map_bytes from the low end, the last one the rest. Piece i is [off(i), off(i + 1)). */
typedef struct growth_cut {
    size_t nbytes, max;
    size_t n;                   /* pieces */
} growth_cut;

static inline growth_cut cut_growth(const mp_pool *p, size_t nbytes) {
    size_t max = max_map_bytes(p);
    growth_cut c = {nbytes, max, (nbytes + max - 1) / max};
    return c;
}

static inline size_t cut_off(const growth_cut *c, size_t i) {
    return i >= c->n ? c->nbytes : i * c->max;
}

/* Drop the extents inside [lo, hi) (whole ones: lo and hi are extent edges). */
static inline void extents_remove(mp_segment *seg, uintptr_t lo, uintptr_t hi) {
    size_t i = extent_at(seg, lo), j = extent_at(seg, hi);
    memmove(&seg->extents[i], &seg->extents[j], (seg->nextents - j) * sizeof *seg->extents);
    seg->nextents -= j - i;
}

static inline void extents_set_busy(mp_segment *seg, uintptr_t lo, uintptr_t hi, int busy) {
    for (size_t i = extent_at(seg, lo); i < seg->nextents && seg->extents[i].ptr < hi; i++)
        seg->extents[i].busy = busy;
}

/* The functions one file gives another; each is described where it is defined. */
/* mp_expand_range.c */
MP_EXPAND_PRIVATE void ex_merge_unmapped_locked(mp_pool *p, mp_block *u);
MP_EXPAND_PRIVATE void ex_count_mapped_locked(mp_pool *p, mp_segment *seg, size_t nbytes,
                                             int mapped);
MP_EXPAND_PRIVATE int ex_extents_reserve(mp_segment *seg, size_t n);
MP_EXPAND_PRIVATE void ex_extents_insert(mp_segment *seg, uintptr_t at, const growth_cut *c);
MP_EXPAND_PRIVATE mp_segment *ex_segment_of_locked(mp_pool *p, mp_stream *s, int kind,
                                                   size_t size);
/* mp_expand_release.c */
MP_EXPAND_PRIVATE size_t ex_idle_bytes_locked(const mp_pool *p, uintptr_t keep_lo,
                                              uintptr_t keep_hi);
MP_EXPAND_PRIVATE size_t ex_release_pages_locked(mp_pool *p, size_t target, uintptr_t keep_lo,
                                                 uintptr_t keep_hi, int wait, int *busy,
                                                 uint64_t *unmaps);

#endif
