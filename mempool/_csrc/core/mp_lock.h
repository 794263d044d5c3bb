/* The pool mutex: a test-and-test-and-set spinlock that yields under contention.
 *
 * Why not pthread_mutex_t: an uncontended lock/unlock pair is one atomic exchange and one
 * release store here, against two atomic read-modify-writes for a mutex; the allocate/free
 * path takes it twice per round trip. The critical sections it guards are short (no upstream
 * call is made with it held, see Note [Lock order] in mp_core.c), so spinning
 * briefly before yielding is the right trade. */
#ifndef MP_LOCK_H
#define MP_LOCK_H

#include <sched.h>

typedef struct { volatile int locked; } mp_lock;

static inline void mp_lock_init(mp_lock *l) { l->locked = 0; }

static inline void mp_lock_acquire(mp_lock *l) {
    if (!__atomic_exchange_n(&l->locked, 1, __ATOMIC_ACQUIRE)) return;
    for (unsigned spins = 0;; spins++) {
        while (__atomic_load_n(&l->locked, __ATOMIC_RELAXED)) {
            if (spins++ < 64) {
#if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
#endif
            } else {
                sched_yield();
            }
        }
        if (!__atomic_exchange_n(&l->locked, 1, __ATOMIC_ACQUIRE)) return;
    }
}

static inline void mp_lock_release(mp_lock *l) { __atomic_store_n(&l->locked, 0, __ATOMIC_RELEASE); }

#endif
