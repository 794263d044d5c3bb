/* Blocks: their structs, carving a block out of a free one and merging freed ones back
 * (split and merge), the hot blocks of Note [Hot blocks], and allocation at an address.
 * Which block serves a request is the fallback chain's (mp_core.c); how large blocks and
 * segments are is the size policy's (mp_size.h). Every function expects the pool lock. */
#include <stdlib.h>

#include "mp_block.h"
#include "mp_stream.h"

/* ---------------------------------------------------------------- block structs */

#define SLAB_BLOCKS 256

mp_block *mp_block_new_locked(mp_pool *p) {
    if (!p->spare_blocks) {
        /* On a line of its own, as each block in it (Note [Hot lines]). */
        void *mem = NULL;
        if (posix_memalign(&mem, 64, sizeof(mp_block_slab) + SLAB_BLOCKS * sizeof(mp_block)))
            return NULL;
        mp_block_slab *slab = mem;
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
    b->nbytes = b->requested = b->last_requested = 0;
    b->seg = NULL;
    b->kind = KIND_SMALL;
    b->prev = b->next = b->fprev = b->fnext = NULL;
    b->stream = NULL;
    b->cls = MP_NOT_LISTED;
    b->state = MP_BLOCK_FREE;
    b->split_counted = b->busy = 0;
    b->nuses = 0;
    b->cap_uses = MP_INLINE_USES;
    b->uses = b->inline_uses;
    b->events = NULL;
    b->markers = NULL;
    b->nmarkers = 0;
    b->tally = NULL;
    return b;
}

void mp_block_delete_locked(mp_pool *p, mp_block *b) {
    if (b->uses != b->inline_uses) free(b->uses);
    free(b->events);
    free(b->markers);
    b->fnext = p->spare_blocks;
    p->spare_blocks = b;
}

/* Hand out free block b (in its owner's list, or in none) to stream s, splitting off what
 * it does not need. The remainder stays with b's owner: only the part handed out moves.
 * Returns the block handed out. When the remainder stays in b's size class, b itself
 * shrinks in place and keeps its place in the list (no list operations: the common case of
 * a round trip on a segment's free tail). */
mp_block *mp_carve_locked(mp_pool *p, mp_block *b, size_t size, size_t requested,
                              mp_stream *s) {
    mp_segment *seg = b->seg;
    int kind = seg->kind;
    int listed = b->cls != MP_NOT_LISTED;
    mp_block *a = NULL;
    if (!p->cfg.no_split &&   /* Note [No split] (mp_core.c) */
        mp_split_rest(kind == KIND_SMALL || seg->expandable, p->cfg.max_split_size, b->nbytes, size)) {
        size_t rest = b->nbytes - size;
        if (listed && mp_class_of(rest) == b->cls && (a = mp_block_new_locked(p))) {
            a->ptr = b->ptr;
            a->nbytes = size;
            mp_block_join(a, seg);
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
                mp_block_join(r, seg);
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
    mp_hand_out_locked(p, b, requested);
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
    n->last_requested = b->last_requested;   /* as a merge into b would keep it */
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

/* Why a pointer is not a live block: unknown, inside a block, or already freed. */
int mp_classify_bad_pointer_locked(mp_pool *p, uintptr_t ptr) {
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


/* ---------------------------------------------------------------- hot blocks */

/* Note [Hot blocks]
 * Most round trips free a block and ask for one of the same size on the same stream soon
 * after (a training step's temporaries, a benchmark's loop). The plain free merges the
 * block into its neighbours, files it in a free list and may mark its segment idle; the
 * next request searches the lists, carves the block out again and marks the segment busy. A
 * hot block skips both halves: a free that has no other stream to wait for (and a pool
 * without a release threshold, whose books run at every free) parks the block on its stream
 * (mp_stream.hot, state MP_BLOCK_HOT: not FREE, so no merge folds it, and in no list). Its
 * counters are a free block's from that moment; its segment stays busy and its entry stays
 * in the pointer map (its state tells it from a live block: mp_live_block_locked does not
 * see it), which saves the map's remove and insert as well.
 *
 * The stream's next request takes it back when it has exactly the size and no other free
 * has completed on that stream since it was parked (mp_stream.frees), so a block whose work
 * finished later still wins as it would have. Anything else folds it in first, exactly as
 * the plain free would have: another request on the stream, a second block parked there, a
 * request on another stream that finds no fit in its own lists (so cross-stream reuse sees
 * it), growing, releasing, trimming, forget_stream, stats, snapshots and pool destruction.
 * An expandable pool parks them too: a growth folds them in before it plans (a parked block
 * is neither a free neighbour to extend nor a free page to release), so its peaks and
 * upstream calls are those of the plain free. check_invariants checks hot blocks where they
 * are (one per stream at most, the count, in no list, not live). */

void mp_hot_flush_stream_locked(mp_pool *p, mp_stream *s) {
    mp_block *h = s->hot;
    if (!h) return;
    s->hot = NULL;
    p->nhot--;
    mp_ptrmap_remove(&p->live, h->ptr);
    mp_free_block_locked(p, h);
}

void mp_hot_flush_locked(mp_pool *p) {
    /* Note [Streams without end]: every stream with a hot block is in `holding`. */
    for (mp_stream *t = p->holding; p->nhot && t; t = t->hnext) mp_hot_flush_stream_locked(p, t);
}


/* Re-merge free neighbours of one owner after ownership moved (in lists, classes right). */
void mp_remerge_segment_locked(mp_pool *p, mp_segment *seg) {
    for (mp_block *b = seg->first; b; b = b->next) {
        while (b->state == MP_BLOCK_FREE && mergeable(b, b->next)) {
            mp_remove_free_locked(p, b);
            merge_locked(p, b, b->next);
            mp_insert_free_locked(p, b);
        }
    }
}

/* ---------------------------------------------------------------- allocation at an address */

/* Note [Allocation at an address]
 * mp_alloc_at(p, ptr, nbytes, stream) allocates the free memory at ptr, for PyTorch's
 * cudagraph trees, which restore a graph pool to a checkpoint: a recorded graph reads and
 * writes fixed addresses, so its blocks must be the same ones again. The block holding
 * [ptr, ptr + nbytes) must be free; it is found through the segment list (rare calls: no
 * index), its head before ptr stays free with its owner, and the rest is carved as any
 * allocation on `stream`. Tested on sim through the PyTorch table
 * (tests/integrations/test_torch_api_table.py). */

int mp_alloc_at(mp_pool *p, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    if (nbytes == 0 || (ptr & (MP_MIN_BLOCK - 1)) || nbytes > MP_MAX_ALLOC) return MP_EINVAL;
    size_t size = (nbytes + MP_MIN_BLOCK - 1) & ~(MP_MIN_BLOCK - 1);
    int rc = MP_OK;
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
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
        mp_block_join(head, seg);
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
    b = mp_carve_locked(p, b, size, size, s);
    mp_trace_locked(p, MP_TRACE_ALLOC, b->ptr, b->requested, stream);
out:
    mp_lock_release(&p->lock);
    return rc;
}

