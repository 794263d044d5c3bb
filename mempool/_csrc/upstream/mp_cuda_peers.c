/* Peer access on the CUDA upstream: other devices granted this device's memory, the
 * cudaMemPool's and the expandable segments' pages alike.
 *
 * Note [Peer access]
 * Another device reaches this device's memory only where access was granted to it; without
 * it a kernel there faults. The two kinds of memory grant it differently:
 *   - cudaMemPool segments: cuMemPoolSetAccess on the pool, which covers every allocation of
 *     the pool, present and future, so it is set once per peer. The pool's setting is the
 *     driver's, shared with everyone allocating from the same pool ("default"/"current").
 *   - expandable segments: access is per mapping. cuMemSetAccess goes over every run of
 *     pages mapped now, and `access` (the device itself, then every peer) is what cu_map
 *     grants each range it maps later; both under vmm_lock, so no page is mapped between.
 * Enabling is all or nothing: the pages are granted first (their grants are ours alone and
 * revocable), the pool last; a failure revokes what was granted. Peer access is never
 * revoked otherwise: a pool's memory may be in use on the peer at any time.
 */
#include "mp_cuda_internal.h"

/* Apply `desc` to the first `limit` runs of mapped pages of every range, in order; *done
 * receives how many were applied. Caller holds vmm_lock and has the context current. */
static CUresult runs_set_access_locked(mp_cuda *c, const CUmemAccessDesc *desc, size_t limit,
                                       size_t *done) {
    const size_t g = c->granularity;
    size_t n = 0;
    CUresult e = CUDA_SUCCESS;
    for (size_t i = 0; i < c->nranges && e == CUDA_SUCCESS; i++) {
        mp_cuda_range *r = &c->ranges[i];
        size_t p = 0;
        while (p < r->npages && e == CUDA_SUCCESS) {
            if (!r->mapped[p]) {
                p++;
                continue;
            }
            size_t end = p;
            while (end < r->npages && r->mapped[end]) end++;
            if (n == limit) goto out;
            e = mp_cu.MemSetAccess(r->va + p * g, (end - p) * g, desc, 1);
            if (e == CUDA_SUCCESS) n++;
            p = end;
        }
    }
out:
    *done = n;
    return e;
}


int mp_cuda_enable_peer_access(mp_upstream *up, int peer, char *err, size_t errlen) {
    mp_cuda *c = up->ctx;
    if (peer < 0 || peer >= c->ndevices) {
        cu_set_err(err, errlen, "peer_device must be a device ordinal in [0, %d), got %d",
                c->ndevices, peer);
        return MP_EINVAL;
    }
    if (peer == c->ordinal) {
        cu_set_err(err, errlen, "peer_device %d is the pool's own device, which always has access",
                peer);
        return MP_EINVAL;
    }
    if (!mp_cu.DeviceCanAccessPeer || !mp_cu.MemPoolSetAccess ||
        (c->granularity && !mp_cu.MemSetAccess)) {
        cu_set_err(err, errlen,
                   "the CUDA driver lacks cuDeviceCanAccessPeer or cuMemPoolSetAccess");
        return MP_EUNSUPPORTED;
    }
    CUdevice peer_dev;
    int can = 0;
    CUresult e = mp_cu.DeviceGet(&peer_dev, peer);
    if (e == CUDA_SUCCESS) e = mp_cu.DeviceCanAccessPeer(&can, peer_dev, c->dev);
    if (e != CUDA_SUCCESS) return cu_describe(err, errlen, "cuDeviceCanAccessPeer", e);
    if (!can) {
        cu_set_err(err, errlen, "device %d cannot access the memory of device %d "
                "(cuDeviceCanAccessPeer: no peer path between them)", peer, c->ordinal);
        return MP_EUNSUPPORTED;
    }
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    for (size_t i = 1; i < c->naccess; i++)
        if (c->access[i].location.id == peer) goto out;   /* enabled already */
    if (c->naccess == MP_CUDA_MAX_ACCESS) {
        cu_set_err(err, errlen, "at most %d peer devices are supported", MP_CUDA_MAX_ACCESS - 1);
        rc = MP_EUNSUPPORTED;
        goto out;
    }
    CUmemAccessDesc grant = {{CU_MEM_LOCATION_TYPE_DEVICE, peer},
                             CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemAccessDesc revoke = {{CU_MEM_LOCATION_TYPE_DEVICE, peer}, CU_MEM_ACCESS_FLAGS_PROT_NONE};
    CUcontext prev;
    size_t granted = 0, undone = 0;
    const char *what = "cuCtxSetCurrent";
    e = cu_ctx_enter(c, &prev);
    if (e == CUDA_SUCCESS) {
        what = "cuMemSetAccess (expandable segments)";
        e = runs_set_access_locked(c, &grant, SIZE_MAX, &granted);
        if (e == CUDA_SUCCESS) {
            CUmemoryPool pool;
            what = "cuMemPoolSetAccess";
            e = cu_pool_of(c, &pool);
            if (e == CUDA_SUCCESS) e = mp_cu.MemPoolSetAccess(pool, &grant, 1);
        }
        if (e != CUDA_SUCCESS) runs_set_access_locked(c, &revoke, granted, &undone);
        cu_ctx_leave(prev);
    }
    if (e != CUDA_SUCCESS) {
        rc = cu_describe(err, errlen, what, e);
        goto out;
    }
    c->access[c->naccess++] = grant;
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

size_t mp_cuda_peer_devices(const mp_upstream *up, int *out, size_t cap) {
    mp_cuda *c = up->ctx;
    int peers[MP_CUDA_MAX_ACCESS];
    pthread_mutex_lock(&c->vmm_lock);
    size_t n = c->naccess - 1;
    for (size_t i = 0; i < n; i++) peers[i] = c->access[i + 1].location.id;
    pthread_mutex_unlock(&c->vmm_lock);
    for (size_t i = 1; i < n; i++)   /* a handful of entries: insertion sort */
        for (size_t j = i; j > 0 && peers[j - 1] > peers[j]; j--) {
            int t = peers[j];
            peers[j] = peers[j - 1];
            peers[j - 1] = t;
        }
    for (size_t i = 0; i < n && i < cap; i++) out[i] = peers[i];
    return n;
}

int mp_cuda_access_mask(const mp_upstream *up, uintptr_t addr, size_t nbytes, uint64_t *mask,
                        char *err, size_t errlen) {
    mp_cuda *c = up->ctx;
    const int ndev = c->ndevices < 64 ? c->ndevices : 64;
    if (nbytes == 0) nbytes = 1;
    uint64_t m = 0;
    int rc = MP_OK;
    CUresult e = CUDA_SUCCESS;
    const char *what = "cuCtxSetCurrent";
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = c->granularity ? cu_range_find_locked(c, addr, nbytes) : NULL;
    if (r ? !mp_cu.MemGetAccess : !mp_cu.MemPoolGetAccess) {
        cu_set_err(err, errlen, "the CUDA driver lacks %s",
                r ? "cuMemGetAccess" : "cuMemPoolGetAccess");
        rc = MP_EUNSUPPORTED;
        goto out;
    }
    CUcontext prev;
    e = cu_ctx_enter(c, &prev);
    if (e != CUDA_SUCCESS) goto out;
    if (r) {
        const size_t g = c->granularity;
        what = "cuMemGetAccess";
        m = ~(uint64_t)0;
        const size_t last = (addr + nbytes - 1 - r->va) / g;
        for (size_t p = (addr - r->va) / g; m && e == CUDA_SUCCESS && p <= last; p++) {
            if (!r->mapped[p]) {
                m = 0;   /* an unmapped page: nobody reaches all of the range */
                break;
            }
            for (int d = 0; d < ndev && e == CUDA_SUCCESS; d++) {
                unsigned long long flags = 0;
                CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, d};
                e = mp_cu.MemGetAccess(&flags, &loc, r->va + p * g);
                if (e == CUDA_SUCCESS && flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                    m &= ~((uint64_t)1 << d);
            }
        }
        if (ndev < 64) m &= ((uint64_t)1 << ndev) - 1;
    } else {
        CUmemoryPool pool;
        what = "cuMemPoolGetAccess";
        e = cu_pool_of(c, &pool);
        for (int d = 0; d < ndev && e == CUDA_SUCCESS; d++) {
            int flags = 0;
            CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, d};
            e = mp_cu.MemPoolGetAccess(&flags, pool, &loc);
            if (e == CUDA_SUCCESS && flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                m |= (uint64_t)1 << d;
        }
    }
    cu_ctx_leave(prev);
out:
    pthread_mutex_unlock(&c->vmm_lock);
    if (rc == MP_OK && e != CUDA_SUCCESS) rc = cu_describe(err, errlen, what, e);
    if (rc == MP_OK) *mask = m;
    return rc;
}
