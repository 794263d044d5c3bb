#include "mp_freelist.h"

#include "mp_internal.h"

uint32_t mp_freelist_next_class(const mp_freelist *fl, uint32_t cls) {
    if (cls >= MP_NCLASSES) return MP_NCLASSES;
    uint32_t w = cls >> 6;
    uint64_t m = fl->bits[w] & (~0ull << (cls & 63));
    if (m) return (w << 6) + (uint32_t)__builtin_ctzll(m);
    if (w + 1 >= MP_NWORDS) return MP_NCLASSES;
    uint64_t s = fl->summary & (~0ull << (w + 1));
    if (!s) return MP_NCLASSES;
    uint32_t w2 = (uint32_t)__builtin_ctzll(s);
    return (w2 << 6) + (uint32_t)__builtin_ctzll(fl->bits[w2]);
}

void mp_insert_free_locked(mp_pool *p, mp_block *b) {
    b->state = MP_BLOCK_FREE;
    mp_freelist_insert(&b->stream->lists[b->kind], b);
    if (MP_UNLIKELY(!b->stream->holding)) mp_stream_hold_locked(p, b->stream);
    if (b->prev || b->next) {
        b->split_counted = 1;
        mp_stat3_inc(p->stats.inactive_split, b->kind, 1);
        mp_stat3_inc(p->stats.inactive_split_bytes, b->kind, (int64_t)b->nbytes);
    }
}

void mp_remove_free_locked(mp_pool *p, mp_block *b) {
    mp_freelist_remove(&b->stream->lists[b->kind], b);
    if (b->split_counted) {
        b->split_counted = 0;
        mp_stat3_dec(p->stats.inactive_split, b->kind, 1);
        mp_stat3_dec(p->stats.inactive_split_bytes, b->kind, (int64_t)b->nbytes);
    }
}


/* Best fit for `size` in one list under the pool's max_split_size, or NULL. */
mp_block *mp_freelist_find_fit(const mp_pool *p, const mp_freelist *fl, size_t size) {
    if (!fl->count) return NULL;
    size_t max_split = p->cfg.max_split_size;
    for (uint32_t c = mp_freelist_next_class(fl, mp_class_of(size)); c < MP_NCLASSES;
         c = mp_freelist_next_class(fl, c + 1)) {
        if (mp_classes_exhausted(max_split, size, c)) return NULL;
        mp_block *best = NULL;
        for (mp_block *b = fl->head[c]; b; b = b->fnext) {
            if (b->nbytes < size || !mp_split_policy_allows(max_split, size, b->nbytes)) continue;
            if (!best || b->nbytes < best->nbytes) {
                best = b;
                if (b->nbytes == size) break;
            }
        }
        if (best) return best;
    }
    return NULL;
}

