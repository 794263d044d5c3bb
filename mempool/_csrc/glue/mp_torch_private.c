/* Private pools of the PyTorch glue (a CUDA graph's, a MemPool's): their configuration,
 * the list that follows the device pool's size policy, and the pools over a custom segment
 * source (Note [Torch allocator glue], mp_torch.h).
 */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "mp_torch_internal.h"

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
    if (!mp_torch_valid_device(device) || !p) return MP_EINVAL;
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
        int expandable = mp_pool_config(e->pool)->expandable_segments;
        int r = mp_set_size_policy(e->pool, cfg.roundup_divisions,
                                   expandable ? MP_UNLIMITED : cfg.max_split_size,
                                   expandable ? cfg.gc_threshold : 0.0);
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

int mp_torch_private_pool_create(int device, mp_pool **out) {
    int rc;
    WITH_SLOT(device, {
        mp_upstream up;
        rc = mp_pool_plain_upstream(p, &up);
        if (rc == MP_OK) rc = private_pool_over(device, p, &up, out);
    });
    return rc;
}

/* Note [Segment kind at run time]
 * torch.cuda.memory._set_allocator_settings("expandable_segments:True") switches PyTorch's
 * own allocator while a program runs: every later segment is of the new kind, and the
 * blocks already made stay where they are until freed (serving engines switch around
 * their weight loading; PyTorch's TestMemPool.test_mempool_expandable checks that one
 * snapshot then holds both kinds). A pool's kind is fixed when it is made: its segments are
 * a cudaMemPool's allocations or pages of reserved ranges. So while the setting asks for
 * the other kind (mp_torch_set_expandable; the table's kind_switched flag), the glue sends
 * the device's allocations to a companion pool of that kind, made on first use by
 * mp_torch_companion_pool_create: the device pool's configuration with the other kind (an
 * expandable companion takes no split limit, as PyTorch ignores it there), its limit
 * shared with the device pool's (Note [Shared limit]: the memory fraction caps both), its
 * size policy followed as a private pool's is (Note [Private pools follow the size policy];
 * an expandable one keeps the collection threshold too, since it gives memory back as the
 * device pool does), and its segments from the device pool's upstream, borrowed: the
 * companion holds a reference to the device pool, which so outlives it. Switching back
 * routes new allocations to the device pool again; the companion's blocks are found at
 * free as a private pool's are (torch_data_path.cpp), its statistics count in the device's,
 * its segments show in snapshots as the device's own, empty_cache empties it, and an
 * allocation one pool refuses for want of memory first empties the other's cache. */
static void borrowed_upstream_destroy(void *ctx) { (void)ctx; }

int mp_torch_companion_pool_create(int device, mp_pool **out) {
    if (!out) return MP_EINVAL;
    int rc;
    WITH_SLOT(device, {
        mp_config cfg = *mp_pool_config(p);
        cfg.expandable_segments = !cfg.expandable_segments;
        if (cfg.expandable_segments) {
            cfg.max_split_size = MP_UNLIMITED;
            cfg.segment_round = 0;
        }
        cfg.initial_pool_size = 0;
        cfg.limit = MP_UNLIMITED;   /* the device pool's limit caps both */
        mp_upstream up = *mp_pool_upstream(p);
        up.destroy = borrowed_upstream_destroy;
        rc = mp_pool_create(&cfg, &up, out);
        if (rc == MP_OK) {
            if ((rc = mp_share_limit(*out, p)) == MP_OK) rc = mp_torch_private_track(device, *out);
            if (rc != MP_OK) {
                mp_pool_release(*out);
                *out = NULL;
            }
        }
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

int mp_torch_custom_pool_create(int device, const mp_segment_source *src, mp_pool **out) {
    if (!src || !src->alloc || !src->free || !out) return MP_EINVAL;
    int rc;
    WITH_SLOT(device, {
        custom_upstream *c = calloc(1, sizeof *c);
        rc = c ? mp_pool_plain_upstream(p, &c->inner) : MP_ENOMEM;
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

