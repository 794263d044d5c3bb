#include "mp_freelist.h"

#include "mp_internal.h"

uint32_t mp_size_class(size_t nbytes) {
    uint64_t u = (uint64_t)nbytes >> 9;
    if (u < MP_EXACT_CLASSES) return (uint32_t)u;
    int k = 63 - __builtin_clzll(u);   /* >= 7 */
    uint32_t sub = (uint32_t)((u >> (k - 6)) & (MP_SUBCLASSES - 1));
    return MP_EXACT_CLASSES + (uint32_t)(k - 7) * MP_SUBCLASSES + sub;
}

void mp_freelist_insert(mp_freelist *fl, mp_block *b) {
    uint32_t c = mp_size_class(b->nbytes);
    b->cls = c;
    b->fprev = NULL;
    b->fnext = fl->head[c];
    if (b->fnext) b->fnext->fprev = b;
    fl->head[c] = b;
    fl->bits[c >> 6] |= 1ull << (c & 63);
    fl->summary |= 1ull << (c >> 6);
    fl->count++;
    fl->nbytes += b->nbytes;
}

void mp_freelist_remove(mp_freelist *fl, mp_block *b) {
    uint32_t c = b->cls;
    if (b->fprev) b->fprev->fnext = b->fnext;
    else fl->head[c] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (!fl->head[c]) {
        fl->bits[c >> 6] &= ~(1ull << (c & 63));
        if (!fl->bits[c >> 6]) fl->summary &= ~(1ull << (c >> 6));
    }
    b->fprev = b->fnext = NULL;
    fl->count--;
    fl->nbytes -= b->nbytes;
}

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
