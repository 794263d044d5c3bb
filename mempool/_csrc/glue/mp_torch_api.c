/* The table of the C++ PyTorch allocator (Note [Torch allocator glue], mp_torch.h): its
 * per-device functions, each on the device's pool entered as a rare entry point (Note [Torch
 * table lifetime], mp_torch.c), and the table itself.
 */
#include <stddef.h>
#include <string.h>

#include "mp_torch_internal.h"

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

static int api_memory_figures(int device, mp_torch_figures *out) {
    WITH_SLOT(device, {
        out->reserved = mp_reserved_bytes(p);
        out->used = mp_used_bytes(p);
        out->cached = mp_cached_bytes(p);
        out->largest_free_block = mp_largest_free_block(p);
        out->limit = mp_pool_config(p)->limit;
        out->capacity = mp_capacity(p);
        out->max_split_size = mp_pool_config(p)->max_split_size;
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
    WITH_SLOT(owner_device, rc = mp_pool_enable_peer_access(p, peer_device, err, sizeof err));
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


/* The record of the refusal: the thread's own when it is this one (taken where the pool's
 * fallback chain gave up), else a snapshot of the pool now (a refusal before the pool was
 * asked). */
static void oom_record(mp_pool *p, int code, size_t nbytes, uintptr_t stream, mp_oom *rec) {
    if (mp_oom_take(rec) != MP_OK || rec->pool != p || rec->nbytes != nbytes)
        mp_oom_snapshot(p, code, nbytes, stream, rec);
    rec->code = code;
}

static int api_oom_message(int device, mp_pool *private_pool, int code, size_t nbytes,
                           uintptr_t stream, mp_oom *rec, char *msg, size_t msglen) {
    if (private_pool) {   /* the glue holds it (pinned) while it reports */
        oom_record(private_pool, code, nbytes, stream, rec);
        mp_oom_message(private_pool, rec, "cuda", device, MP_OOM_WORDS_TORCH, msg, msglen);
        return MP_OK;
    }
    WITH_SLOT(device, {
        oom_record(p, code, nbytes, stream, rec);
        mp_oom_message(p, rec, "cuda", device, MP_OOM_WORDS_TORCH, msg, msglen);
    });
    return MP_OK;
}

static int api_share(int device, uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len,
                     size_t *offset) {
    int rc;
    WITH_SLOT(device, rc = mp_share(p, ptr, buf, cap, len, offset));
    return rc;
}

static int api_share_open(int device, const unsigned char *buf, size_t len, uintptr_t *base,
                          size_t *nbytes) {
    int rc;
    WITH_SLOT(device, rc = mp_share_open(p, buf, len, base, nbytes));
    return rc;
}

static int api_share_close(int device, uintptr_t base) {
    int rc;
    WITH_SLOT(device, rc = mp_share_close(p, base));
    return rc;
}

static int api_config(int device, mp_config *out) {
    WITH_SLOT(device, *out = *mp_pool_config(p));
    return MP_OK;
}

static const mp_torch_api api = {
    .version = MP_TORCH_API_VERSION,
    .max_devices = MP_TORCH_MAX_DEVICES,
    .struct_size = sizeof(mp_torch_api),
    .alloc = mp_torch_table_alloc,
    .free = mp_torch_table_free,
    .find_device = mp_torch_find_device,
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
    .private_pool_create = mp_torch_private_pool_create,
    .custom_pool_create = mp_torch_custom_pool_create,
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
    .private_event = mp_torch_private_event,
    .device_stats = mp_torch_device_stats,
    .device_reset_peak_stats = mp_torch_device_reset_peak_stats,
    .set_segment_observer = mp_set_segment_observer,
    .pool_device = mp_torch_pool_device,
    .config = api_config,
    .set_release_observer = mp_set_release_observer,
    .oom_message = api_oom_message,
    .share = api_share,
    .share_open = api_share_open,
    .share_close = api_share_close,
    .kind_switched = mp_torch_kind_switched_by_device,
    .companion_pool_create = mp_torch_companion_pool_create,
    .pool_share = mp_share,
    .pool_capture_begin = mp_capture_begin,
    .pool_capture_end = mp_capture_end,
};

const mp_torch_api *mp_torch_api_table(void) { return &api; }

