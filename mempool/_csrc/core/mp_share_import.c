/* A region opened from another pool's handle, held as the one block of a pool of its own.
 *
 * Note [Imported blocks]
 * A consumer's Buffer over another process's memory must be released as every Buffer is:
 * its holders (views, DLPack consumers, on any thread, without the GIL) share one
 * reference-counted block, and the last one frees it into its pool (mp_dlpack.c). So the
 * region gets a pool of its own, over an upstream whose one segment is the region (and whose
 * streams and events are the consumer pool's upstream's, so record_stream and the DLPack
 * stream hand-off work as on any block). When that pool goes with its last reference, its
 * upstream's destroy does the consumer's part of Note [The consumers' ledger]: it waits for
 * the device (work queued on the region has finished), gives the ledger hold back, closes
 * the region in the consumer's pool (mp_share_close: the mapping goes with its last open)
 * and drops its reference on that pool.
 */
#include <stdlib.h>
#include <string.h>

#include "mp_share.h"

typedef struct import_ctx {
    mp_pool *parent;        /* retained */
    mp_upstream *up;        /* the parent's upstream: its streams and events */
    uintptr_t base;
    size_t nbytes;
    int given;              /* the segment is handed out */
    mp_ledger *ledger;      /* NULL: no hold to give back */
    uint32_t slot;
    uint64_t gen;
} import_ctx;

static int imp_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    import_ctx *c = ctx;
    (void)stream;
    /* The one segment: the region. The core may round a request past the region's end
     * (a plain segment's rounding); its block is the region's size, and only that is used. */
    if (c->given || nbytes < c->nbytes) return MP_ENOMEM;
    c->given = 1;
    *out = c->base;
    return MP_OK;
}

static int imp_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    import_ctx *c = ctx;
    (void)ptr;
    (void)nbytes;
    (void)stream;
    c->given = 0;
    return MP_OK;
}

#define PASS(c) ((import_ctx *)(c))->up
static int imp_event_create(void *c, uintptr_t *out) { return PASS(c)->event_create(PASS(c)->ctx, out); }
static int imp_event_record(void *c, uintptr_t ev, uintptr_t s) { return PASS(c)->event_record(PASS(c)->ctx, ev, s); }
static int imp_event_query(void *c, uintptr_t ev) { return PASS(c)->event_query(PASS(c)->ctx, ev); }
static int imp_stream_wait_event(void *c, uintptr_t s, uintptr_t ev) { return PASS(c)->stream_wait_event(PASS(c)->ctx, s, ev); }
static int imp_event_destroy(void *c, uintptr_t ev) { return PASS(c)->event_destroy(PASS(c)->ctx, ev); }
static int imp_stream_synchronize(void *c, uintptr_t s) { return PASS(c)->stream_synchronize(PASS(c)->ctx, s); }
static int imp_stream_query(void *c, uintptr_t s) {
    return PASS(c)->stream_query ? PASS(c)->stream_query(PASS(c)->ctx, s) : MP_ENOTREADY;
}
static int imp_stream_capturing(void *c, uintptr_t s, int *capturing) {
    if (!PASS(c)->stream_capturing) {
        *capturing = 0;
        return MP_OK;
    }
    return PASS(c)->stream_capturing(PASS(c)->ctx, s, capturing);
}
static int imp_mem_info(void *c, size_t *free_bytes, size_t *total) {
    import_ctx *ic = c;
    *free_bytes = ic->given ? 0 : ic->nbytes;
    *total = ic->nbytes;
    return MP_OK;
}

static void imp_destroy(void *ctx) {
    import_ctx *c = ctx;
    mp_upstream *up = c->up;
    /* The consumer's work on the region has run before another process may reuse it. */
    if (up->device_synchronize) up->device_synchronize(up->ctx);
    if (c->ledger) {
        mp_ledger_leave(c->ledger, c->slot, c->gen);
        mp_ledger_detach(c->ledger);
    }
    mp_share_close(c->parent, c->base);
    mp_pool_release(c->parent);
    free(c);
}

int mp_share_import_pool(mp_pool *parent, uintptr_t base, size_t nbytes, mp_ledger *ledger,
                         uint32_t slot, uint64_t gen, mp_pool **out) {
    if (!base || !nbytes || nbytes > MP_MAX_ALLOC) return MP_EINVAL;
    import_ctx *c = calloc(1, sizeof *c);
    if (!c) return MP_ENOMEM;
    c->parent = parent;
    c->up = mp_pool_upstream(parent);
    c->base = base;
    c->nbytes = nbytes;
    mp_upstream up;
    memset(&up, 0, sizeof up);
    up.ctx = c;
    up.name = "import";
    up.segment_alloc = imp_segment_alloc;
    up.segment_free = imp_segment_free;
    up.event_create = imp_event_create;
    up.event_record = imp_event_record;
    up.event_query = imp_event_query;
    up.stream_wait_event = imp_stream_wait_event;
    up.event_destroy = imp_event_destroy;
    up.stream_synchronize = imp_stream_synchronize;
    up.stream_query = imp_stream_query;
    up.stream_capturing = imp_stream_capturing;
    up.mem_info = imp_mem_info;
    up.destroy = imp_destroy;
    mp_config cfg;
    mp_config_default(&cfg);
    mp_pool *p = NULL;
    int rc = mp_pool_create(&cfg, &up, &p);
    if (rc != MP_OK) {
        free(c);
        return rc;
    }
    /* From here the pool owns the open, the hold and a reference on the parent. */
    mp_pool_retain(parent);
    c->ledger = ledger;
    c->slot = slot;
    c->gen = gen;
    *out = p;
    return MP_OK;
}
