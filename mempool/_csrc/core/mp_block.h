/* Blocks (mp_block.c): carving a block out of a free one, merging it back, and the hot
 * blocks of Note [Hot blocks]. Internal to the core; every function expects the pool lock
 * held. What runs on every allocate and free is inline here, so that the fallback chain in
 * mp_core.c pays no call for it. */
#ifndef MP_BLOCK_H
#define MP_BLOCK_H

#include "mp_internal.h"

/* Hand out free block b (in its owner's list, or in none) to stream s, splitting off what
 * it does not need; the pointer map must have room for one more entry. Returns the block
 * handed out. */
mp_block *mp_carve_locked(mp_pool *p, mp_block *b, size_t size, size_t requested,
                          mp_stream *s);
/* Re-merge free neighbours of one owner after ownership moved (Note [Forgotten streams]). */
void mp_remerge_segment_locked(mp_pool *p, mp_segment *seg);
/* Why a pointer is not a live block: MP_ENOTFOUND (unknown), MP_EINTERIOR (inside a
 * block), MP_EDOUBLEFREE (freed already); MP_OK when it is one. */
__attribute__((cold)) int mp_classify_bad_pointer_locked(mp_pool *p, uintptr_t ptr);
/* Note [Hot blocks]: fold s's parked block (if any) into the free lists. */
void mp_hot_flush_stream_locked(mp_pool *p, mp_stream *s);

/* The live block at ptr, or NULL. The pointer map also holds hot blocks (Note [Hot
 * blocks]), which are not live. */
static inline mp_block *mp_live_block_locked(mp_pool *p, uintptr_t ptr) {
    mp_block *b = mp_ptrmap_get(&p->live, ptr);
    return b && b->state == MP_BLOCK_ALLOCATED ? b : NULL;
}

/* The block b, taken for a request of `requested` bytes, becomes live: its state and the
 * counters (the caller puts it in the pointer map, or finds it there: Note [Hot blocks]). */
static inline void mp_hand_out_locked(mp_pool *p, mp_block *b, size_t requested) {
    int kind = b->kind;
    b->state = MP_BLOCK_ALLOCATED;
    b->requested = b->last_requested = requested;
    mp_hot_inc(p, MP_HOT_ALLOCATION, kind, 1);   /* Note [Hot counters] */
    mp_hot_inc(p, MP_HOT_ALLOCATED_BYTES, kind, (int64_t)b->nbytes);
    mp_hot_inc(p, MP_HOT_REQUESTED_BYTES, kind, (int64_t)requested);
    mp_hot_inc(p, MP_HOT_ACTIVE, kind, 1);
    mp_hot_inc(p, MP_HOT_ACTIVE_BYTES, kind, (int64_t)b->nbytes);
    b->oversize = b->nbytes >= p->cfg.max_split_size;
    if (b->oversize) mp_stat_inc(&p->stats.oversize_allocations, 1);
}

static inline int mp_hot_allowed(const mp_pool *p) {
    return p->cfg.release_threshold == MP_UNLIMITED;
}

/* A free of b completes: it is no longer active (counters and trace). */
static inline void mp_count_free_completed_locked(mp_pool *p, mp_block *b) {
    int kind = b->kind;
    mp_hot_dec(p, MP_HOT_ACTIVE, kind, 1);
    mp_hot_dec(p, MP_HOT_ACTIVE_BYTES, kind, (int64_t)b->nbytes);
    mp_hot_dec(p, MP_HOT_REQUESTED_BYTES, kind, (int64_t)b->requested);
    mp_trace_locked(p, MP_TRACE_FREE_COMPLETED, b->ptr, b->requested, b->stream->handle);
}

/* The completed free of b, parked hot instead of folded into the lists. */
static inline void mp_park_hot_locked(mp_pool *p, mp_block *b) {
    mp_count_free_completed_locked(p, b);
    b->state = MP_BLOCK_HOT;   /* not FREE: no merge may fold it while it is parked */
    b->requested = 0;
    mp_stream *s = b->stream;
    if (s->hot) mp_hot_flush_stream_locked(p, s);
    if (MP_UNLIKELY(!s->holding)) mp_stream_hold_locked(p, s);   /* Note [Streams without end] */
    s->hot = b;
    s->hot_frees = s->frees;
    p->nhot++;
}

/* A request of `size` bytes on s: its hot block when that has exactly the size and no other
 * free has completed on s since it was parked (returned taken out of the stream), else
 * NULL, with the hot block folded in. */
static inline mp_block *mp_take_hot_locked(mp_pool *p, mp_stream *s, size_t size) {
    mp_block *h = s->hot;
    if (!h) return NULL;
    if (h->nbytes != size || s->frees != s->hot_frees) {
        mp_hot_flush_stream_locked(p, s);
        return NULL;
    }
    s->hot = NULL;
    p->nhot--;
    return h;
}

/* A free of b completes: counted, then merged into its owner's free list. */
static inline void mp_complete_free_locked(mp_pool *p, mp_block *b) {
    mp_count_free_completed_locked(p, b);
    mp_free_block_locked(p, b);
}

#endif
