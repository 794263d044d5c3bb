/* PyTorch's pluggable allocator: the device table and the C-ABI entry points (mp_torch.h).
 * A tracking layer over the core's public API, as mp_dlpack.c: PyTorch's accounting (which
 * blocks it holds, whether a pool may leave the table) lives here, in a tally per
 * registration that the core moves under its lock (Note [Block tallies], mp_core.h).
 *
 * Note [Torch table lifetime]
 * PyTorch calls the entry points from any thread, without the GIL, while Python may
 * register or unregister a device's pool: an entry point reads a slot while another thread
 * changes it.
 *
 * A slot holds an entry: a pool and the tally of the blocks PyTorch took from it through
 * this registration. alloc and free, called for every tensor, take no atomic of their own.
 * alloc reads the slot's entry and calls mp_alloc_tallied, which counts the allocation in
 * the entry's tally under the pool's lock, from its first step to the block's free, and
 * refuses once the tally is closed. free reads the slot and frees: the block's count holds
 * the pool in the table until the free is done with it. A change closes the old entry's
 * tally under the pool's lock, which fails while it counts any block or allocation in
 * flight, so torch never holds a block of a pool that left the table, and swaps the slot
 * after. An alloc that read the old entry just before finds its tally closed. The entry and
 * the pool's struct are still there even if the pool has been destroyed since: entries are
 * never freed, and a pool that was ever in the table keeps its struct
 * (mp_pool_keep_struct; a few kilobytes each).
 *
 * The rarely called entry points (record_stream, reset, memory fraction, base allocation)
 * count themselves in the slot's `active` instead: a change first closes the slot (entry
 * points arriving then wait, they do not fail), waits for `active` to drain, swaps, reopens,
 * and only then drops the old pool's reference. Changes are serialised by `table_lock`;
 * entry points never take it. Every access to a slot is sequentially consistent.
 *
 * The price is one precondition: free must get only pointers alloc returned, which is
 * PyTorch's own contract. Another pointer is ignored, but nothing pins the pool while it is
 * looked up. The gain: the entry points pay the pool's lock and nothing else (docs/decisions.md
 * has the alternative).
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "mp_assert.h"
#include "mp_torch_internal.h"

/* One registration of a pool. Never freed: an entry point may hold it past its slot's
 * change (Note above). */
typedef struct mp_torch_entry {
    mp_pool *pool;                  /* one reference while in its slot */
    mp_tally tally;                 /* guarded by the pool's lock (Note [Block tallies]) */
    struct mp_torch_entry *older;   /* every entry made, newest first (immutable) */
} mp_torch_entry;

typedef struct mp_torch_slot {
    mp_torch_entry *entry;   /* atomic; NULL when no pool is registered */
    int64_t active;      /* atomic; rare entry points inside this slot now */
    int closing;         /* atomic; a change is under way: rare entry points wait */
    uint64_t failed;     /* atomic; allocations that returned NULL for want of memory */
} mp_torch_slot;

static mp_torch_slot slots[MP_TORCH_MAX_DEVICES];
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards changes */
static int max_device = -1;   /* atomic; highest index ever registered (pointer scans) */
static mp_torch_entry *entries;   /* atomic; newest first (mp_alloc_torch's look-up) */

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)
#define ADD(x, v) __atomic_add_fetch(&(x), (v), __ATOMIC_SEQ_CST)

#define valid_device mp_torch_valid_device

/* Note [Segment kind at run time] (mp_torch_private.c): PyTorch's expandable_segments
 * setting per device (0: never set at run time, 1: off, 2: on), and whether it asks for the
 * other kind than the registered pool's (what the glue reads at each allocation). Written
 * under table_lock. */
static int kind_wanted[MP_TORCH_MAX_DEVICES];
int mp_torch_kind_switched_by_device[MP_TORCH_MAX_DEVICES];
#define kind_switched mp_torch_kind_switched_by_device

static void update_kind_switched_locked(int device) {
    mp_torch_entry *e = LOAD(slots[device].entry);
    int wanted = kind_wanted[device];
    int switched = e && wanted &&
                   (wanted == 2) != (mp_pool_config(e->pool)->expandable_segments != 0);
    STORE(kind_switched[device], switched);
}

/* Enter a slot for a rare entry point: its pool, usable until slot_exit, or NULL (and
 * nothing to exit). The order is announce, then read `closing`; a change writes `closing`,
 * then reads `active`: one of the two sees the other. */
static mp_pool *slot_enter(mp_torch_slot *s) {
    for (;;) {
        ADD(s->active, 1);
        if (!LOAD(s->closing)) break;
        ADD(s->active, -1);
        while (LOAD(s->closing)) sched_yield();
    }
    mp_torch_entry *e = LOAD(s->entry);
    if (!e) ADD(s->active, -1);
    return e ? e->pool : NULL;
}

static void slot_exit(mp_torch_slot *s) {
    int64_t left = ADD(s->active, -1);
    mp_check(left >= 0);   /* an exit without its enter would let a change free a used pool */
}

/* Put `p` (NULL: none) in the slot unless torch still holds blocks of the pool there now.
 * Called with table_lock held; on MP_OK *old is the pool taken out (to release). */
static int slot_change_locked(mp_torch_slot *s, mp_pool *p, mp_pool **old) {
    mp_assert(s >= slots && s < slots + MP_TORCH_MAX_DEVICES);
    mp_torch_entry *cur = LOAD(s->entry), *e = NULL;
    if (p) {
        e = calloc(1, sizeof *e);
        if (!e) return MP_ENOMEM;
        e->pool = p;
    }
    if (cur && mp_tally_close(cur->pool, &cur->tally) != MP_OK) {
        free(e);   /* never published */
        return MP_EBUSY;
    }
    if (e) {
        mp_pool_keep_struct(p);
        e->older = LOAD(entries);
        STORE(entries, e);
    }
    STORE(s->closing, 1);
    while (LOAD(s->active) != 0) sched_yield();
    mp_assert(LOAD(s->active) == 0);
    STORE(s->entry, e);
    STORE(s->closing, 0);
    *old = cur ? cur->pool : NULL;
    return MP_OK;
}

/* ---- the table --------------------------------------------------------------------------- */

int mp_torch_register(int device, mp_pool *p) {
    if (!valid_device(device) || !p) return MP_EINVAL;
    mp_torch_slot *s = &slots[device];
    pthread_mutex_lock(&table_lock);
    mp_torch_entry *cur = LOAD(s->entry);
    if (cur && cur->pool == p) {
        pthread_mutex_unlock(&table_lock);
        return MP_OK;
    }
    mp_pool_retain(p);
    mp_pool *old = NULL;
    int rc = slot_change_locked(s, p, &old);
    if (rc == MP_OK && device > LOAD(max_device)) STORE(max_device, device);
    if (rc == MP_OK) update_kind_switched_locked(device);
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
    if (rc == MP_OK) update_kind_switched_locked(device);
    pthread_mutex_unlock(&table_lock);
    if (rc == MP_OK && old) mp_pool_release(old);
    return rc;
}

int mp_torch_set_expandable(int device, int expandable) {
    if (!valid_device(device)) return MP_EINVAL;
    pthread_mutex_lock(&table_lock);
    kind_wanted[device] = expandable ? 2 : 1;
    update_kind_switched_locked(device);
    pthread_mutex_unlock(&table_lock);
    return MP_OK;
}

int mp_torch_kind_switched(int device) {
    return valid_device(device) ? LOAD(kind_switched[device]) : 0;
}

mp_pool *mp_torch_registered(int device) {
    mp_torch_entry *e = valid_device(device) ? LOAD(slots[device].entry) : NULL;
    return e ? e->pool : NULL;
}

int64_t mp_torch_live_blocks(int device) {
    if (!valid_device(device)) return 0;
    mp_torch_slot *s = &slots[device];
    mp_pool *p = slot_enter(s);
    if (!p) return 0;
    /* The slot cannot change while entered: its entry is the pool's. */
    int64_t n = mp_tally_blocks(p, &LOAD(s->entry)->tally);
    slot_exit(s);
    return n;
}

uint64_t mp_torch_failed_allocs(int device) {
    return valid_device(device) ? LOAD(slots[device].failed) : 0;
}

int mp_alloc_torch(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_torch_entry *e = LOAD(entries);
    while (e && e->pool != p) e = e->older;
    if (!e) return MP_ERETIRED;   /* never in the table */
    return mp_alloc_tallied(p, nbytes, stream, &e->tally, out);
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
    uintptr_t ptr = 0;
    mp_pool *p;
    int rc;
    for (;;) {
        mp_torch_entry *e = LOAD(s->entry);
        if (!e) return refuse_unrouted(size, device);
        rc = mp_alloc_tallied(e->pool, (size_t)size, (uintptr_t)stream, &e->tally, &ptr);
        if (rc != MP_ERETIRED) break;
        sched_yield();   /* retired since it was read: the change swaps the slot next */
    }
    if (rc == MP_OK) {
        mp_assert(ptr != 0);
        return (void *)ptr;
    }
    ADD(s->failed, 1);
    p = slot_enter(s);   /* the failed allocation no longer pins the pool */
    if (!p) return NULL;
    size_t reserved = mp_reserved_bytes(p), used = mp_used_bytes(p);
    slot_exit(s);
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
    /* The block's own count pins the pool (Note above). */
    mp_torch_entry *e = LOAD(slots[device].entry);
    if (e) (void)mp_free(e->pool, (uintptr_t)ptr, 0, 0);   /* a stranger's pointer is ignored */
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
    mp_assert(fraction == fraction);
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

/* ---- the table's data path (Note [Torch allocator glue]; the rest is mp_torch_api.c) ------ */

int mp_torch_table_alloc(int device, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    if (!valid_device(device)) return MP_EINVAL;
    mp_torch_slot *s = &slots[device];
    for (;;) {
        mp_torch_entry *e = LOAD(s->entry);
        if (!e) return MP_EINVAL;
        int rc = mp_alloc_tallied(e->pool, nbytes, stream, &e->tally, out);
        if (rc != MP_ERETIRED) {
            if (rc != MP_OK) ADD(s->failed, 1);
            return rc;
        }
        sched_yield();   /* retired since it was read: the change swaps the slot next */
    }
}

void mp_torch_table_free(int device, uintptr_t ptr) {
    if (!ptr || !valid_device(device)) return;
    mp_torch_entry *e = LOAD(slots[device].entry);   /* the block's own count pins the pool */
    if (e) (void)mp_free(e->pool, ptr, 0, 0);
}

int mp_torch_find_device(uintptr_t ptr) {
    int top = LOAD(max_device);
    for (int d = 0; d <= top; d++) {
        mp_torch_slot *s = &slots[d];
        mp_pool *p = slot_enter(s);
        if (!p) continue;
        size_t nbytes, requested;
        uintptr_t stream;
        int rc = mp_block_info(p, ptr, &nbytes, &requested, &stream);
        slot_exit(s);
        if (rc == MP_OK) return d;
    }
    return -1;
}

/* The device a pool is routed from. Entries are never freed (Note [Torch table lifetime]),
 * so a stale one read here is still memory of ours; called for segment events, which the
 * glue records only while history is on or a trace tracker is attached. */
int mp_torch_pool_device(const mp_pool *p) {
    if (!p) return -1;
    int top = LOAD(max_device);
    for (int d = 0; d <= top && d < MP_TORCH_MAX_DEVICES; d++) {
        mp_torch_entry *e = LOAD(slots[d].entry);
        if (e && e->pool == p) return d;
    }
    return -1;
}

/* ---- the slots for the table's other functions (mp_torch_internal.h) --------------------- */

mp_pool *mp_torch_enter(int device) {
    return valid_device(device) ? slot_enter(&slots[device]) : NULL;
}

void mp_torch_exit(int device) { slot_exit(&slots[device]); }
