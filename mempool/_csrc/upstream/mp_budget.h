/* Capacity accounting and fault injection shared by the sim and host upstreams. Guarded by
 * the owning upstream's mutex. */
#ifndef MP_BUDGET_H
#define MP_BUDGET_H

#include <stddef.h>
#include <stdint.h>

#include "mp_ptrmap.h"
#include "mp_upstream.h"

typedef struct mp_budget {
    size_t capacity;        /* bytes the device may hand out */
    size_t used;            /* segments + mapped pages */
    size_t peak;
    uint64_t fail_next;     /* the next N allocations (segments or maps) fail as OOM */
    int64_t fail_map_after; /* >= 0: the next map fails after this many pages */
    uint64_t num_allocs, num_frees, num_maps, num_unmaps, num_failed;
} mp_budget;

static inline void mp_budget_init(mp_budget *b, size_t capacity) {
    b->capacity = capacity;
    b->used = b->peak = 0;
    b->fail_next = 0;
    b->fail_map_after = -1;
    b->num_allocs = b->num_frees = b->num_maps = b->num_unmaps = b->num_failed = 0;
}

/* Take nbytes from the budget, or refuse (injected failure or capacity) with MP_ENOMEM. */
static inline int mp_budget_take(mp_budget *b, size_t nbytes) {
    if (b->fail_next) {
        b->fail_next--;
        b->num_failed++;
        return MP_ENOMEM;
    }
    if (nbytes > b->capacity - b->used) {
        b->num_failed++;
        return MP_ENOMEM;
    }
    b->used += nbytes;
    if (b->used > b->peak) b->peak = b->used;
    return MP_OK;
}

static inline void mp_budget_give(mp_budget *b, size_t nbytes) { b->used -= nbytes; }

/* The physical allocations of expandable segments, kept as a driver keeps them: one per
 * map call (start -> nbytes), and an unmap must cover whole ones (mp_upstream.h), as
 * cuMemUnmap refuses part of a mapping. Guarded by the owning upstream's mutex. */
static inline int mp_mappings_whole(const mp_ptrmap *m, uintptr_t va, size_t nbytes) {
    uintptr_t a = va;
    while (a < va + nbytes) {
        size_t n = (size_t)(uintptr_t)mp_ptrmap_get(m, a);
        if (!n) return 0;   /* a starts no allocation: the range cuts one */
        a += n;
    }
    return a == va + nbytes;
}

/* Forget the allocations of [va, va + nbytes), which mp_mappings_whole accepted. */
static inline size_t mp_mappings_remove(mp_ptrmap *m, uintptr_t va, size_t nbytes) {
    size_t k = 0;
    for (uintptr_t a = va; a < va + nbytes; k++) a += (size_t)(uintptr_t)mp_ptrmap_remove(m, a);
    return k;
}

/* Host upstream's budget, for its test controls (lock around changes). */
mp_budget *mp_host_budget(void *ctx);
void mp_host_lock(void *ctx);
void mp_host_unlock(void *ctx);

#endif
