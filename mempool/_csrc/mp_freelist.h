/* Per-stream free lists: blocks binned by size class, with a two-level bitmap to find the
 * first non-empty class at or above a size in a few instructions.
 *
 * Classes: exact below 64 KiB (one per 512 B step), then 64 classes per power of two, so a
 * class spans under 1.6% of its sizes. A search scans the request's own class for the
 * smallest block that fits, then takes the smallest block of the next non-empty class:
 * exact best fit, ties broken by the most recently freed block (hot in cache, and
 * deterministic). Not thread-safe: guarded by the pool lock. */
#ifndef MP_FREELIST_H
#define MP_FREELIST_H

#include <stddef.h>
#include <stdint.h>

#define MP_EXACT_CLASSES 128
#define MP_SUBCLASSES 64
#define MP_NCLASSES 3200
#define MP_NWORDS ((MP_NCLASSES + 63) / 64)

struct mp_block;

typedef struct mp_freelist {
    struct mp_block *head[MP_NCLASSES];
    uint64_t bits[MP_NWORDS];
    uint64_t summary;   /* bit w set when bits[w] != 0 */
    size_t count;       /* free blocks in the list */
    size_t nbytes;      /* their total size */
} mp_freelist;

/* Inline: on the allocate/free path. mp_freelist_insert/remove are in mp_internal.h, which
 * defines the block. */
static inline uint32_t mp_class_of(size_t nbytes) {
    uint64_t u = (uint64_t)nbytes >> 9;
    if (u < MP_EXACT_CLASSES) return (uint32_t)u;
    int k = 63 - __builtin_clzll(u);   /* >= 7 */
    uint32_t sub = (uint32_t)((u >> (k - 6)) & (MP_SUBCLASSES - 1));
    return MP_EXACT_CLASSES + (uint32_t)(k - 7) * MP_SUBCLASSES + sub;
}

/* First non-empty class >= cls, or MP_NCLASSES when there is none. */
uint32_t mp_freelist_next_class(const mp_freelist *fl, uint32_t cls);

#endif
