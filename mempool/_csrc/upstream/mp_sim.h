/* The simulated device: fake addresses, a capacity, streams whose work completes only when
 * told, events and stream waits that model ordering, fault injection. The core is tested on
 * it with no GPU, and traces are replayed on it at GPU scale. */
#ifndef MP_SIM_H
#define MP_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "mp_budget.h"

typedef struct mp_sim mp_sim;

#define MP_SIM_BASE ((uintptr_t)1 << 40)   /* first address handed out (device 0) */

/* Several simulated devices. Device k hands out addresses from MP_SIM_BASE + k *
 * MP_SIM_DEVICE_SPAN, so that memory of different devices never shares an address, as under
 * CUDA's unified addressing (pointer lookups across per-device pools, as the torch allocator
 * does, depend on it). Two sims of one device do share addresses, as before. */
#define MP_SIM_MAX_DEVICES 64
#define MP_SIM_DEVICE_SPAN ((uintptr_t)1 << 46)

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
/* Hold the next `n` segment allocations or page maps: each waits inside the upstream call,
 * as a driver call that blocks, until mp_sim_release_held or `timeout_ms` (then counted in
 * mp_sim_hold_timeouts). Tests see with it what runs while a pool waits on its upstream. */
void mp_sim_hold_allocs(mp_sim *sim, unsigned n, unsigned timeout_ms);
/* The same for the next `n` stream synchronizations, event creations and address-space
 * reservations (Note [Events outside the lock]: a pool makes none with its lock held). */
void mp_sim_hold_syncs(mp_sim *sim, unsigned n, unsigned timeout_ms);
void mp_sim_hold_event_creates(mp_sim *sim, unsigned n, unsigned timeout_ms);
void mp_sim_hold_va_reserves(mp_sim *sim, unsigned n, unsigned timeout_ms);
unsigned mp_sim_held(mp_sim *sim);         /* calls waiting now */
void mp_sim_release_held(mp_sim *sim);     /* let every waiting one go */
uint64_t mp_sim_hold_timeouts(mp_sim *sim);
/* Every page map and unmap from now on sleeps map_ns / unmap_ns before it runs, outside the
 * sim's mutex, as a driver's call takes its time (0: none, the default). The counters are
 * unchanged by it; replays and the mapper's tests (Note [Mapper]) see time move between
 * threads with it. */
void mp_sim_set_call_delays(mp_sim *sim, uint64_t map_ns, uint64_t unmap_ns);
/* A stream goes away, as with cudaStreamDestroy: its queued work completes, and its id may
 * name a new stream later. MP_EINVAL for a stream the sim never saw. */
int mp_sim_destroy_stream(mp_sim *sim, uintptr_t stream);
size_t mp_sim_num_streams(mp_sim *sim);                   /* streams the sim tracks now */
/* The next `n` event records fail (MP_EUPSTREAM), to test the paths without an event. */
void mp_sim_fail_events(mp_sim *sim, unsigned n);
size_t mp_sim_live_segments(mp_sim *sim);
size_t mp_sim_mapped_bytes(mp_sim *sim);
size_t mp_sim_live_maps(mp_sim *sim);          /* physical allocations mapped now: one per map */
uint64_t mp_sim_num_split_unmaps(mp_sim *sim); /* unmaps refused for cutting one (also errors) */
uint64_t mp_sim_num_syncs(mp_sim *sim);
/* Note [Frees the driver keeps] (mp_sim.c): the bytes the device holds, its segments and
 * pages plus segments freed behind work not yet complete, now and at most (at allocations). */
size_t mp_sim_held_bytes(mp_sim *sim);
size_t mp_sim_held_peak(mp_sim *sim);
uint64_t mp_sim_num_queries(mp_sim *sim);   /* stream_query calls */
uint64_t mp_sim_num_event_records(mp_sim *sim);
uint64_t mp_sim_num_event_creates(mp_sim *sim);
uint64_t mp_sim_num_waits(mp_sim *sim);
uint64_t mp_sim_num_errors(mp_sim *sim);   /* contract breaches seen (double map, bad free) */
size_t mp_sim_live_events(mp_sim *sim);

/* ---- CUDA graph capture (Note [Graph capture], mp_capture.h) ---- */
/* Make `stream` capture, as cuStreamBeginCapture in the driver's global mode: until
 * mp_sim_end_capture, every call a real driver refuses during a capture or that would break
 * it fails with MP_EUPSTREAM, is counted (mp_sim_capture_violations) and invalidates every
 * capture under way: a sync or query of any stream, a device sync, a query of any event (one
 * recorded on a capturing stream stays unqueryable after the capture too, until recorded
 * again), a capturing stream waiting on an event recorded outside or another stream waiting
 * on a captured event, a segment free, an unmap or an address release. Segment allocations
 * on a capturing stream are made outside the graph, as the CUDA upstream's cuMemAlloc
 * (counted in mp_sim_capture_allocs); page maps are allowed. MP_EINVAL for the legacy
 * stream (0, 1), MP_EBUSY when it captures already. */
int mp_sim_begin_capture(mp_sim *sim, uintptr_t stream);
/* MP_OK when the capture stayed valid, MP_EUPSTREAM when a violation invalidated it (it ends
 * either way), MP_EINVAL when the stream was not capturing. */
int mp_sim_end_capture(mp_sim *sim, uintptr_t stream);
int mp_sim_is_capturing(mp_sim *sim, uintptr_t stream);
/* `stream` waits for `from` within from's capture (Note [Sim capture graphs], mp_sim_graphs.c):
 * its next captured work depends on from's too; a stream that did not capture joins
 * from's capture. MP_EINVAL when `from` does not capture, the two capture apart, or
 * `stream` is the legacy stream or `from`. */
int mp_sim_capture_join(mp_sim *sim, uintptr_t stream, uintptr_t from);
/* The violations counted, and the segments allocated outside a graph, so far. */
void mp_sim_capture_counts(mp_sim *sim, uint64_t *violations, uint64_t *allocs);

/* ---- several devices (see docs/multigpu.md) ---- */
/* Make the sim device ordinal `device` (0 at creation): its addresses move to that device's
 * window. Only before the first segment or reservation: MP_EBUSY after; MP_EINVAL for a
 * device outside [0, MP_SIM_MAX_DEVICES). */
int mp_sim_set_device(mp_sim *sim, int device);
int mp_sim_device(mp_sim *sim);
/* Let device `peer` access the sim's memory, as cudaMemPoolSetAccess and cuMemSetAccess do:
 * every segment, every mapped page, and every page mapped later. Idempotent. MP_EINVAL for a
 * peer outside [0, MP_SIM_MAX_DEVICES) or the sim's own device (nothing changes). */
int mp_sim_enable_peer(mp_sim *sim, int peer);
/* Bit d set: device d was granted access (the own device is not included). */
uint64_t mp_sim_peer_mask(mp_sim *sim);
/* Bit d set: device d may read and write all of [addr, addr + nbytes): the own device and
 * the peers for segment memory; for expandable pages what each page was granted (when it was
 * mapped, or since), and'ed over the pages. 0 when some byte of the range is not backed. */
uint64_t mp_sim_access_mask(mp_sim *sim, uintptr_t addr, size_t nbytes);

/* ---- sharing with other processes (Note [Sim sharing], mp_sim_share.c) ---- */
/* Regions of shared handles open in this sim now (opens less closes), and opened ever. */
size_t mp_sim_open_imports(mp_sim *sim);
uint64_t mp_sim_imports_opened(mp_sim *sim);

#endif
