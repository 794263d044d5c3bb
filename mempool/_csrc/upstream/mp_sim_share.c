/* The simulated device's side of sharing with other processes (mp_upstream.h's share, open
 * and close; Note [Sharing across processes] in core/mp_share.c).
 *
 * Note [Sim sharing]
 * The sim's memory is not memory, so sharing is a model of the protocol: the payload names
 * the sim that made it (a token drawn per sim) and the region (its address and size, which
 * serve as the allocation's serial: the sim's address bump never hands an address out twice,
 * so one sim's equal payloads always name the same memory). Open, in any process and any
 * sim, gives a fresh fake address of the region's size from the opening sim's bump, WITHOUT
 * taking its capacity (the memory is the producer's), and records it; close forgets it. A
 * share checks that the region is one of the sim's segments, or a run of whole physical
 * allocations of a reservation: what a driver would export. Tests read the opens through
 * mp_sim_open_imports.
 */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "mp_sim_internal.h"

#define SIM_PAYLOAD_LEN 24   /* token, base, bytes: u64 each, little-endian */

static void put64(unsigned char *at, uint64_t v) {
    for (int i = 0; i < 8; i++) at[i] = (unsigned char)(v >> (8 * i));
}
static uint64_t get64(const unsigned char *at) {
    uint64_t v = 0;
    for (int i = 0; i < 8; i++) v |= (uint64_t)at[i] << (8 * i);
    return v;
}

/* splitmix64 over the time, the process and the sim's address: a token that two sims (of
 * one process or two) do not share. */
static uint64_t draw_token(const mp_sim *s) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    uint64_t z = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^
                 ((uint64_t)getpid() << 17) ^ (uint64_t)(uintptr_t)s;
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* 1 when [base, base + nbytes) is what share may describe: a segment whole, or (expandable)
 * a run of whole physical allocations. */
static int shareable_region_locked(mp_sim *s, uintptr_t base, size_t nbytes, int expandable) {
    if (!expandable) return (size_t)(uintptr_t)mp_ptrmap_get(&s->segments, base) == nbytes;
    return nbytes && mp_mappings_whole(&s->mappings, base, nbytes);
}

static int sim_share(void *ctx, uintptr_t base, size_t nbytes, int expandable,
                     unsigned char *buf, size_t cap, size_t *len) {
    mp_sim *s = ctx;
    *len = SIM_PAYLOAD_LEN;
    pthread_mutex_lock(&s->mu);
    int ok = shareable_region_locked(s, base, nbytes, expandable);
    uint64_t token = s->share_token;
    pthread_mutex_unlock(&s->mu);
    if (!ok) {
        *len = 0;
        return MP_EINVAL;
    }
    if (cap < SIM_PAYLOAD_LEN || !buf) return MP_EINVAL;
    put64(buf, token);
    put64(buf + 8, base);
    put64(buf + 16, nbytes);
    return MP_OK;
}

static int sim_open(void *ctx, const unsigned char *buf, size_t len, size_t nbytes,
                    uintptr_t *out) {
    mp_sim *s = ctx;
    if (!buf || len != SIM_PAYLOAD_LEN || !out) return MP_EINVAL;
    uint64_t base = get64(buf + 8), size = get64(buf + 16);
    if (!get64(buf) || !base || size != nbytes || !nbytes || nbytes % 512) return MP_EINVAL;
    pthread_mutex_lock(&s->mu);
    /* A fresh address, as a mapping of another process's memory gets: from the bump, but
     * no capacity taken. */
    uintptr_t p = (s->next_addr + 511) / 512 * 512;
    int rc = mp_ptrmap_insert(&s->imports, p, (void *)(uintptr_t)nbytes);
    if (rc == MP_OK) {
        s->next_addr = p + nbytes;
        s->num_imports_opened++;
        *out = p;
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

static int sim_close(void *ctx, uintptr_t ptr, size_t nbytes) {
    mp_sim *s = ctx;
    pthread_mutex_lock(&s->mu);
    int rc = MP_OK;
    if ((size_t)(uintptr_t)mp_ptrmap_get(&s->imports, ptr) != nbytes) {
        s->num_errors++;
        rc = MP_EINVAL;
    } else {
        mp_ptrmap_remove(&s->imports, ptr);
    }
    pthread_mutex_unlock(&s->mu);
    return rc;
}

int sim_share_init(mp_sim *s, mp_upstream *up) {
    if (mp_ptrmap_init(&s->imports, 16) != MP_OK) return MP_ENOMEM;
    do s->share_token = draw_token(s); while (!s->share_token);
    up->share = sim_share;
    up->open = sim_open;
    up->close = sim_close;
    return MP_OK;
}

void sim_share_destroy(mp_sim *s) {
    if (s->imports.slots) mp_ptrmap_destroy(&s->imports);
}

size_t mp_sim_open_imports(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    size_t n = s->imports.count;
    pthread_mutex_unlock(&s->mu);
    return n;
}

uint64_t mp_sim_imports_opened(mp_sim *s) {
    pthread_mutex_lock(&s->mu);
    uint64_t n = s->num_imports_opened;
    pthread_mutex_unlock(&s->mu);
    return n;
}
