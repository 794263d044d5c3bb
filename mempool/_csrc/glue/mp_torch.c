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
 * looked up. The gain: the entry points pay the pool's lock and nothing else (the atomic
 * adds this replaced cost a fifth of a pair; figures in bench/results/history.md).
 */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "mp_assert.h"
#include "mp_cuda.h"
#include "mp_torch.h"

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

static int valid_device(int device) { return device >= 0 && device < MP_TORCH_MAX_DEVICES; }

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

/* ---- the table of the C++ allocator (Note [Torch allocator glue]) ------------------------ */

static int api_alloc(int device, size_t nbytes, uintptr_t stream, uintptr_t *out) {
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

static void api_free(int device, uintptr_t ptr) {
    if (!ptr || !valid_device(device)) return;
    mp_torch_entry *e = LOAD(slots[device].entry);   /* the block's own count pins the pool */
    if (e) (void)mp_free(e->pool, ptr, 0, 0);
}

static int api_find_device(uintptr_t ptr) {
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

/* Run the body (the arguments after the device: a block with commas is several) with the
 * device's pool `p` entered (Note [Torch table lifetime]). */
#define WITH_SLOT(device, ...)                            \
    do {                                                  \
        if (!valid_device(device)) return MP_EINVAL;      \
        mp_torch_slot *s_ = &slots[device];               \
        mp_pool *p = slot_enter(s_);                      \
        if (!p) return MP_EINVAL;                         \
        __VA_ARGS__;                                      \
        slot_exit(s_);                                    \
    } while (0)

static int api_record_stream(int device, uintptr_t ptr, uintptr_t stream) {
    int rc;
    WITH_SLOT(device, rc = mp_record_stream(p, ptr, stream));
    return rc;
}

static int api_block_info(int device, uintptr_t ptr, size_t *nbytes, size_t *requested,
                          uintptr_t *stream) {
    int rc;
    WITH_SLOT(device, rc = mp_block_info(p, ptr, nbytes, requested, stream));
    return rc;
}

static int api_base_allocation(int device, uintptr_t ptr, uintptr_t *base, size_t *nbytes) {
    size_t requested;
    uintptr_t stream;
    /* Each block is its own base: the core may split a segment between blocks of
     * different streams, and PyTorch uses the base only to share or to offset within it. */
    int rc = api_block_info(device, ptr, nbytes, &requested, &stream);
    if (rc == MP_OK) *base = ptr;
    return rc;
}

static int api_stats(int device, mp_stats *out) {
    WITH_SLOT(device, mp_get_stats(p, out));
    return MP_OK;
}

static int api_reset_peak_stats(int device) {
    WITH_SLOT(device, mp_reset_peak_stats(p));
    return MP_OK;
}

static int api_reset_accumulated_stats(int device) {
    WITH_SLOT(device, mp_reset_accumulated_stats(p));
    return MP_OK;
}

/* torch.cuda.empty_cache(): the idle segments released, and given back to the device so
 * that it shows them free (Note [Giving back to the device]; skipped during a capture). */
static int api_empty_cache(int device) {
    int rc;
    WITH_SLOT(device, {
        rc = mp_empty_cache(p);
        if (rc == MP_OK) {
            int given = mp_give_back(p, 0);
            if (given != MP_EBUSY) rc = given;
        }
    });
    return rc;
}

static int api_memory_figures(int device, size_t figures[MP_TORCH_FIGURES]) {
    WITH_SLOT(device, {
        figures[0] = mp_reserved_bytes(p);
        figures[1] = mp_used_bytes(p);
        figures[2] = mp_cached_bytes(p);
        figures[3] = mp_largest_free_block(p);
        figures[4] = mp_pool_config(p)->limit;
        figures[5] = mp_capacity(p);
        figures[6] = mp_pool_config(p)->max_split_size;
    });
    return MP_OK;
}

static int api_set_limit(int device, size_t limit) {
    int rc;
    WITH_SLOT(device, rc = mp_set_limit(p, limit));
    return rc;
}

static int api_mem_info(int device, size_t *free_bytes, size_t *total_bytes) {
    int rc;
    WITH_SLOT(device, {
        mp_upstream *up = mp_pool_upstream(p);
        rc = up->mem_info ? up->mem_info(up->ctx, free_bytes, total_bytes) : MP_EUNSUPPORTED;
    });
    return rc;
}

static int api_layout(int device, mp_layout *out) {
    int rc;
    WITH_SLOT(device, rc = mp_layout_take(p, out));
    return rc;
}

static int api_enable_peer_access(int owner_device, int peer_device) {
    int rc;
    char err[256];
    WITH_SLOT(owner_device, {
        mp_upstream *up = mp_pool_upstream(p);
        rc = mp_cuda_owns(up) ? mp_cuda_enable_peer_access(up, peer_device, err, sizeof err)
                              : MP_EUNSUPPORTED;
    });
    return rc;
}

static int api_capture_begin(int device) {
    int rc;
    WITH_SLOT(device, rc = mp_capture_begin(p));
    return rc;
}

static int api_capture_end(int device) {
    int rc;
    WITH_SLOT(device, rc = mp_capture_end(p));
    return rc;
}

void mp_torch_private_config(const mp_config *device_cfg, mp_config *out) {
    /* The device pool's size policy; nothing given back on its own (Note [Keep idle]: a
     * graph's memory must stay where the graph recorded it while the graph lives), and no
     * stream waits to take another stream's blocks: a private pool serves its graph's
     * streams. */
    *out = *device_cfg;
    out->release_threshold = MP_UNLIMITED;
    out->limit = MP_UNLIMITED;
    out->initial_pool_size = 0;
    out->gc_threshold = 0.0;
    out->expandable_segments = 0;
    out->cross_stream_reuse = 0;
    out->keep_idle = 1;
    /* Plain segments: theirs come from cuMemAlloc, not the cudaMemPool whose chunk the
     * device pool's rounding follows (Note [Segment rounding]), so a rounding would only
     * make a graph's pool hold more. */
    out->segment_round = 0;
}

/* Note [Private pools follow the size policy]
 * PyTorch's allocator reads roundup_power2_divisions and max_split_size from one config at
 * every request, its CUDA graphs' and MemPools' private pools included, so a runtime
 * torch.cuda.memory._set_allocator_settings changes them all at once. A private pool here is
 * a core pool of its own that takes the device pool's size policy when it is made
 * (mp_torch_private_config). So the live ones are listed per device, and
 * mp_torch_follow_size_policy gives them the device pool's policy, and its capture reuse (Note
 * [Capture reuse], core/mp_stream.c), again once it changed (the
 * Python side calls it after Pool.set_size_policy on a registered pool). Their collection
 * threshold stays 0: a private pool gives nothing back on its own (Note [Keep idle]).
 * privates_lock guards the list and is taken before any pool's lock; a pool leaves the list
 * before the table's pool_release drops the glue's reference. */
typedef struct private_entry {
    mp_pool *pool;
    int device;
    struct private_entry *next;
} private_entry;

static private_entry *privates;
static pthread_mutex_t privates_lock = PTHREAD_MUTEX_INITIALIZER;

int mp_torch_private_track(int device, mp_pool *p) {
    if (!valid_device(device) || !p) return MP_EINVAL;
    private_entry *e = malloc(sizeof *e);
    if (!e) return MP_ENOMEM;
    e->pool = p;
    e->device = device;
    pthread_mutex_lock(&privates_lock);
    e->next = privates;
    privates = e;
    pthread_mutex_unlock(&privates_lock);
    return MP_OK;
}

/* Untrack p (if it was tracked) and drop a reference: the table's pool_release. */
void mp_torch_private_release(mp_pool *p) {
    pthread_mutex_lock(&privates_lock);
    for (private_entry **at = &privates; *at; at = &(*at)->next) {
        if ((*at)->pool == p) {
            private_entry *gone = *at;
            *at = gone->next;
            free(gone);
            break;
        }
    }
    pthread_mutex_unlock(&privates_lock);
    mp_pool_release(p);
}

int mp_torch_follow_size_policy(int device) {
    mp_config cfg;
    WITH_SLOT(device, cfg = *mp_pool_config(p));
    int rc = MP_OK;
    pthread_mutex_lock(&privates_lock);
    for (private_entry *e = privates; e; e = e->next) {
        if (e->device != device) continue;
        /* The device pool's split limit is unlimited when its segments are expandable (as
         * PyTorch ignores the limit there), so its private pools get none then either. */
        int r = mp_set_size_policy(e->pool, cfg.roundup_divisions, cfg.max_split_size, 0.0);
        if (r != MP_OK) rc = r;
        mp_set_capture_reuse(e->pool, cfg.capture_reuse);   /* Note [Capture reuse] */
    }
    pthread_mutex_unlock(&privates_lock);
    return rc;
}

/* A private pool of device pool p over upstream `up` (which it owns from the call on, made
 * or not). */
static int private_pool_over(int device, mp_pool *p, mp_upstream *up, mp_pool **out) {
    mp_config cfg;
    mp_torch_private_config(mp_pool_config(p), &cfg);
    int rc = mp_pool_create(&cfg, up, out);
    if (rc != MP_OK) {
        up->destroy(up->ctx);
        return rc;
    }
    /* Note [Shared limit]: PyTorch's memory fraction caps a device's graphs and MemPools
     * together with the rest of its memory; Note [Private pools follow the size policy]:
     * listed for a runtime change of the device's policy. */
    if ((rc = mp_share_limit(*out, p)) == MP_OK) rc = mp_torch_private_track(device, *out);
    if (rc != MP_OK) {
        mp_pool_release(*out);
        *out = NULL;
    }
    return rc;
}

static int api_private_pool_create(int device, mp_pool **out) {
    int rc;
    WITH_SLOT(device, {
        mp_upstream up;
        rc = mp_cuda_plain_upstream(mp_pool_upstream(p), &up);
        if (rc == MP_OK) rc = private_pool_over(device, p, &up, out);
    });
    return rc;
}

/* Note [Custom segment sources]
 * PyTorch's MemPool may be given its own allocator (torch.cuda.MemPool(
 * CUDAPluggableAllocator(...).allocator()), as NCCL's buffer registration does). PyTorch's
 * allocator asks that allocator for segments and caches them in the MemPool as it caches
 * cudaMalloc's: a freed tensor's block stays the MemPool's for its next request, and the
 * allocator's free is called only when the cache is emptied or the MemPool goes. Here such a
 * MemPool is a private pool like the others, whose upstream takes its segments from the
 * glue's source (segment_alloc / segment_free: the allocator's raw_alloc_with_stream and
 * raw_delete) and everything else (events, streams, captures) from the device's plain
 * upstream, or, where the device pool is not on cuda (sim, in the tests), from the device
 * pool's own upstream, borrowed: the private pool holds a reference to the device pool
 * (Note [Shared limit]), so it outlives it. A segment that is not 512-byte aligned, as the
 * core needs, is given back and the request fails with MP_EUPSTREAM. */
typedef struct {
    mp_upstream inner;
    int owns_inner;
    mp_segment_source src;
} custom_upstream;

static int cs_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    custom_upstream *c = ctx;
    uintptr_t ptr = 0;
    int rc = c->src.alloc(c->src.ctx, nbytes, stream, &ptr);
    if (rc != MP_OK) return rc == MP_ENOMEM ? MP_ENOMEM : MP_EUPSTREAM;
    if (!ptr || (ptr & 511)) {
        if (ptr) c->src.free(c->src.ctx, ptr, nbytes, stream);
        return MP_EUPSTREAM;
    }
    *out = ptr;
    return MP_OK;
}

static int cs_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    custom_upstream *c = ctx;
    c->src.free(c->src.ctx, ptr, nbytes, stream);
    return MP_OK;
}

static void cs_destroy(void *ctx) {
    custom_upstream *c = ctx;
    if (c->src.release) c->src.release(c->src.ctx);
    if (c->owns_inner) c->inner.destroy(c->inner.ctx);
    free(c);
}

#define CS_INNER(ctx) (&((custom_upstream *)(ctx))->inner)
static int cs_event_create(void *ctx, uintptr_t *out) {
    return CS_INNER(ctx)->event_create(CS_INNER(ctx)->ctx, out);
}
static int cs_event_record(void *ctx, uintptr_t e, uintptr_t s) {
    return CS_INNER(ctx)->event_record(CS_INNER(ctx)->ctx, e, s);
}
static int cs_event_query(void *ctx, uintptr_t e) {
    return CS_INNER(ctx)->event_query(CS_INNER(ctx)->ctx, e);
}
static int cs_stream_wait_event(void *ctx, uintptr_t s, uintptr_t e) {
    return CS_INNER(ctx)->stream_wait_event(CS_INNER(ctx)->ctx, s, e);
}
static int cs_event_destroy(void *ctx, uintptr_t e) {
    return CS_INNER(ctx)->event_destroy(CS_INNER(ctx)->ctx, e);
}
static int cs_stream_synchronize(void *ctx, uintptr_t s) {
    return CS_INNER(ctx)->stream_synchronize(CS_INNER(ctx)->ctx, s);
}
static int cs_stream_query(void *ctx, uintptr_t s) {
    return CS_INNER(ctx)->stream_query(CS_INNER(ctx)->ctx, s);
}
static int cs_device_synchronize(void *ctx) {
    return CS_INNER(ctx)->device_synchronize(CS_INNER(ctx)->ctx);
}
static int cs_stream_capturing(void *ctx, uintptr_t s, int *capturing) {
    return CS_INNER(ctx)->stream_capturing(CS_INNER(ctx)->ctx, s, capturing);
}
static int cs_capture_frontier(void *ctx, uintptr_t s, uint64_t *graph, uintptr_t *nodes,
                               size_t cap, size_t *n) {
    return CS_INNER(ctx)->capture_frontier(CS_INNER(ctx)->ctx, s, graph, nodes, cap, n);
}
static int cs_capture_follows(void *ctx, uintptr_t s, const uintptr_t *nodes, size_t n,
                              unsigned char *followed) {
    return CS_INNER(ctx)->capture_follows(CS_INNER(ctx)->ctx, s, nodes, n, followed);
}
static int cs_mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes) {
    return CS_INNER(ctx)->mem_info(CS_INNER(ctx)->ctx, free_bytes, total_bytes);
}

static int api_custom_pool_create(int device, const mp_segment_source *src, mp_pool **out) {
    if (!src || !src->alloc || !src->free || !out) return MP_EINVAL;
    int rc;
    WITH_SLOT(device, {
        custom_upstream *c = calloc(1, sizeof *c);
        rc = c ? mp_cuda_plain_upstream(mp_pool_upstream(p), &c->inner) : MP_ENOMEM;
        if (c && rc == MP_OK) {
            c->owns_inner = 1;
        } else if (c && rc == MP_EINVAL) {   /* not cuda: the device pool's own, borrowed */
            c->inner = *mp_pool_upstream(p);
            rc = MP_OK;
        }
        if (rc == MP_OK) {
            c->src = *src;
            const mp_upstream *in = &c->inner;
            mp_upstream up;
            memset(&up, 0, sizeof up);
            up.ctx = c;
            up.name = "custom";
            up.segment_alloc = cs_segment_alloc;
            up.segment_free = cs_segment_free;
            up.event_create = cs_event_create;
            up.event_record = cs_event_record;
            up.event_query = cs_event_query;
            up.stream_wait_event = cs_stream_wait_event;
            up.event_destroy = cs_event_destroy;
            up.stream_synchronize = cs_stream_synchronize;
            if (in->stream_query) up.stream_query = cs_stream_query;
            if (in->device_synchronize) up.device_synchronize = cs_device_synchronize;
            if (in->stream_capturing) up.stream_capturing = cs_stream_capturing;
            if (in->capture_frontier && in->capture_follows) {
                up.capture_frontier = cs_capture_frontier;
                up.capture_follows = cs_capture_follows;
            }
            up.mem_info = cs_mem_info;
            up.destroy = cs_destroy;
            /* The caller keeps the source until the pool is made and listed: a failure on
             * the way destroys the upstream without releasing it. */
            c->src.release = NULL;
            rc = private_pool_over(device, p, &up, out);
            if (rc == MP_OK) c->src.release = src->release;
        } else {
            free(c);
        }
    });
    return rc;
}

/* Note [Device peaks]
 * PyTorch's statistics are the device's: its pool and the private pools of its CUDA graphs
 * and MemPools together, with one peak each. Their sum would take each pool's peak at its
 * own moment (an upper bound); the device's true peak needs the device pool's peak between
 * two changes of the private pools, which is what the pool's peak windows give (Note [Peak
 * windows], mp_inspect.c). The glue reports every allocation and free of a private pool
 * (private_event, with the device's private pools as they are after it); each report closes
 * the device pool's window, adding to the device's peaks that window's peak plus what the
 * private pools held through it (`held`, as at the report before), and the moment after
 * the change. device_stats reads the open window the same way, so its peaks are exact when
 * every change was reported (the glue reports each). The figures belong to the pool
 * registered when they were taken: a new pool in the slot starts them again. */
typedef struct device_peaks {
    mp_pool *pool;                 /* the device pool the figures are of */
    int64_t peak[MP_NSTATS];       /* the device's peaks over closed windows */
    int64_t held[MP_NSTATS];       /* the private pools' current values at the last report */
} device_peaks;

static device_peaks peaks[MP_TORCH_MAX_DEVICES];
static pthread_mutex_t peaks_lock = PTHREAD_MUTEX_INITIALIZER;   /* guards `peaks` */

#define NCOUNTERS ((sizeof(mp_stats) - offsetof(mp_stats, num_alloc_retries)) / sizeof(uint64_t))

/* out += the current, allocated and freed figures and the counters of `in` (not its peaks). */
static void add_figures(mp_stats *out, const mp_stats *in) {
    mp_stat *o = (mp_stat *)out;
    const mp_stat *i = (const mp_stat *)in;
    for (size_t k = 0; k < MP_NSTATS; k++) {
        o[k].current += i[k].current;
        o[k].allocated += i[k].allocated;
        o[k].freed += i[k].freed;
    }
    uint64_t *oc = &out->num_alloc_retries;
    const uint64_t *ic = &in->num_alloc_retries;
    for (size_t k = 0; k < NCOUNTERS; k++) oc[k] += ic[k];
}

static void privates_sum(mp_pool *const *privates, size_t n, mp_stats *out) {
    memset(out, 0, sizeof *out);
    for (size_t k = 0; k < n; k++) {
        mp_stats s;
        mp_get_stats(privates[k], &s);
        add_figures(out, &s);
    }
}

static device_peaks *peaks_of_locked(int device, mp_pool *p) {
    device_peaks *d = &peaks[device];
    if (d->pool != p) {
        memset(d, 0, sizeof *d);
        d->pool = p;
    }
    return d;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

static int api_private_event(int device, mp_pool *const *privates, size_t n) {
    WITH_SLOT(device, {
        mp_stats w, held;
        pthread_mutex_lock(&peaks_lock);
        device_peaks *d = peaks_of_locked(device, p);
        privates_sum(privates, n, &held);
        mp_stats_window(p, &w, 1);
        const mp_stat *ws = (const mp_stat *)&w, *hs = (const mp_stat *)&held;
        for (size_t k = 0; k < MP_NSTATS; k++) {
            /* the window that ends here, then the moment after the change */
            d->peak[k] = max3(d->peak[k], ws[k].peak + d->held[k], ws[k].current + hs[k].current);
            d->held[k] = hs[k].current;
        }
        pthread_mutex_unlock(&peaks_lock);
    });
    return MP_OK;
}

static int api_device_stats(int device, mp_pool *const *privates, size_t n, mp_stats *out) {
    WITH_SLOT(device, {
        mp_stats held;
        pthread_mutex_lock(&peaks_lock);
        device_peaks *d = peaks_of_locked(device, p);
        privates_sum(privates, n, &held);
        mp_stats_window(p, out, 0);
        int64_t window_peak[MP_NSTATS];
        mp_stat *o = (mp_stat *)out;
        for (size_t k = 0; k < MP_NSTATS; k++) window_peak[k] = o[k].peak;
        add_figures(out, &held);
        for (size_t k = 0; k < MP_NSTATS; k++)
            o[k].peak = max3(d->peak[k], window_peak[k] + d->held[k], o[k].current);
        pthread_mutex_unlock(&peaks_lock);
    });
    return MP_OK;
}

static int api_device_reset_peak_stats(int device, mp_pool *const *privates, size_t n) {
    WITH_SLOT(device, {
        mp_stats w, held;
        pthread_mutex_lock(&peaks_lock);
        device_peaks *d = peaks_of_locked(device, p);
        mp_reset_peak_stats(p);
        for (size_t k = 0; k < n; k++) mp_reset_peak_stats(privates[k]);
        privates_sum(privates, n, &held);
        mp_stats_window(p, &w, 0);
        const mp_stat *ws = (const mp_stat *)&w, *hs = (const mp_stat *)&held;
        for (size_t k = 0; k < MP_NSTATS; k++) {
            d->held[k] = hs[k].current;
            d->peak[k] = ws[k].current + hs[k].current;
        }
        pthread_mutex_unlock(&peaks_lock);
    });
    return MP_OK;
}

/* The device a pool is routed from. Entries are never freed (Note [Torch table lifetime]),
 * so a stale one read here is still memory of ours; called for segment events, which the
 * glue records only while history is on or a trace tracker is attached. */
static int api_pool_device(const mp_pool *p) {
    if (!p) return -1;
    int top = LOAD(max_device);
    for (int d = 0; d <= top && d < MP_TORCH_MAX_DEVICES; d++) {
        mp_torch_entry *e = LOAD(slots[d].entry);
        if (e && e->pool == p) return d;
    }
    return -1;
}

static int api_config(int device, mp_config *out) {
    WITH_SLOT(device, *out = *mp_pool_config(p));
    return MP_OK;
}

static const mp_torch_api api = {
    .version = MP_TORCH_API_VERSION,
    .max_devices = MP_TORCH_MAX_DEVICES,
    .struct_size = sizeof(mp_torch_api),
    .alloc = api_alloc,
    .free = api_free,
    .find_device = api_find_device,
    .record_stream = api_record_stream,
    .base_allocation = api_base_allocation,
    .stats = api_stats,
    .reset_peak_stats = api_reset_peak_stats,
    .reset_accumulated_stats = api_reset_accumulated_stats,
    .empty_cache = api_empty_cache,
    .memory_figures = api_memory_figures,
    .set_limit = api_set_limit,
    .mem_info = api_mem_info,
    .layout = api_layout,
    .enable_peer_access = api_enable_peer_access,
    .capture_begin = api_capture_begin,
    .capture_end = api_capture_end,
    .private_pool_create = api_private_pool_create,
    .custom_pool_create = api_custom_pool_create,
    .pool_set_no_split = mp_set_no_split,
    .block_info = api_block_info,
    .pool_alloc = mp_alloc,
    .pool_free = mp_free,
    .pool_alloc_at = mp_alloc_at,
    .pool_record_stream = mp_record_stream,
    .pool_block_info = mp_block_info,
    .pool_stats = mp_get_stats,
    .pool_reset_peak_stats = mp_reset_peak_stats,
    .pool_reset_accumulated_stats = mp_reset_accumulated_stats,
    .pool_empty_cache = mp_empty_cache,
    .pool_used_bytes = mp_used_bytes,
    .pool_reserved_bytes = mp_reserved_bytes,
    .pool_largest_free_block = mp_largest_free_block,
    .pool_layout = mp_layout_take,
    .layout_free = mp_layout_free,
    .pool_release = mp_torch_private_release,   /* Note [Private pools follow the size policy] */
    .private_event = api_private_event,
    .device_stats = api_device_stats,
    .device_reset_peak_stats = api_device_reset_peak_stats,
    .set_segment_observer = mp_set_segment_observer,
    .pool_device = api_pool_device,
    .config = api_config,
    .set_release_observer = mp_set_release_observer,
};

const mp_torch_api *mp_torch_api_table(void) { return &api; }
