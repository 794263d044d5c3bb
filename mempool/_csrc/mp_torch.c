/* PyTorch's pluggable allocator: the device table and the C-ABI entry points (mp_torch.h).
 *
 * Note [Torch table lifetime]: an entry point reads a slot's pool while another thread may
 * register or unregister one. Each slot counts the entry points inside it (`active`). A
 * change first closes the slot (`closing`: entry points arriving now wait, they do not fail)
 * and waits for `active` to drain; with nobody inside, `live` (torch's outstanding blocks)
 * cannot move, so the check "no blocks of the old pool are still out" is exact; then the
 * pool is swapped, the slot reopened, and the old pool's reference dropped. So no entry point
 * ever uses a pool that is being destroyed, and none sees a half-made change. Every access
 * is sequentially consistent. Changes are serialised by `table_lock`; entry points never
 * take it.
 *
 * The two hot entry points take one atomic add each. alloc announces itself in `live`
 * instead of `active`: a change swaps a pool only when `live` is 0, so an alloc that has
 * announced itself (and so counts as a block out) holds the pool in place exactly as a block
 * does, and keeps the announcement when it returns a block. As for `active`, the order is
 * announce, then read `closing` (the changer writes `closing`, then reads `live`): with
 * sequentially consistent accesses one of the two sees the other. free announces nothing:
 * the block it frees is counted in `live` until it is back in the pool, and that count
 * holds the pool in place while free uses it; free then takes the block's count back. So
 * free's precondition is torch's own: the pointer is one alloc returned and not yet freed
 * (anything else is ignored, but only a block out pins the pool while free looks it up).
 * The price is that a change racing an alloc in flight is refused as if torch held a block
 * (it soon will).
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>

#include "mp_torch.h"

typedef struct mp_torch_slot {
    mp_pool *pool;       /* atomic; one reference while registered */
    int64_t active;      /* atomic; entry points inside this slot now */
    int closing;         /* atomic; a change is under way: entry points wait */
    int64_t live;        /* atomic; blocks handed to torch and not yet freed */
    uint64_t failed;     /* atomic; allocations that returned NULL for want of memory */
} mp_torch_slot;

static mp_torch_slot slots[MP_TORCH_MAX_DEVICES];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards changes */
static int max_device = -1;   /* atomic; highest index ever registered (pointer scans) */

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)
#define ADD(x, v) __atomic_add_fetch(&(x), (v), __ATOMIC_SEQ_CST)

static int valid_device(int device) { return device >= 0 && device < MP_TORCH_MAX_DEVICES; }

/* Enter a slot counted in *count (the slot's `active`, or `live` for alloc and free): its
 * pool, usable until the count is taken back, or NULL (and nothing to take back). */
static mp_pool *slot_enter_counted(mp_torch_slot *s, int64_t *count) {
    for (;;) {
        __atomic_add_fetch(count, 1, __ATOMIC_SEQ_CST);
        if (!LOAD(s->closing)) break;
        __atomic_add_fetch(count, -1, __ATOMIC_SEQ_CST);
        while (LOAD(s->closing)) sched_yield();
    }
    mp_pool *p = LOAD(s->pool);
    if (!p) __atomic_add_fetch(count, -1, __ATOMIC_SEQ_CST);
    return p;
}

static mp_pool *slot_enter(mp_torch_slot *s) { return slot_enter_counted(s, &s->active); }

static void slot_exit(mp_torch_slot *s) { ADD(s->active, -1); }

/* Enter a slot for alloc: announced in `live`. On a non-NULL return the caller owes
 * ADD(s->live, -1) unless the allocation keeps the announcement. */
static mp_pool *slot_enter_live(mp_torch_slot *s) { return slot_enter_counted(s, &s->live); }

/* Put `p` (NULL: none) in the slot unless torch still holds blocks of the pool there now.
 * Called with table_lock held; on MP_OK *old is the pool taken out (to release). */
static int slot_change_locked(mp_torch_slot *s, mp_pool *p, mp_pool **old) {
    STORE(s->closing, 1);
    while (LOAD(s->active) != 0) sched_yield();
    mp_pool *cur = LOAD(s->pool);
    if (cur && cur != p && LOAD(s->live) != 0) {
        STORE(s->closing, 0);
        return MP_EBUSY;
    }
    STORE(s->pool, p);
    STORE(s->closing, 0);
    *old = cur;
    return MP_OK;
}

/* ---- the table --------------------------------------------------------------------------- */

int mp_torch_register(int device, mp_pool *p) {
    if (!valid_device(device) || !p) return MP_EINVAL;
    mp_torch_slot *s = &slots[device];
    pthread_mutex_lock(&table_lock);
    if (LOAD(s->pool) == p) {
        pthread_mutex_unlock(&table_lock);
        return MP_OK;
    }
    mp_pool_retain(p);
    mp_pool *old = NULL;
    int rc = slot_change_locked(s, p, &old);
    if (rc == MP_OK && device > LOAD(max_device)) STORE(max_device, device);
    pthread_mutex_unlock(&table_lock);
    if (rc != MP_OK) mp_pool_release(p);
    else if (old) mp_pool_release(old);
    return rc;
}

int mp_torch_unregister(int device) {
    if (!valid_device(device)) return MP_EINVAL;
    mp_torch_slot *s = &slots[device];
    pthread_mutex_lock(&table_lock);
    mp_pool *old = NULL;
    int rc = slot_change_locked(s, NULL, &old);
    pthread_mutex_unlock(&table_lock);
    if (rc == MP_OK && old) mp_pool_release(old);
    return rc;
}

mp_pool *mp_torch_registered(int device) {
    return valid_device(device) ? LOAD(slots[device].pool) : NULL;
}

int64_t mp_torch_live_blocks(int device) {
    return valid_device(device) ? LOAD(slots[device].live) : 0;
}

uint64_t mp_torch_failed_allocs(int device) {
    return valid_device(device) ? LOAD(slots[device].failed) : 0;
}

/* ---- the entry points -------------------------------------------------------------------- */

/* An allocation on a device that routes nowhere. PyTorch gives the NULL on as a tensor, so
 * this line is all the user learns: it names the device and the fix. Each pool serves only
 * its own device, so falling back to another device's pool would hand out the wrong GPU's
 * memory. */
static void *refuse_unrouted(ssize_t size, int device) {
    if (valid_device(device))
        fprintf(stderr,
                "mempool: torch allocation of %zd bytes on device %d refused: no pool is "
                "registered for device %d (mempool.torch.register(Pool(backend='cuda', "
                "device=%d)) or mempool.torch.install_all)\n",
                size, device, device, device);
    else
        fprintf(stderr,
                "mempool: torch allocation of %zd bytes on device %d refused: devices are "
                "routed in [0, %d)\n",
                size, device, MP_TORCH_MAX_DEVICES);
    return NULL;
}

void *mempool_torch_alloc(ssize_t size, int device, void *stream) {
    if (size <= 0) return NULL;
    if (!valid_device(device)) return refuse_unrouted(size, device);
    mp_torch_slot *s = &slots[device];
    mp_pool *p = slot_enter_live(s);
    if (!p) return refuse_unrouted(size, device);
    uintptr_t ptr = 0;
    int rc = mp_alloc(p, (size_t)size, (uintptr_t)stream, &ptr);
    if (rc == MP_OK) return (void *)ptr;   /* the announcement is the block's count now */
    ADD(s->failed, 1);
    size_t reserved = mp_reserved_bytes(p), used = mp_used_bytes(p);
    ADD(s->live, -1);
    fprintf(stderr,
            "mempool: torch allocation of %zd bytes on device %d failed (%s); pool reserved "
            "%zu bytes, %zu in use\n",
            size, device,
            rc == MP_ELIMIT ? "the pool's limit refuses it"
                            : rc == MP_ENOMEM ? "out of memory" : "upstream error",
            reserved, used);
    return NULL;
}

void mempool_torch_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)stream;   /* the block knows its stream; torch passes the allocation's stream */
    if (!ptr || !valid_device(device)) return;
    mp_torch_slot *s = &slots[device];
    /* No announcement: the block's own count in `live` pins the pool (Note above). */
    mp_pool *p = LOAD(s->pool);
    if (p && mp_free(p, (uintptr_t)ptr, 0, 0) == MP_OK) ADD(s->live, -1);
}

void mempool_torch_record_stream(void *ptr, void *stream) {
    if (!ptr) return;
    int top = LOAD(max_device);
    for (int d = 0; d <= top; d++) {
        mp_torch_slot *s = &slots[d];
        mp_pool *p = slot_enter(s);
        if (!p) continue;
        int rc = mp_record_stream(p, (uintptr_t)ptr, (uintptr_t)stream);
        slot_exit(s);
        if (rc != MP_ENOTFOUND) return;
    }
}

void mempool_torch_reset(void) {
    int top = LOAD(max_device);
    for (int d = 0; d <= top; d++) {
        mp_torch_slot *s = &slots[d];
        mp_pool *p = slot_enter(s);
        if (!p) continue;
        (void)mp_empty_cache(p);
        slot_exit(s);
    }
}

void mempool_torch_memory_fraction(double fraction, int device) {
    if (!valid_device(device) || !(fraction >= 0.0)) return;   /* also refuses NaN */
    mp_torch_slot *s = &slots[device];
    mp_pool *p = slot_enter(s);
    if (!p) return;
    size_t capacity = mp_capacity(p);
    size_t limit = fraction >= 1.0 ? capacity : (size_t)(fraction * (double)capacity);
    if (capacity) (void)mp_set_limit(p, limit);
    slot_exit(s);
}

void *mempool_torch_base_alloc(void *ptr, size_t *size) {
    if (!ptr) return ptr;
    int top = LOAD(max_device);
    for (int d = 0; d <= top; d++) {
        mp_torch_slot *s = &slots[d];
        mp_pool *p = slot_enter(s);
        if (!p) continue;
        size_t nbytes = 0, requested = 0;
        uintptr_t stream = 0;
        int rc = mp_block_info(p, (uintptr_t)ptr, &nbytes, &requested, &stream);
        slot_exit(s);
        if (rc == MP_OK) {
            if (size) *size = nbytes;
            return ptr;
        }
    }
    return ptr;
}
