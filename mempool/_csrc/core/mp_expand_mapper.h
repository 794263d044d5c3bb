/* The mapper thread of expandable segments: stock mapped ahead of each growing range's edge,
 * threshold releases behind. See Note [Mapper] in mp_expand_mapper.c. */
#ifndef MP_EXPAND_MAPPER_H
#define MP_EXPAND_MAPPER_H

#include "mp_internal.h"

/* Ask the mapper to stock the edge of range seg (a growing range of a pool with map_ahead),
 * starting the thread at the first ask. */
void mp_mapper_want_ahead_locked(mp_pool *p, mp_segment *seg);
/* Hand the release threshold's check to the mapper. 0 when there is no mapper to take it
 * (its thread could not be started): the caller releases itself. */
int mp_mapper_want_behind_locked(mp_pool *p);
/* After an allocation carved b from the free lists: flag b's range when b took the free
 * block at its edge below half of map_ahead. */
void mp_mapper_check_edge_locked(mp_pool *p, const mp_block *b);
static inline void mp_mapper_after_alloc_locked(mp_pool *p, const mp_block *b) {
    if (MP_UNLIKELY(p->cfg.map_ahead) && b->seg->expandable) mp_mapper_check_edge_locked(p, b);
}
/* At destroy, without the lock: stop the thread, after the map or unmap it has in flight,
 * and free its state. */
void mp_mapper_stop(mp_pool *p);

/* mp_expand.c: map stock at the end of range seg (Note [Mapper]); the physical allocations
 * mapped. Drops and retakes the lock; seg may be gone when it returns. */
size_t mp_expand_stock_edge_locked(mp_pool *p, mp_segment *seg);
/* mp_release.c: the release threshold's check for expandable segments (Note [Threshold
 * releases without a sync]), where the mapper runs it; the allocations unmapped. */
uint64_t mp_release_threshold_pages_locked(mp_pool *p);

#endif
