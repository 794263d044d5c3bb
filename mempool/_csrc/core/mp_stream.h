/* Streams and events (mp_stream.c). Internal to the core; every function expects the pool
 * lock held unless its name ends in _unlocked. */
#ifndef MP_STREAM_H
#define MP_STREAM_H

#include <stdlib.h>
#include <string.h>

#include "mp_internal.h"

/* mp_stream_table.c (Note [Streams without end]): the struct of a handle, or NULL; whether
 * s holds a free or hot block; s out of `holding`; s out of the table and of `streams`
 * (index MP_STREAM_DEAD after), not freed. */
mp_stream *mp_stream_find_locked(const mp_pool *p, uintptr_t handle);
int mp_stream_holds(const mp_stream *s);
void mp_stream_unhold_locked(mp_pool *p, mp_stream *s);
void mp_stream_remove_locked(mp_pool *p, mp_stream *s);

/* Note [Stream reuse]: the best fit among other streams' free blocks for s, made safe for s
 * by an event wait; NULL when none may serve. */
mp_block *mp_take_from_other_stream_locked(mp_pool *p, mp_stream *s, int kind, size_t size);
/* mp_free of a block that other streams used: pending until they pass the free. `events`
 * (room for one per use) is taken. May drop the lock and take it again. */
void mp_free_pending_locked(mp_pool *p, mp_block *b, uintptr_t *events);

/* The streams recorded on a block (record_stream), besides its owner. */
static inline void mp_use_remove(mp_block *b, mp_stream *s) {
    for (uint16_t i = 0; i < b->nuses; i++) {
        if (b->uses[i] == s) {
            b->uses[i] = b->uses[--b->nuses];
            return;
        }
    }
}

static inline int mp_use_has(const mp_block *b, const mp_stream *s) {
    for (uint16_t i = 0; i < b->nuses; i++)
        if (b->uses[i] == s) return 1;
    return 0;
}

/* Room for one more recorded stream on b (MP_ENOMEM / MP_EINVAL when there is none). */
static inline int mp_use_reserve(mp_block *b) {
    if (b->nuses < b->cap_uses) return MP_OK;
    if (b->cap_uses >= MP_MAX_RECORDED_STREAMS) return MP_EINVAL;
    uint16_t cap = (uint16_t)(b->cap_uses * 2);
    mp_stream **grown = malloc(cap * sizeof *grown);
    if (!grown) return MP_ENOMEM;
    memcpy(grown, b->uses, b->nuses * sizeof *grown);
    if (b->uses != b->inline_uses) free(b->uses);
    b->uses = grown;
    b->cap_uses = cap;
    return MP_OK;
}

#endif
