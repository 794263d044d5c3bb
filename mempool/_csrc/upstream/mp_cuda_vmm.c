/* Expandable segments on the CUDA upstream: address space reserved, and pages mapped and
 * unmapped in it, through the driver's virtual-memory calls.
 *
 * Note [Expandable pages]
 * Each map call is one physical allocation: one cuMemCreate of the whole range, one cuMemMap
 * and one cuMemSetAccess, however many pages it spans. The driver's cost follows the number
 * of physical allocations, not their bytes (bench/vmm_costs.py), and a physical allocation can
 * only be mapped and unmapped whole (cuMemMap at an offset into a larger handle is refused as
 * not supported, cuMemUnmap refuses part of a mapping), so the core remembers what each map
 * call covered and unmaps only whole ones (Note [Growth extents] in core/mp_expand_range.c); an
 * unmap may cover several, each unmapped and released in turn. The table per reservation
 * marks each mapped page as the head of its allocation (holding the handle) or a page after
 * it. The page, the unit of addresses and of growth, is the driver's granularity (2 MiB on
 * an H200) times a power of two through the pool's `granularity` option
 * (mp_cuda_set_page_size, before the first reservation). Access is granted per map call over
 * the whole range, for the device and its peers (Note [Peer access]). A shareable upstream
 * creates each allocation exportable, and keeps the descriptor of one exported until it is
 * unmapped (Note [Sharing CUDA memory], mp_cuda_share.c).
 */
#include "mp_cuda_internal.h"
#include "mp_fdpass.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

mp_cuda_range *cu_range_find_locked(mp_cuda *c, uintptr_t va, size_t nbytes) {
    for (size_t i = 0; i < c->nranges; i++) {
        mp_cuda_range *r = &c->ranges[i];
        if (va >= r->va && va - r->va <= r->nbytes && nbytes <= r->nbytes - (va - r->va))
            return r;
    }
    return NULL;
}

/* The pages of the physical allocation whose head is page `head` of r. */
static size_t allocation_pages(const mp_cuda_range *r, size_t head) {
    size_t end = head + 1;
    while (end < r->npages && r->mapped[end] == PAGE_REST) end++;
    return end - head;
}

/* Unmap and release the physical allocations that start in pages [first, first + n) of r
 * (whole ones: the caller checked). Returns the first failure; an allocation that failed
 * stays mapped. Caller holds vmm_lock and has the context current. */
static CUresult allocations_release_locked(mp_cuda *c, mp_cuda_range *r, size_t first, size_t n) {
    CUresult bad = CUDA_SUCCESS;
    for (size_t i = first; i < first + n; i++) {
        if (r->mapped[i] != PAGE_HEAD) continue;
        size_t k = allocation_pages(r, i);
        CUresult e = mp_cu.MemUnmap(r->va + i * c->granularity, k * c->granularity);
        if (e == CUDA_SUCCESS) e = mp_cu.MemRelease(r->handles[i]);
        if (e == CUDA_SUCCESS) {
            if (r->fds[i]) {   /* the export of it goes with it, withdrawn first */
                mp_fd_withdraw(r->fds[i] - 1);
                close(r->fds[i] - 1);
            }
            r->fds[i] = 0;
            memset(&r->mapped[i], PAGE_UNMAPPED, k);
            r->nmapped -= k;
        } else if (bad == CUDA_SUCCESS) {
            bad = e;
        }
    }
    return bad;
}

static int aligned_range(mp_cuda *c, uintptr_t va, size_t nbytes) {
    size_t g = c->granularity;
    return nbytes > 0 && va % g == 0 && nbytes % g == 0;
}

int cu_va_reserve(void *ctx, size_t nbytes, uintptr_t *out) {
    mp_cuda *c = ctx;
    if (nbytes == 0 || nbytes % c->granularity || !out) return MP_EINVAL;
    size_t npages = nbytes / c->granularity;
    /* calloc of large tables takes untouched zero pages: pages never mapped cost nothing. */
    CUmemGenericAllocationHandle *handles = calloc(npages, sizeof *handles);
    unsigned char *mapped = calloc(npages, 1), *shareable = calloc(npages, 1);
    int *fds = calloc(npages, sizeof *fds);
    uint64_t *serials = calloc(npages, sizeof *serials);
    if (!handles || !mapped || !shareable || !fds || !serials) {
        free(handles);
        free(mapped);
        free(shareable);
        free(fds);
        free(serials);
        return MP_ENOMEM;
    }
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    if (c->nranges == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 8;
        mp_cuda_range *grown = realloc(c->ranges, cap * sizeof *grown);
        if (!grown) {
            rc = MP_ENOMEM;
            goto out;
        }
        c->ranges = grown;
        c->cap = cap;
    }
    CUdeviceptr va = 0;
    CUresult r;
    int mode = cu_relaxed_enter();   /* a first growth may come during a capture */
    CU_CALL(c, r, mp_cu.MemAddressReserve(&va, nbytes, c->granularity, 0, 0));
    cu_relaxed_leave(mode);
    rc = cu_check(c, r);
    if (rc != MP_OK) goto out;
    c->ranges[c->nranges++] = (mp_cuda_range){
        .va = va, .nbytes = nbytes, .npages = npages, .nmapped = 0,
        .handles = handles, .mapped = mapped, .fds = fds, .serials = serials,
        .shareable = shareable,
    };
    handles = NULL;
    mapped = shareable = NULL;
    fds = NULL;
    serials = NULL;
    *out = (uintptr_t)va;
out:
    pthread_mutex_unlock(&c->vmm_lock);
    free(handles);
    free(mapped);
    free(shareable);
    free(fds);
    free(serials);
    return rc;
}

int cu_map(void *ctx, uintptr_t va, size_t nbytes) {
    mp_cuda *c = ctx;
    if (!aligned_range(c, va, nbytes)) return MP_EINVAL;
    const size_t g = c->granularity;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = cu_range_find_locked(c, va, nbytes);
    size_t first = r ? (va - r->va) / g : 0, n = nbytes / g;
    if (!r) {
        rc = MP_EINVAL;
        goto out;
    }
    for (size_t i = first; i < first + n; i++) {
        if (r->mapped[i]) {
            rc = MP_EINVAL;  /* the contract maps unmapped ranges only */
            goto out;
        }
    }
    CUcontext prev;
    int mode = cu_relaxed_enter();   /* growth maps pages during a capture too */
    CUresult e = cu_ctx_enter(c, &prev);
    CUmemGenericAllocationHandle h = 0;
    int created = 0, mapped = 0;
    CUmemAllocationProp prop = c->prop;
    prop.requestedHandleTypes = c->page_handle_types;
    /* One physical allocation for the whole range (Note [Expandable pages]). */
    if (e == CUDA_SUCCESS) created = (e = mp_cu.MemCreate(&h, nbytes, &prop, 0)) == CUDA_SUCCESS;
    if (e != CUDA_SUCCESS && e != CUDA_ERROR_OUT_OF_MEMORY &&
        prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE) {
        /* Note [Sharing CUDA memory]: a driver or device that refuses exportable pages
         * still gets its pages, unexportable; share says why. */
        c->page_share_refused = e;
        c->page_handle_types = prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
        created = (e = mp_cu.MemCreate(&h, nbytes, &prop, 0)) == CUDA_SUCCESS;
    }
    if (e == CUDA_SUCCESS) mapped = (e = mp_cu.MemMap(va, nbytes, 0, h, 0)) == CUDA_SUCCESS;
    if (e == CUDA_SUCCESS) e = mp_cu.MemSetAccess(va, nbytes, c->access, c->naccess);
    if (e == CUDA_SUCCESS) {
        r->handles[first] = h;
        r->serials[first] = ++c->page_serial;
        r->shareable[first] = prop.requestedHandleTypes != CU_MEM_HANDLE_TYPE_NONE;
        r->mapped[first] = PAGE_HEAD;
        memset(&r->mapped[first + 1], PAGE_REST, n - 1);
        r->nmapped += n;
    } else {   /* all or nothing */
        if (mapped) mp_cu.MemUnmap(va, nbytes);
        if (created) mp_cu.MemRelease(h);
    }
    cu_ctx_leave(prev);
    cu_relaxed_leave(mode);
    rc = cu_check(c, e);
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

int cu_unmap(void *ctx, uintptr_t va, size_t nbytes) {
    mp_cuda *c = ctx;
    if (!aligned_range(c, va, nbytes)) return MP_EINVAL;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = cu_range_find_locked(c, va, nbytes);
    size_t first = r ? (va - r->va) / c->granularity : 0, n = nbytes / c->granularity;
    if (!r) {
        rc = MP_EINVAL;
        goto out;
    }
    /* The contract unmaps whole physical allocations only, as the driver does: the range
     * starts at one's head, is mapped throughout, and the page after it starts another. */
    int whole = r->mapped[first] == PAGE_HEAD &&
                (first + n == r->npages || r->mapped[first + n] != PAGE_REST);
    for (size_t i = first; i < first + n && whole; i++) whole = r->mapped[i] != PAGE_UNMAPPED;
    if (!whole) {
        rc = MP_EINVAL;
        goto out;
    }
    CUresult e;
    CU_CALL(c, e, allocations_release_locked(c, r, first, n));
    rc = cu_check(c, e);
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

int cu_va_release(void *ctx, uintptr_t va, size_t nbytes) {
    mp_cuda *c = ctx;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    size_t i = 0;
    while (i < c->nranges && !(c->ranges[i].va == va && c->ranges[i].nbytes == nbytes)) i++;
    if (i == c->nranges) {
        rc = MP_EINVAL;  /* not a reservation of this upstream, or not the whole of one */
        goto out;
    }
    mp_cuda_range *r = &c->ranges[i];
    if (r->nmapped) {
        rc = MP_EBUSY;
        goto out;
    }
    CUresult e;
    CU_CALL(c, e, mp_cu.MemAddressFree(r->va, r->nbytes));
    rc = cu_check(c, e);
    if (rc != MP_OK) goto out;
    free(r->handles);
    free(r->mapped);
    free(r->shareable);
    free(r->fds);
    free(r->serials);
    c->ranges[i] = c->ranges[--c->nranges];
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

void cu_vmm_destroy(mp_cuda *c) {
    /* Whatever the pool left reserved goes too: at teardown a leak is worse than strictness. */
    CUcontext prev;
    if (c->nranges && cu_ctx_enter(c, &prev) == CUDA_SUCCESS) {
        for (size_t i = 0; i < c->nranges; i++) {
            mp_cuda_range *r = &c->ranges[i];
            allocations_release_locked(c, r, 0, r->npages);
            mp_cu.MemAddressFree(r->va, r->nbytes);
        }
        cu_ctx_leave(prev);
    }
    for (size_t i = 0; i < c->nranges; i++) {
        free(c->ranges[i].handles);
        free(c->ranges[i].mapped);
        free(c->ranges[i].shareable);
        free(c->ranges[i].fds);
        free(c->ranges[i].serials);
    }
    free(c->ranges);
    pthread_mutex_destroy(&c->vmm_lock);
}

int mp_cuda_set_page_size(mp_upstream *up, size_t page, char *err, size_t errlen) {
    if (!mp_cuda_owns(up)) {
        cu_set_err(err, errlen, "not an upstream made by mp_cuda_upstream");
        return MP_EINVAL;
    }
    mp_cuda *c = up->ctx;
    if (!c->driver_granularity) {
        cu_set_err(err, errlen, "device %d has no virtual memory management, so no expandable "
                "segments and no page size", c->ordinal);
        return MP_EUNSUPPORTED;
    }
    /* A power of two times the granularity: reservations are aligned to the page (the
     * core finds page edges by address), and the driver aligns them to powers of two. */
    size_t times = page / c->driver_granularity;
    if (page == 0 || page % c->driver_granularity || (times & (times - 1))) {
        cu_set_err(err, errlen, "a page must be the driver's allocation granularity on device %d "
                "(%zu bytes) times a power of two, got %zu", c->ordinal,
                c->driver_granularity, page);
        return MP_EINVAL;
    }
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    if (c->nranges) {
        cu_set_err(err, errlen, "the page size cannot change once address space is reserved");
        rc = MP_EBUSY;
    } else {
        c->granularity = page;
        up->granularity = page;
    }
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}
