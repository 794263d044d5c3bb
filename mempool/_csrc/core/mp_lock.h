/* The pool mutex: a test-and-test-and-set spinlock that yields under contention.
 *
 * Why not pthread_mutex_t: an uncontended lock/unlock pair is one atomic exchange and one
 * release store here, against two atomic read-modify-writes for a mutex; the allocate/free
 * path takes it twice per round trip. The critical sections it guards are short (no upstream
 * call is made with it held, see Note [Lock order] in mp_core.c), so spinning
 * briefly before yielding is the right trade. */
#ifndef MP_LOCK_H
#define MP_LOCK_H

#include <pthread.h>
#include <sched.h>
#include <stdint.h>

#include "mp_assert.h"

/* The debug build (MP_DEBUG) also keeps the holder, for asserts that a call is made with
 * the lock dropped (mp_lock_held_by_me: Note [Events outside the lock]). */
typedef struct {
    volatile int locked;
#if MP_DEBUG
    volatile uintptr_t owner;   /* pthread_self() of the holder, 0 when free */
#endif
} mp_lock;

static inline void mp_lock_init(mp_lock *l) {
    l->locked = 0;
#if MP_DEBUG
    l->owner = 0;
#endif
}

static inline void mp_lock_acquire_spin(mp_lock *l);

static inline void mp_lock_acquire(mp_lock *l) {
    if (__atomic_exchange_n(&l->locked, 1, __ATOMIC_ACQUIRE)) mp_lock_acquire_spin(l);
#if MP_DEBUG
    l->owner = (uintptr_t)pthread_self();
#endif
}

static inline void mp_lock_release(mp_lock *l) {
#if MP_DEBUG
    l->owner = 0;
#endif
    __atomic_store_n(&l->locked, 0, __ATOMIC_RELEASE);
}

/* Debug build: 1 when the calling thread holds l (only the holder stores its own id, so
 * the answer is exact for the caller). Release build: 0, for asserts only. */
static inline int mp_lock_held_by_me(const mp_lock *l) {
#if MP_DEBUG
    return __atomic_load_n(&l->locked, __ATOMIC_RELAXED) &&
           l->owner == (uintptr_t)pthread_self();
#else
    (void)l;
    return 0;
#endif
}

static inline void mp_lock_acquire_spin(mp_lock *l) {
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

#endif
