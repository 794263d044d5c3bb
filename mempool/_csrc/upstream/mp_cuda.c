/* The CUDA upstream (see mp_cuda.h): segments from a cudaMemPool, events, streams, and the
 * upstream's lifetime. Its other concerns have a file each: the driver's entry points
 * (mp_cuda_driver.c, Note [Context]), graph capture (mp_cuda_capture.c, Note [Capture
 * segments]), expandable segments (mp_cuda_vmm.c, Note [Expandable pages]), peer access
 * (mp_cuda_peers.c, Note [Peer access]) and sharing with other processes (mp_cuda_share.c,
 * Note [Sharing CUDA memory]).
 */
#include "mp_cuda_internal.h"

#include <stdlib.h>
#include <string.h>

static int cu_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_cuda *c = ctx;
    if (nbytes == 0 || !out) return MP_EINVAL;
    CUdeviceptr p = 0;
    CUresult r;
    if (cu_capturing(c, stream)) {
        int rc = cu_plain_alloc(c, nbytes, &p);
        if (rc != MP_OK) return rc;
        if (p & 511) {   /* see below; cuMemAlloc aligns to 256 bytes at least */
            cu_segment_free(c, (uintptr_t)p, nbytes, stream);
            return cu_fail(c, -1);
        }
        *out = (uintptr_t)p;
        return MP_OK;
    }
    if (c->pool)
        CU_CALL(c, r, mp_cu.MemAllocFromPoolAsync(&p, nbytes, c->pool, (CUstream)stream));
    else
        CU_CALL(c, r, mp_cu.MemAllocAsync(&p, nbytes, (CUstream)stream));
    int rc = cu_check(c, r);
    if (rc != MP_OK) return rc;
    if (p == 0 || (p & 511)) {
        /* The contract promises 512-byte aligned segments; the driver's pools have always
         * given more, but a silent misalignment would corrupt the core's arithmetic. */
        CU_CALL(c, r, mp_cu.MemFreeAsync(p, (CUstream)stream));
        return cu_fail(c, -1);
    }
    *out = (uintptr_t)p;
    return MP_OK;
}

int cu_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    mp_cuda *c = ctx;
    (void)nbytes;
    CUresult r;
    if (cu_plain_take(c, (CUdeviceptr)ptr))   /* Note [Capture segments] */
        CU_CALL(c, r, mp_cu.MemFree((CUdeviceptr)ptr));
    else
        CU_CALL(c, r, mp_cu.MemFreeAsync((CUdeviceptr)ptr, (CUstream)stream));
    return cu_check(c, r);
}

static int cu_event_create(void *ctx, uintptr_t *out) {
    mp_cuda *c = ctx;
    CUevent e = NULL;
    CUresult r;
    CU_CALL(c, r, mp_cu.EventCreate(&e, CU_EVENT_DISABLE_TIMING));
    int rc = cu_check(c, r);
    if (rc == MP_OK) *out = (uintptr_t)e;
    return rc;
}

static int cu_event_record(void *ctx, uintptr_t event, uintptr_t stream) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.EventRecord((CUevent)event, (CUstream)stream));
    return cu_check(c, r);
}

static int cu_event_query(void *ctx, uintptr_t event) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.EventQuery((CUevent)event));
    if (r == CUDA_ERROR_NOT_READY) return MP_ENOTREADY;
    return cu_check(c, r);
}

static int cu_stream_wait_event(void *ctx, uintptr_t stream, uintptr_t event) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.StreamWaitEvent((CUstream)stream, (CUevent)event, 0));
    return cu_check(c, r);
}

static int cu_event_destroy(void *ctx, uintptr_t event) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.EventDestroy((CUevent)event));
    return cu_check(c, r);
}

static int cu_stream_synchronize(void *ctx, uintptr_t stream) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.StreamSynchronize((CUstream)stream));
    return cu_check(c, r);
}

static int cu_stream_query(void *ctx, uintptr_t stream) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.StreamQuery((CUstream)stream));
    if (r == CUDA_ERROR_NOT_READY) return MP_ENOTREADY;
    return cu_check(c, r);
}

static int cu_device_synchronize(void *ctx) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, mp_cu.CtxSynchronize());
    return cu_check(c, r);
}

/* Note [Giving back to the device] (core/mp_release.c): the cudaMemPool keeps freed
 * segments (up to its release threshold, and until a sync even below it); trimming it to
 * `keep` returns the rest of what its completed frees left. Nothing to do without the
 * symbol (a driver before 11.2 has no cudaMemPool either). */
static int cu_trim(void *ctx, size_t keep) {
    mp_cuda *c = ctx;
    if (!mp_cu.MemPoolTrimTo) return MP_OK;
    CUmemoryPool pool = NULL;
    CUresult r;
    CU_CALL(c, r, cu_pool_of(c, &pool));
    if (r == CUDA_SUCCESS) CU_CALL(c, r, mp_cu.MemPoolTrimTo(pool, keep));
    return cu_check(c, r);
}

static int cu_mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes) {
    mp_cuda *c = ctx;
    size_t f = 0, t = 0;
    CUresult r;
    CU_CALL(c, r, mp_cu.MemGetInfo(&f, &t));
    int rc = cu_check(c, r);
    if (rc == MP_OK) {
        *free_bytes = f;
        *total_bytes = t;
    }
    return rc;
}

/* The cudaMemPool the segments come from (the device's current one when none was given). */
CUresult cu_pool_of(mp_cuda *c, CUmemoryPool *pool) {
    *pool = c->pool;
    if (*pool) return CUDA_SUCCESS;
    return mp_cu.DeviceGetMemPool ? mp_cu.DeviceGetMemPool(pool, c->dev) : CUDA_ERROR_INVALID_VALUE;
}

/* ---- Lifetime. ---- */

static void cu_destroy(void *ctx) {
    mp_cuda *c = ctx;
    cu_share_destroy(c);
    cu_vmm_destroy(c);
    free(c->plain);   /* the pool freed every segment before: none is left */
    pthread_mutex_destroy(&c->plain_lock);
    /* Frees still queued on streams are fine: the driver releases the pool's memory once
     * they complete. */
    if (c->pool && __atomic_load_n(&c->owns_pool, __ATOMIC_ACQUIRE)) {
        CUresult r;
        CU_CALL(c, r, mp_cu.MemPoolDestroy(c->pool));
        (void)r;  /* nothing to report to at teardown */
    }
    mp_cu.DevicePrimaryCtxRelease(c->dev);
    free(c);
}

int mp_cuda_last_error(const mp_upstream *up) {
    return __atomic_load_n(&((mp_cuda *)up->ctx)->last_error, __ATOMIC_RELAXED);
}

void mp_cuda_own_pool(mp_upstream *up) {
    __atomic_store_n(&((mp_cuda *)up->ctx)->owns_pool, 1, __ATOMIC_RELEASE);
}

void mp_cuda_bind_errors(mp_upstream *up) {
    __atomic_store_n(&((mp_cuda *)up->ctx)->error_slot, &up->last_error, __ATOMIC_RELEASE);
}

int mp_cuda_upstream(mp_upstream *up, int device, uintptr_t mempool_handle, char *err,
                     size_t errlen) {
    const char *why = cu_load();
    if (why) {
        cu_set_err(err, errlen, "%s", why);
        return MP_EUNSUPPORTED;
    }
    if (!up) {
        cu_set_err(err, errlen, "no upstream struct to fill");
        return MP_EINVAL;
    }
    CUresult r = mp_cu.Init(0);
    if (r != CUDA_SUCCESS) return cu_describe(err, errlen, "cuInit", r);
    int count = 0;
    r = mp_cu.DeviceGetCount(&count);
    if (r != CUDA_SUCCESS) return cu_describe(err, errlen, "cuDeviceGetCount", r);
    if (device < 0 || device >= count) {
        cu_set_err(err, errlen, "device must be a device ordinal in [0, %d), got %d", count,
                   device);
        return MP_EINVAL;
    }
    CUdevice dev;
    r = mp_cu.DeviceGet(&dev, device);
    if (r != CUDA_SUCCESS) return cu_describe(err, errlen, "cuDeviceGet", r);
    int pools = 0, vmm = 0;
    r = mp_cu.DeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev);
    if (r != CUDA_SUCCESS) return cu_describe(err, errlen, "cuDeviceGetAttribute", r);
    if (!pools) {
        cu_set_err(err, errlen, "device %d does not support stream-ordered memory pools", device);
        return MP_EUNSUPPORTED;
    }
    if (mp_cu.has_vmm &&
        mp_cu.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                             dev) != CUDA_SUCCESS)
        vmm = 0;

    mp_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        cu_set_err(err, errlen, "out of host memory");
        return MP_ENOMEM;
    }
    c->dev = dev;
    c->ordinal = device;
    c->pool = (CUmemoryPool)mempool_handle;
    c->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    c->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    c->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    c->prop.location.id = device;
    c->ndevices = count;
    c->access[0].location = c->prop.location;
    c->access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    c->naccess = 1;
    if (pthread_mutex_init(&c->vmm_lock, NULL) != 0) {
        free(c);
        cu_set_err(err, errlen, "could not initialise a mutex");
        return MP_ENOMEM;
    }
    if (pthread_mutex_init(&c->plain_lock, NULL) != 0) {
        pthread_mutex_destroy(&c->vmm_lock);
        free(c);
        cu_set_err(err, errlen, "could not initialise a mutex");
        return MP_ENOMEM;
    }
    if (cu_share_init(c) != MP_OK) {
        pthread_mutex_destroy(&c->plain_lock);
        pthread_mutex_destroy(&c->vmm_lock);
        free(c);
        cu_set_err(err, errlen, "could not initialise a mutex");
        return MP_ENOMEM;
    }
    r = mp_cu.DevicePrimaryCtxRetain(&c->ctx, dev);
    if (r != CUDA_SUCCESS) {
        cu_share_destroy(c);
        pthread_mutex_destroy(&c->plain_lock);
        pthread_mutex_destroy(&c->vmm_lock);
        free(c);
        return cu_describe(err, errlen, "cuDevicePrimaryCtxRetain", r);
    }
    if (vmm) {
        size_t g = 0;
        CUcontext prev;
        if (cu_ctx_enter(c, &prev) == CUDA_SUCCESS) {
            if (mp_cu.MemGetAllocationGranularity(&g, &c->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
                CUDA_SUCCESS)
                g = 0;
            cu_ctx_leave(prev);
        }
        /* The core aligns blocks to 512 bytes inside pages; any real granularity is a
         * multiple of that, but refuse anything that is not rather than misalign. */
        c->granularity = (g && g % 512 == 0) ? g : 0;
        c->driver_granularity = c->granularity;
    }

    memset(up, 0, sizeof *up);
    up->ctx = c;
    up->name = "cuda-pool";
    up->last_error = 0;
    up->segment_alloc = cu_segment_alloc;
    up->segment_free = cu_segment_free;
    up->event_create = cu_event_create;
    up->event_record = cu_event_record;
    up->event_query = cu_event_query;
    up->stream_wait_event = cu_stream_wait_event;
    up->event_destroy = cu_event_destroy;
    up->stream_synchronize = cu_stream_synchronize;
    up->stream_query = cu_stream_query;
    up->device_synchronize = cu_device_synchronize;
    up->trim = cu_trim;
    if (mp_cu.has_capture) up->stream_capturing = cu_stream_capturing;
    if ((mp_cu.StreamGetCaptureInfo3 || mp_cu.StreamGetCaptureInfo2) &&
        (mp_cu.GraphNodeGetDependencies2 || mp_cu.GraphNodeGetDependencies1)) {
        up->capture_frontier = cu_capture_frontier;   /* Note [Capture reuse] */
        up->capture_follows = cu_capture_follows;
    }
    up->mem_info = cu_mem_info;
    up->granularity = c->granularity;
    if (c->granularity) {
        up->va_reserve = cu_va_reserve;
        up->map = cu_map;
        up->unmap = cu_unmap;
        up->va_release = cu_va_release;
    }
    cu_share_install(c, up);
    up->destroy = cu_destroy;
    return MP_OK;
}

int mp_cuda_owns(const mp_upstream *up) { return up && up->destroy == cu_destroy; }
