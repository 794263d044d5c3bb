/* Pools across fork(): a registry of the live pools and the fork handlers over it. */

/* Note [Pools across fork]
 * fork() copies the process with one thread, the caller. A pool lock that another thread
 * held at that moment stays held in the child, by a thread that does not exist there, and
 * the child's first call on the pool spun for ever (DataLoader workers, Dask's and
 * multiprocessing's fork start method all fork, often while other threads use a pool).
 *
 * So every pool is in a registry, a list under a process-wide mutex, and handlers
 * registered once with pthread_atfork (at the first pool's creation) act on it:
 * - prepare takes the registry's mutex, then every pool's lock: the fork waits for the
 *   critical sections under way, which are short and never wait for the GIL (Note [Lock
 *   order], mp_core.c; a thread that forks from Python holds the GIL, and no thread holds
 *   a pool lock while it waits for the GIL), so each pool is copied between two operations;
 * - the parent's handler lets them all go again;
 * - the child's marks every pool inherited and frees its lock.
 *
 * What a child may do with an inherited pool: nothing but drop it. Its memory belongs to the
 * parent: device memory cannot be used from a forked child (CUDA is not fork-safe), an
 * operation under way in another thread at the fork (a segment allocation or release with
 * the lock dropped, which the prepare handler does not wait for) is the parent's, and the
 * upstream's own locks may have been held by such a thread. So every call that would act on
 * it (allocate, free, release, forget a stream, the Pool's methods) fails at once with
 * MP_EFORKED, and the Pool raises an error that names the process that made it; the child
 * makes pools of its own. Destroying an inherited pool gives nothing back to any upstream
 * and frees none of its state: the process's end returns its host memory. A pool made in
 * the child is the child's, and works as any pool. docs/reliability.md says it for users;
 * tests/core/test_fork.py forks while threads allocate, free and empty on sim and host pools. */

#include <pthread.h>
#include <unistd.h>

#include "mp_internal.h"

static pthread_mutex_t registry_lock = PTHREAD_MUTEX_INITIALIZER;
static mp_pool *registry;   /* guarded by registry_lock */
static pthread_once_t handlers_once = PTHREAD_ONCE_INIT;

static void before_fork(void) {
    pthread_mutex_lock(&registry_lock);
    for (mp_pool *p = registry; p; p = p->reg_next) mp_lock_acquire(&p->lock);
}

static void after_fork_parent(void) {
    for (mp_pool *p = registry; p; p = p->reg_next) mp_lock_release(&p->lock);
    pthread_mutex_unlock(&registry_lock);
}

static void after_fork_child(void) {
    for (mp_pool *p = registry; p; p = p->reg_next) {
        p->inherited = 1;
        mp_lock_init(&p->lock);   /* its holder is the forking thread: the child's own */
        p->mapper = NULL;   /* Note [Mapper]: its thread is the parent's; left, not freed */
    }
    pthread_mutex_unlock(&registry_lock);
}

static void install_handlers(void) {
    (void)pthread_atfork(before_fork, after_fork_parent, after_fork_child);
}

void mp_fork_register(mp_pool *p) {
    pthread_once(&handlers_once, install_handlers);
    p->creator_pid = (long)getpid();
    pthread_mutex_lock(&registry_lock);
    p->reg_prev = NULL;
    p->reg_next = registry;
    if (registry) registry->reg_prev = p;
    registry = p;
    pthread_mutex_unlock(&registry_lock);
}

void mp_fork_unregister(mp_pool *p) {
    pthread_mutex_lock(&registry_lock);
    if (p->reg_prev) p->reg_prev->reg_next = p->reg_next;
    else if (registry == p) registry = p->reg_next;
    if (p->reg_next) p->reg_next->reg_prev = p->reg_prev;
    p->reg_prev = p->reg_next = NULL;
    pthread_mutex_unlock(&registry_lock);
}

__attribute__((cold, noinline)) int mp_lock_refuse_inherited(mp_pool *p) {
    mp_lock_release(&p->lock);
    return 0;
}

long mp_pool_inherited(const mp_pool *p) {
    return __atomic_load_n(&p->inherited, __ATOMIC_RELAXED) ? p->creator_pid : 0;
}
