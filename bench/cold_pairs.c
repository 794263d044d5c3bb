/* An allocate + free pair of the core after the caches were emptied (Note [Hot lines] in
 * mempool/_csrc/core/mp_internal.h), on the host upstream; built and run by cold_lines.py.
 *
 *   cold_pairs PAIRS NBYTES ROUNDS EVICT_BYTES
 *
 * Each round first runs 128 KiB of straight-line code and touches EVICT_BYTES of memory
 * (one byte a line), which pushes the pool's code and data out of the first-level caches
 * (and out of the second, and more, as EVICT_BYTES grows), then makes PAIRS (0 or 1) pairs
 * of NBYTES. Under cachegrind, the misses of a run with pairs less those of one without,
 * over ROUNDS, are the lines one cold pair touches. Run natively, it prints the median ns
 * of a cold pair (the timer's own cost subtracted) and of a warm one. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "mp_core.h"
#include "mp_upstream.h"

static volatile char *evict_buf;

__attribute__((noinline)) static void run_cold_code(void) {
    __asm__ volatile(".rept 131072\n nop\n .endr");
}

static void empty_caches(size_t evict_bytes) {
    run_cold_code();
    for (size_t i = 0; i < evict_bytes; i += 64) evict_buf[i]++;
}

static uint64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000000000u + (uint64_t)t.tv_nsec;
}

static int by_value(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static uint64_t median(uint64_t *v, size_t n) {
    qsort(v, n, sizeof *v, by_value);
    return v[n / 2];
}

int main(int argc, char **argv) {
    if (argc != 5) {
        fprintf(stderr, "usage: %s PAIRS NBYTES ROUNDS EVICT_BYTES\n", argv[0]);
        return 2;
    }
    int pairs = atoi(argv[1]);
    size_t nbytes = strtoull(argv[2], NULL, 0);
    size_t rounds = strtoull(argv[3], NULL, 0);
    size_t evict_bytes = strtoull(argv[4], NULL, 0);
    if (rounds == 0 || nbytes == 0) return 2;
    evict_buf = calloc(evict_bytes + 64, 1);
    uint64_t *cold = calloc(rounds, sizeof *cold), *timer = calloc(rounds, sizeof *timer);
    uint64_t *warm = calloc(rounds, sizeof *warm);
    mp_config cfg;
    mp_config_default(&cfg);
    mp_upstream up;
    mp_pool *p;
    if (!evict_buf || !cold || !timer || !warm) return 3;
    if (mp_host_upstream(&up, (size_t)8 << 30, (size_t)2 << 20) != MP_OK) return 3;
    if (mp_pool_create(&cfg, &up, &p) != MP_OK) return 3;
    uintptr_t out;
    for (int i = 0; i < 10; i++) {   /* the segment, and a hot block of the size */
        if (mp_alloc(p, nbytes, 0, &out) != MP_OK || mp_free(p, out, 0, 0) != MP_OK) return 4;
    }
    for (size_t r = 0; r < rounds; r++) {
        empty_caches(evict_bytes);
        uint64_t t0 = now_ns();
        timer[r] = now_ns() - t0;
        empty_caches(evict_bytes);
        t0 = now_ns();
        if (pairs && (mp_alloc(p, nbytes, 0, &out) != MP_OK || mp_free(p, out, 0, 0) != MP_OK))
            return 4;
        cold[r] = now_ns() - t0;
        t0 = now_ns();
        if (pairs && (mp_alloc(p, nbytes, 0, &out) != MP_OK || mp_free(p, out, 0, 0) != MP_OK))
            return 4;
        warm[r] = now_ns() - t0;
    }
    uint64_t t = median(timer, rounds);
    uint64_t c = median(cold, rounds), w = median(warm, rounds);
    printf("{\"cold_ns\": %lld, \"warm_ns\": %lld}\n", (long long)(c - (c > t ? t : c)),
           (long long)(w - (w > t ? t : w)));
    mp_pool_release(p);
    return 0;
}
