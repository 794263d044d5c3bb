/* Several simulated devices: a sim's device ordinal, peers granted access, and what each
 * device may reach (see mp_sim.h and docs/multigpu.md). */
#include "mp_sim_internal.h"

int mp_sim_set_device(mp_sim *s, int device) {
    if (device < 0 || device >= MP_SIM_MAX_DEVICES) return MP_EINVAL;
    pthread_mutex_lock(&s->mu);
    /* Addresses already handed out would lie outside the new device's window. */
    int rc = s->next_addr != MP_SIM_BASE + (uintptr_t)s->device * MP_SIM_DEVICE_SPAN
                 ? MP_EBUSY : MP_OK;
    if (rc == MP_OK) {
        s->device = device;
        s->peers &= ~((uint64_t)1 << device);
        s->next_addr = MP_SIM_BASE + (uintptr_t)device * MP_SIM_DEVICE_SPAN;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int mp_sim_device(mp_sim *s) { return s->device; }

int mp_sim_enable_peer(mp_sim *s, int peer) {
    if (peer < 0 || peer >= MP_SIM_MAX_DEVICES) return MP_EINVAL;
    pthread_mutex_lock(&s->mu);
    int rc = peer == s->device ? MP_EINVAL : MP_OK;
    if (rc == MP_OK && !(s->peers & (uint64_t)1 << peer)) {
        s->peers |= (uint64_t)1 << peer;
        /* Pages mapped so far get the peer too, as cuMemSetAccess over every mapped range. */
        for (size_t i = 0; i <= s->pages.mask; i++)
            if (s->pages.slots[i].key)
                s->pages.slots[i].value =
                    (void *)((uintptr_t)s->pages.slots[i].value | (uintptr_t)1 << peer);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

uint64_t mp_sim_peer_mask(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t m = s->peers;
    pthread_mutex_unlock(&s->mu);
    return m;
}

uint64_t mp_sim_access_mask(mp_sim *s, uintptr_t addr, size_t nbytes) {
    if (nbytes == 0) nbytes = 1;
    uint64_t mask = 0;
    pthread_mutex_lock(&s->mu);
    /* A segment: the whole device's access, as a cudaMemPool's setting covers all of it. */
    for (size_t i = 0; i <= s->segments.mask; i++) {
        uintptr_t p = s->segments.slots[i].key;
        size_t n = (size_t)(uintptr_t)s->segments.slots[i].value;
        if (p && addr >= p && addr - p < n && nbytes <= n - (addr - p)) {
            mask = sim_own_access(s);
            goto out;
        }
    }
    /* Expandable pages: each keeps what it was granted. */
    const size_t g = s->granularity;
    mask = ~(uint64_t)0;
    for (uintptr_t page = addr / g * g; page < addr + nbytes; page += g) {
        void *v = mp_ptrmap_get(&s->pages, page);
        mask &= (uint64_t)(uintptr_t)v;   /* an unmapped page makes the range inaccessible */
        if (!mask) break;
    }
out:
    pthread_mutex_unlock(&s->mu);
    return mask;
}
