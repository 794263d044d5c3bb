/* Note [Mapper]
 * Why: a driver maps or unmaps one physical allocation in tens of microseconds whatever its
 * size, so expandable segments map one allocation per growth (Note [Growth extents]), and
 * an allocation goes back only whole, which keeps free pages mapped. Fine allocations (one
 * per page, max_map_size = the page) would release closely but pay a driver call per page on
 * the allocating thread. With map_ahead set, a thread of the pool's own takes both costs off
 * that thread:
 * - Ahead: after a growth that extends a range into its unmapped tail (grow_locked), or an
 *   allocation that leaves the free block at a range's edge below map_ahead / 2
 *   (mp_mapper_check_edge_locked), the allocating thread flags the range (seg->ahead) and
 *   signals. The mapper, under the pool lock, finds flagged ranges afresh from the pool's
 *   segment list each time it holds the lock, and maps at the range's end enough pages that
 *   the edge's free block holds map_ahead (mp_expand_stock_edge_locked): one growth through
 *   map_locked, so the pages in flight are a busy block and the lock is dropped around the
 *   driver calls; the pages join the owner stream's free list merged with the edge block,
 *   and the next requests take them as ordinary free-list hits.
 * - Behind: the release threshold's check after each alloc and free (Note [Threshold
 *   releases without a sync]) is flagged for the mapper, which runs it (queries and
 *   unmaps) on its thread. empty_cache, trim, the limit, the garbage collection threshold,
 *   out of memory and the high-water rule still release on the calling thread.
 * Protocol: the flags (seg->ahead, behind) are guarded by the pool lock; `pending`, `busy`
 * and `stop` by the mapper's mutex, which is taken after the pool lock or alone, never the
 * other way round: an allocating thread signals with the pool lock held, and the mapper
 * waits for work and reports idle holding only its mutex. The mapper never holds the pool
 * lock across a map, an unmap or a sync (stream queries and capture checks, which do not
 * block, are made under it, as on any thread), so fork's prepare handler (Note [Pools
 * across fork]) waits at most for one of its critical sections. The thread starts at the
 * first flag of a pool with map_ahead and stops at destroy, after the map or unmap it has
 * in flight. A forked child's inherited pool has no mapper (after_fork_child forgets it,
 * and such a pool serves no call); a pool made in the child starts its own when needed.
 * Limits: stock never takes the pool past its limit, the garbage collection threshold or
 * the release threshold (mp_expand_stock_edge_locked stops short of each), is never mapped
 * while a stream of the pool captures a graph, and makes no release of its own; a map the
 * device refuses stocks nothing until the next flag. Stock counts as reserved memory: at
 * most map_ahead more than needed per growing range at the peak. If the thread cannot be
 * made, the pool behaves as without map_ahead. */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#include "mp_expand.h"

typedef struct mp_mapper {
    pthread_t thread;
    pthread_mutex_t mu;
    pthread_cond_t wake;   /* to the mapper: pending or stop */
    pthread_cond_t idle;   /* to waiters: neither pending nor busy */
    int pending;           /* mu: flags set since the mapper last looked */
    int busy;              /* mu: a pass under way */
    int stop;              /* mu (read without it between ranges) */
    int failed;            /* pool lock: the thread could not be made: none is used */
    int behind;            /* pool lock: the release threshold's check is wanted */
} mp_mapper;

/* One pass: the threshold's check, then every flagged range, each looked up afresh. */
static void mapper_pass(mp_pool *p, mp_mapper *m) {
    mp_lock_acquire(&p->lock);
    if (m->behind) {
        m->behind = 0;
        p->stats.num_behind_unmaps += mp_release_threshold_pages_locked(p);
    }
    while (!__atomic_load_n(&m->stop, __ATOMIC_RELAXED)) {
        mp_segment *seg = p->segments;
        while (seg && !seg->ahead) seg = seg->next;
        if (!seg) break;
        seg->ahead = 0;
        p->stats.num_ahead_maps += mp_expand_stock_edge_locked(p, seg);
    }
    mp_lock_release(&p->lock);
}

static void *mapper_main(void *arg) {
    mp_pool *p = arg;
    mp_mapper *m = p->mapper;
    pthread_mutex_lock(&m->mu);
    for (;;) {
        while (!m->pending && !m->stop) pthread_cond_wait(&m->wake, &m->mu);
        if (m->stop) break;
        m->pending = 0;
        m->busy = 1;
        pthread_mutex_unlock(&m->mu);
        mapper_pass(p, m);
        pthread_mutex_lock(&m->mu);
        m->busy = 0;
        if (!m->pending) pthread_cond_broadcast(&m->idle);
    }
    pthread_cond_broadcast(&m->idle);
    pthread_mutex_unlock(&m->mu);
    return NULL;
}

/* The pool's mapper, made and started at the first call; NULL when it cannot be. */
static mp_mapper *mapper_locked(mp_pool *p) {
    mp_mapper *m = p->mapper;
    if (m) return m->failed ? NULL : m;
    if (!(m = calloc(1, sizeof *m))) return NULL;
    pthread_mutex_init(&m->mu, NULL);
    pthread_cond_init(&m->wake, NULL);
    pthread_cond_init(&m->idle, NULL);
    p->mapper = m;
    /* Blocked signals in the new thread: a process's signal handlers run on its own threads. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    m->failed = pthread_create(&m->thread, NULL, mapper_main, p) != 0;
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return m->failed ? NULL : m;
}

static int signal_locked(mp_pool *p) {
    mp_mapper *m = mapper_locked(p);
    if (!m) return 0;
    pthread_mutex_lock(&m->mu);
    m->pending = 1;
    pthread_cond_signal(&m->wake);
    pthread_mutex_unlock(&m->mu);
    return 1;
}

void mp_mapper_want_ahead_locked(mp_pool *p, mp_segment *seg) {
    if (seg->ahead) return;   /* flagged already: the mapper will look */
    seg->ahead = 1;
    if (!signal_locked(p)) seg->ahead = 0;
}

int mp_mapper_want_behind_locked(mp_pool *p) {
    mp_mapper *m = p->mapper;
    if (m && !m->failed && m->behind) return 1;
    if (!signal_locked(p)) return 0;
    p->mapper->behind = 1;
    return 1;
}

void mp_mapper_check_edge_locked(mp_pool *p, const mp_block *b) {
    mp_segment *seg = b->seg;
    if (!seg->growing || seg->ahead) return;
    const mp_block *e = b->next;
    size_t have = 0;
    if (e && e->state == MP_BLOCK_FREE && e->stream == seg->stream) {
        have = e->nbytes;
        e = e->next;
    }
    /* At the edge: the unmapped tail (not in flight) follows. */
    if (!e || e->state != MP_BLOCK_UNMAPPED || e->next || e->busy) return;
    if (have < p->cfg.map_ahead / 2) mp_mapper_want_ahead_locked(p, seg);
}

int mp_mapper_wait_idle(mp_pool *p) {
    if (!mp_lock_own(p)) return MP_EFORKED;   /* Note [Pools across fork] */
    mp_mapper *m = p->mapper && !p->mapper->failed ? p->mapper : NULL;
    mp_lock_release(&p->lock);
    if (!m) return MP_OK;
    pthread_mutex_lock(&m->mu);
    while ((m->pending || m->busy) && !m->stop) pthread_cond_wait(&m->idle, &m->mu);
    pthread_mutex_unlock(&m->mu);
    return MP_OK;
}

void mp_mapper_stop(mp_pool *p) {
    mp_mapper *m = p->mapper;
    if (!m) return;
    if (!m->failed) {
        pthread_mutex_lock(&m->mu);
        __atomic_store_n(&m->stop, 1, __ATOMIC_RELAXED);
        pthread_cond_signal(&m->wake);
        pthread_mutex_unlock(&m->mu);
        pthread_join(m->thread, NULL);
    }
    pthread_cond_destroy(&m->wake);
    pthread_cond_destroy(&m->idle);
    pthread_mutex_destroy(&m->mu);
    free(m);
    p->mapper = NULL;
}
