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

uint32_t mp_size_class(size_t nbytes) { return mp_class_of(nbytes); }
