/* The simulated device's test controls for failures and timing: injected failures, calls
 * held inside the upstream until released, and the counters tests read (see mp_sim.h). */
#include "mp_sim_internal.h"

#include <errno.h>
#include <time.h>

/* A held call (segment allocation, page map, stream sync, event creation, address
 * reservation): wait, the sim's mutex let go meanwhile, for
 * mp_sim_release_held or the timeout. */
void sim_hold_locked(mp_sim *s, unsigned *next) {
    (*next)--;
    s->held++;
    uint64_t gen = s->release_gen;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += s->hold_timeout_ms / 1000;
    until.tv_nsec += (long)(s->hold_timeout_ms % 1000) * 1000000L;
    if (until.tv_nsec >= 1000000000L) {
        until.tv_sec++;
        until.tv_nsec -= 1000000000L;
    }
    int rc = 0;
    while (s->release_gen == gen && rc != ETIMEDOUT)
        rc = pthread_cond_timedwait(&s->hold_cv, &s->mu, &until);
    if (s->release_gen == gen) s->hold_timeouts++;
    s->held--;
}

void mp_sim_fail_events(mp_sim *s, unsigned n) {
    pthread_mutex_lock(&s->mu);
    s->fail_events = n;
    pthread_mutex_unlock(&s->mu);
}

mp_budget *mp_sim_budget(mp_sim *s) { return &s->budget; }
void mp_sim_lock(mp_sim *s) { pthread_mutex_lock(&s->mu); }
void mp_sim_unlock(mp_sim *s) { pthread_mutex_unlock(&s->mu); }

static void set_hold(mp_sim *s, unsigned *next, unsigned n, unsigned timeout_ms) {
    pthread_mutex_lock(&s->mu);
    *next = n;
    s->hold_timeout_ms = timeout_ms;
    pthread_mutex_unlock(&s->mu);
}

void mp_sim_hold_allocs(mp_sim *s, unsigned n, unsigned timeout_ms) {
    set_hold(s, &s->hold_next, n, timeout_ms);
}

void mp_sim_hold_syncs(mp_sim *s, unsigned n, unsigned timeout_ms) {
    set_hold(s, &s->hold_syncs_next, n, timeout_ms);
}

void mp_sim_hold_event_creates(mp_sim *s, unsigned n, unsigned timeout_ms) {
    set_hold(s, &s->hold_events_next, n, timeout_ms);
}

void mp_sim_hold_va_reserves(mp_sim *s, unsigned n, unsigned timeout_ms) {
    set_hold(s, &s->hold_va_next, n, timeout_ms);
}

unsigned mp_sim_held(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    unsigned n = s->held;
    pthread_mutex_unlock(&s->mu);
    return n;
}

void mp_sim_release_held(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    s->release_gen++;
    pthread_cond_broadcast(&s->hold_cv);
    pthread_mutex_unlock(&s->mu);
}

uint64_t mp_sim_hold_timeouts(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t n = s->hold_timeouts;
    pthread_mutex_unlock(&s->mu);
    return n;
}

size_t mp_sim_live_segments(mp_sim *s) { return s->segments.count; }
size_t mp_sim_mapped_bytes(mp_sim *s) { return s->pages.count * s->granularity; }

size_t mp_sim_live_maps(mp_sim *s) { return s->mappings.count; }
uint64_t mp_sim_num_split_unmaps(mp_sim *s) { return s->num_split_unmaps; }

uint64_t mp_sim_num_syncs(mp_sim *s) { return s->num_syncs; }
uint64_t mp_sim_num_queries(mp_sim *s) { return s->num_queries; }

uint64_t mp_sim_num_event_records(mp_sim *s) { return s->num_records; }
uint64_t mp_sim_num_event_creates(mp_sim *s) { return s->num_creates; }

uint64_t mp_sim_num_waits(mp_sim *s) { return s->num_waits; }
uint64_t mp_sim_num_errors(mp_sim *s) { return s->num_errors; }

size_t mp_sim_live_events(mp_sim *s) { return s->live_events; }
size_t mp_sim_held_peak(mp_sim *s) { return s->held_peak; }

/* Note [Frees the driver keeps]: the kept frees whose work has run are dropped first. */
size_t mp_sim_held_bytes(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    sim_drop_completed_kept_locked(s);
    size_t held = s->budget.used + s->kept_bytes;
    pthread_mutex_unlock(&s->mu);
    return held;
}

void mp_sim_set_call_delays(mp_sim *s, uint64_t map_ns, uint64_t unmap_ns) {
    __atomic_store_n(&s->map_delay_ns, map_ns, __ATOMIC_RELAXED);
    __atomic_store_n(&s->unmap_delay_ns, unmap_ns, __ATOMIC_RELAXED);
}

void sim_call_delay(const uint64_t *delay_ns) {
    uint64_t ns = __atomic_load_n(delay_ns, __ATOMIC_RELAXED);
    if (!ns) return;
    struct timespec t = {(time_t)(ns / 1000000000u), (long)(ns % 1000000000u)};
    while (nanosleep(&t, &t) == -1 && errno == EINTR) {}
}
