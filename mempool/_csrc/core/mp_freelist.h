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
/* Classes stop at 1 TiB: blocks from there up (larger than any device's memory) share one
 * last class, searched for the best fit like any other. The bound keeps a stream's two
 * lists near 27 KB (Note [Forgotten streams]); 3,200 classes to 2^62 bytes took 52 KB. */
#define MP_TOP_K 30          /* log2 of (512-byte units - 1) of the last regular classes */
#define MP_NCLASSES (MP_EXACT_CLASSES + (MP_TOP_K - 6) * MP_SUBCLASSES + 1)
#define MP_NWORDS ((MP_NCLASSES + 63) / 64)
#define MP_NOT_LISTED UINT32_MAX   /* mp_block.cls of a block in no free list */

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
/* Classes are cut on (units - 1), so a power-of-two size is the top of its class, not the
 * bottom: a whole 2 MiB segment and its free tail after a small allocation share a class,
 * and a round trip on that tail shrinks and regrows the block in place. */
static inline uint32_t mp_class_of(size_t nbytes) {
    uint64_t u = (uint64_t)nbytes >> 9;
    if (u == 0) return 0;
    uint64_t v = u - 1;
    if (v < MP_EXACT_CLASSES) return (uint32_t)v;
    int k = 63 - __builtin_clzll(v);   /* >= 7 */
    if (k > MP_TOP_K) return MP_NCLASSES - 1;
    uint32_t sub = (uint32_t)((v >> (k - 6)) & (MP_SUBCLASSES - 1));
    return MP_EXACT_CLASSES + (uint32_t)(k - 7) * MP_SUBCLASSES + sub;
}

/* First non-empty class >= cls, or MP_NCLASSES when there is none. */
uint32_t mp_freelist_next_class(const mp_freelist *fl, uint32_t cls);

#endif
