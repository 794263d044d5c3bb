/* The simulated device: fake addresses, a capacity, streams whose work completes only when
 * told, events and stream waits that model ordering, fault injection. The core is tested on
 * it with no GPU, and traces are replayed on it at GPU scale. */
#ifndef MP_SIM_H
#define MP_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "mp_budget.h"

typedef struct mp_sim mp_sim;

#define MP_SIM_BASE ((uintptr_t)1 << 40)   /* first address handed out */

/* The sim context behind an upstream made by mp_sim_upstream (up->ctx). Test controls: */
uint64_t mp_sim_launch(mp_sim *sim, uintptr_t stream);          /* queue work; its sequence no. */
void mp_sim_complete(mp_sim *sim, uintptr_t stream);            /* finish all queued work */
void mp_sim_complete_all(mp_sim *sim);
/* 1 when work of `other` up to `seq` is complete or `stream` waits for it. */
int mp_sim_ordered(mp_sim *sim, uintptr_t stream, uintptr_t other, uint64_t seq);
void mp_sim_stream_info(mp_sim *sim, uintptr_t stream, uint64_t *submitted, uint64_t *completed);
mp_budget *mp_sim_budget(mp_sim *sim);   /* lock with mp_sim_lock around changes */
void mp_sim_lock(mp_sim *sim);
void mp_sim_unlock(mp_sim *sim);
size_t mp_sim_live_segments(mp_sim *sim);
size_t mp_sim_mapped_bytes(mp_sim *sim);
uint64_t mp_sim_num_syncs(mp_sim *sim);
uint64_t mp_sim_num_event_records(mp_sim *sim);
uint64_t mp_sim_num_waits(mp_sim *sim);
uint64_t mp_sim_num_errors(mp_sim *sim);   /* contract breaches seen (double map, bad free) */
size_t mp_sim_live_events(mp_sim *sim);

#endif
