/* Per-stream free lists: blocks binned by size class, with a two-level bitmap to find the
 * first non-empty class at or above a size in a few instructions.
 *
 * Classes are the size policy's (mp_size.h). A search scans the request's own class for the
 * smallest block that fits, then takes the smallest block of the next non-empty class:
 * exact best fit, ties broken by the most recently freed block (hot in cache, and
 * deterministic). Not thread-safe: guarded by the pool lock. */
#ifndef MP_FREELIST_H
#define MP_FREELIST_H

#include <stddef.h>
#include <stdint.h>

#include "mp_size.h"   /* the size classes */

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

/* mp_freelist_insert/remove are in mp_internal.h, which defines the block. */

/* First non-empty class >= cls, or MP_NCLASSES when there is none. */
uint32_t mp_freelist_next_class(const mp_freelist *fl, uint32_t cls);

#endif
