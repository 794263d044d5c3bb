/* What the files of the simulated device share (mp_sim.c, mp_sim_faults.c, mp_sim_graphs.c,
 * mp_sim_peers.c), and nothing else includes: the sim's state and the functions one file
 * gives another. One mutex (`mu`) guards the whole state.
 */
#ifndef MP_SIM_INTERNAL_H
#define MP_SIM_INTERNAL_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "mp_ptrmap.h"
#include "mp_sim.h"

typedef struct sim_wait {
    size_t other;    /* index into streams */
    uint64_t seq;    /* work of `other` up to here ... */
    uint64_t at;     /* ... comes before this stream's work after position `at` */
} sim_wait;

typedef struct sim_stream {
    uintptr_t id;
    uint64_t submitted, completed;
    int capturing;   /* between mp_sim_begin_capture and mp_sim_end_capture */
    int broken;      /* its capture was invalidated by an illegal call */
    /* Note [Sim capture graphs]: the capture it takes part in, and the nodes its next
     * captured work depends on. */
    uint64_t capture_id;
    uint32_t *frontier;
    size_t nfrontier, cap_frontier;
    sim_wait *waits;
    size_t nwaits, cap_waits;
} sim_stream;

typedef struct sim_dep {
    size_t other;    /* index into streams */
    uint64_t seq;    /* work of `other` up to here */
} sim_dep;

/* Note [Frees the driver keeps]: a segment freed behind work not yet complete. */
typedef struct sim_kept {
    size_t stream;   /* index into streams */
    uint64_t seq;    /* its work up to here must complete first */
    size_t nbytes;
} sim_kept;

typedef struct sim_event {
    size_t stream;   /* index into streams, SIZE_MAX until recorded */
    uint64_t target;
    int in_use;
    int captured;    /* last recorded on a capturing stream: a graph node, never queried */
    /* Waits the stream had pending when the event was recorded: the event completes only
     * after them too, as a CUDA event recorded after cudaStreamWaitEvent does. */
    sim_dep *deps;
    size_t ndeps, cap_deps;
} sim_event;

struct mp_sim {
    pthread_mutex_t mu;
    mp_budget budget;
    size_t granularity;
    uintptr_t next_addr;
    mp_ptrmap segments;       /* ptr -> size */
    mp_ptrmap reservations;   /* va -> size */
    mp_ptrmap pages;          /* mapped page address -> access mask (own device's bit set) */
    mp_ptrmap mappings;       /* physical allocations: one per map call (mp_mappings_whole) */
    sim_stream *streams;
    size_t nstreams, cap_streams;
    /* Stream id -> index + 1 (0: empty), open addressing; and the slots of destroyed
     * streams, reused with their counters, so that old events and waits stay complete. */
    size_t *shash, shash_mask, shash_count;
    size_t *free_slots, nfree_slots, cap_free_slots;
    unsigned fail_events;     /* the next N event records fail (mp_sim_fail_events) */
    sim_event *events;
    size_t nevents, cap_events, live_events;
    uint64_t num_syncs, num_records, num_waits, num_errors, num_queries, num_creates;
    uint64_t num_split_unmaps;   /* unmaps refused for cutting a physical allocation */
    int device;               /* the simulated device's ordinal */
    uint64_t peers;           /* devices granted access (bit d = device d) */
    /* mp_sim_hold_allocs: segment allocations still to hold, those waiting now, the
     * release generation they wait for a change of, and those that gave up waiting. */
    unsigned hold_next, held, hold_timeout_ms;
    /* mp_sim_set_call_delays: each map and unmap sleeps this long, outside mu (atomic). */
    uint64_t map_delay_ns, unmap_delay_ns;
    unsigned hold_syncs_next;     /* mp_sim_hold_syncs: stream syncs still to hold */
    unsigned hold_events_next;    /* mp_sim_hold_event_creates: event creations to hold */
    unsigned hold_va_next;        /* mp_sim_hold_va_reserves: address reservations to hold */
    uint64_t release_gen, hold_timeouts;
    pthread_cond_t hold_cv;
    /* Graph capture (mp_sim_begin_capture): streams capturing now, calls a real driver
     * would refuse or that would break a capture, segments allocated outside a capture's
     * graph for a capturing stream. */
    size_t ncapturing;
    uint64_t capture_violations, capture_allocs;
    /* Note [Sim capture graphs]: node i + 1's dependencies, and the last capture's id. */
    struct sim_node { uint32_t *parents; uint32_t nparents; } *nodes;
    size_t nnodes, cap_nodes;
    uint64_t last_capture;
    /* Note [Frees the driver keeps]: segments freed behind incomplete work, their bytes, and
     * the most the device held (handed out plus kept) at any allocation. */
    sim_kept *kept;
    size_t nkept, cap_kept, kept_bytes, held_peak;
    /* Note [Sim sharing] (mp_sim_share.c): this sim's token in the handles it makes, and the
     * regions of handles opened here (address -> bytes). */
    uint64_t share_token;
    mp_ptrmap imports;
    uint64_t num_imports_opened;
};

/* The access a page gets when mapped: the device itself and every peer granted so far. */
static inline uint64_t sim_own_access(const mp_sim *s) {
    return s->peers | (uint64_t)1 << s->device;
}

/* Shared between the sim's files only: not exported from the extension. */
#define MP_SIM_PRIVATE __attribute__((visibility("hidden")))

/* ---- the device model (mp_sim.c) ---- */
/* The index of stream `id`, made on first use; SIZE_MAX when out of memory. */
MP_SIM_PRIVATE size_t sim_stream_index(mp_sim *s, uintptr_t id);
/* The live stream of that handle, or NULL. */
MP_SIM_PRIVATE sim_stream *sim_live_stream(mp_sim *s, uintptr_t stream);
/* Note [Frees the driver keeps]: forget the kept frees whose work has run. */
MP_SIM_PRIVATE void sim_drop_completed_kept_locked(mp_sim *s);

/* ---- held calls (mp_sim_faults.c) ---- */
/* Wait, the sim's mutex let go meanwhile, for mp_sim_release_held or the timeout. */
MP_SIM_PRIVATE void sim_hold_locked(mp_sim *s, unsigned *next);

/* ---- graph capture (mp_sim_graphs.c) ---- */
/* A call the driver refuses during a capture: counted, every capture under way invalidated;
 * returns MP_EUPSTREAM. */
MP_SIM_PRIVATE int sim_capture_violation(mp_sim *s);
MP_SIM_PRIVATE int sim_is_capturing(mp_sim *s, uintptr_t stream);
/* A captured node on stream si (Note [Sim capture graphs]). */
MP_SIM_PRIVATE void sim_capture_node(mp_sim *s, size_t si);
MP_SIM_PRIVATE int sim_stream_capturing(void *ctx, uintptr_t stream, int *capturing);
MP_SIM_PRIVATE int sim_capture_frontier(void *ctx, uintptr_t stream, uint64_t *graph,
                                        uintptr_t *nodes, size_t cap, size_t *n);
MP_SIM_PRIVATE int sim_capture_follows(void *ctx, uintptr_t stream, const uintptr_t *nodes,
                                       size_t n, unsigned char *followed);

/* ---- sharing with other processes (mp_sim_share.c) ---- */
/* Fill the sharing members of `up` and the sim's state for them; and free that state. */
MP_SIM_PRIVATE int sim_share_init(mp_sim *s, mp_upstream *up);
MP_SIM_PRIVATE void sim_share_destroy(mp_sim *s);

/* mp_sim_faults.c: sleep for *delay_ns (read atomically), without the sim's mutex. */
void sim_call_delay(const uint64_t *delay_ns);

#endif
