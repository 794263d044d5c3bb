/* The size policy of the core, in one place: how a request is rounded, how large a segment
 * the upstream is asked for, which size class a free block is binned in, and which free
 * blocks max_split_size lets a request take. Python reads these through the extension
 * (mempool._core.round_size, segment_size, size_class), so nothing here is copied there.
 *
 * Everything is inline: rounding and classing run on every allocate and free, and a call
 * across files would cost the hot path. Pure functions of their arguments: no lock. */
#ifndef MP_SIZE_H
#define MP_SIZE_H

#include <stddef.h>
#include <stdint.h>

#define MP_MIN_BLOCK ((size_t)512)
#define MP_SMALL_SIZE ((size_t)1 << 20)          /* requests up to this use the small lists */
#define MP_SMALL_SEGMENT ((size_t)2 << 20)       /* segment size for small requests */
#define MP_LARGE_SEGMENT ((size_t)20 << 20)      /* segment size for requests < 10 MiB */
#define MP_MIN_LARGE_ALLOC ((size_t)10 << 20)
#define MP_ROUNDED_MID_SEGMENT ((size_t)64 << 20) /* the same under segment_rounding
                                                    (Note [Segment rounding]) */
#define MP_PLAIN_UNITS 3                         /* under segment_rounding, segments stay
                                                    plain while the pool fits in this many
                                                    units (Note [Segment rounding]) */
#define MP_LARGE_ROUND ((size_t)2 << 20)         /* larger requests round to this */
#define MP_LARGE_BUFFER ((size_t)20 << 20)       /* oversize blocks may serve up to this much
                                                    beyond a request (PyTorch's kLargeBuffer) */
#define MP_MAX_ALLOC ((size_t)1 << 62)           /* larger requests are refused outright */
#define MP_UNLIMITED SIZE_MAX
#define MP_ROUNDUP_INTERVALS 16                  /* 1 MiB .. 64 GiB, one per power of two */

/* ---- rounding ----------------------------------------------------------------------------- */

/* n rounded up to a multiple of g (> 0); n itself when it is one already. */
static inline size_t mp_round_up(size_t n, size_t g) { return n + (g - n % g) % g; }

static inline int mp_log2_floor(size_t n) { return 63 - __builtin_clzll((unsigned long long)n); }

/* PyTorch's roundup_power2_next_division: cut [2^k, 2^(k+1)) into `divisions` steps. */
static inline size_t mp_next_division(size_t size, size_t divisions) {
    if ((size & (size - 1)) == 0) return size;
    size_t floor2 = (size_t)1 << mp_log2_floor(size);
    size_t step = floor2 >> mp_log2_floor(divisions);
    if (step == 0) return floor2 << 1;
    size_t below = size & ~(step - 1);
    return below == size ? size : below + step;
}

/* The block size for a request of nbytes (< MP_MAX_ALLOC), under the power-of-two
 * divisions per size interval of mp_config.roundup_divisions (index 0: < 2 MiB, i: [2^i,
 * 2^(i+1)) MiB, last: >= 32 GiB; 0 or 1 = plain 512 B steps). mp_round_size (mp_core.h)
 * applies it to a pool's config. */
static inline size_t mp_round_with(const size_t divisions_by_interval[MP_ROUNDUP_INTERVALS],
                                   size_t nbytes) {
    if (nbytes < MP_MIN_BLOCK) return MP_MIN_BLOCK;
    int index = mp_log2_floor(nbytes) - 20;   /* intervals start at 1 MiB */
    if (index < 0) index = 0;
    if (index > MP_ROUNDUP_INTERVALS - 1) index = MP_ROUNDUP_INTERVALS - 1;
    size_t divisions = divisions_by_interval[index];
    if (divisions > 1 && nbytes > MP_MIN_BLOCK * divisions) return mp_next_division(nbytes, divisions);
    return (nbytes + MP_MIN_BLOCK - 1) & ~(MP_MIN_BLOCK - 1);
}

/* The segment the upstream is asked for when no free block serves a rounded request. */
static inline size_t mp_segment_size(size_t rounded) {
    if (rounded <= MP_SMALL_SIZE) return MP_SMALL_SEGMENT;
    if (rounded < MP_MIN_LARGE_ALLOC) return MP_LARGE_SEGMENT;
    return (rounded + MP_LARGE_ROUND - 1) & ~(MP_LARGE_ROUND - 1);
}

/* ---- size classes of the free lists (mp_freelist.h) ---------------------------------------- */

/* Classes: exact below 64 KiB (one per 512 B step), then 64 classes per power of two, so a
 * class spans under 1.6% of its sizes. Classes stop at 1 TiB: blocks from there up (larger
 * than any device's memory) share one last class, searched for the best fit like any other.
 * The bound keeps a stream's two lists near 27 KB (Note [Forgotten streams]); 3,200 classes
 * to 2^62 bytes took 52 KB. */
#define MP_EXACT_CLASSES 128
#define MP_SUBCLASSES 64
#define MP_TOP_K 30          /* log2 of (512-byte units - 1) of the last regular classes */
#define MP_NCLASSES (MP_EXACT_CLASSES + (MP_TOP_K - 6) * MP_SUBCLASSES + 1)

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

/* The smallest size a class can hold: the inverse of mp_class_of. */
static inline size_t mp_class_min_bytes(uint32_t c) {
    if (c < MP_EXACT_CLASSES) return ((size_t)c + 1) << 9;
    if (c == MP_NCLASSES - 1) return (((size_t)1 << (MP_TOP_K + 1)) + 1) << 9;
    uint32_t k = 7 + (c - MP_EXACT_CLASSES) / MP_SUBCLASSES;
    uint64_t sub = (c - MP_EXACT_CLASSES) % MP_SUBCLASSES;
    return ((size_t)((MP_SUBCLASSES + sub) << (k - 6)) + 1) << 9;
}

/* The class (exposed for tests: mempool._core.size_class). */
static inline uint32_t mp_size_class(size_t nbytes) { return mp_class_of(nbytes); }

/* ---- max_split_size ----------------------------------------------------------------------- */

/* As PyTorch's: small requests never take oversize blocks (which would then be split), and
 * oversize requests take blocks at most MP_LARGE_BUFFER larger. */
static inline int mp_split_policy_allows(size_t max_split, size_t size, size_t block) {
    if (max_split == MP_UNLIMITED) return 1;
    if (size < max_split) return block < max_split;
    return block < size + MP_LARGE_BUFFER;
}

/* No block of class c or above may serve `size` under max_split: a search stops there. */
static inline int mp_classes_exhausted(size_t max_split, size_t size, uint32_t c) {
    if (max_split == MP_UNLIMITED) return 0;
    size_t lo = mp_class_min_bytes(c);
    return size < max_split ? lo >= max_split : lo >= size + MP_LARGE_BUFFER;
}

/* Whether a block of `block` bytes taken for `size` is split (the rest stays free). Small
 * and expandable segments split down to MP_MIN_BLOCK; large ones keep a rest of up to
 * MP_SMALL_SIZE with the block, and split nothing at or above max_split. */
static inline int mp_split_rest(int small_or_expandable, size_t max_split, size_t block,
                                size_t size) {
    size_t remaining = block - size;
    if (small_or_expandable) return remaining >= MP_MIN_BLOCK;
    return size < max_split && remaining > MP_SMALL_SIZE;
}

#endif
