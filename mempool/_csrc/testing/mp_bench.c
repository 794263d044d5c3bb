/* Compiled benchmark loops, a test and benchmark control (see mp_bench.h). */
#include "mp_bench.h"

#include <stdlib.h>
#include <time.h>

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* 0 is reserved for failure, so a run shorter than the clock's resolution reports 1. */
static uint64_t elapsed_since(uint64_t t0) {
    uint64_t dt = now_ns() - t0;
    return dt ? dt : 1;
}

uint64_t mp_bench_core_roundtrips(mp_pool *p, size_t nbytes, size_t n, uintptr_t stream) {
    if (p == NULL || n == 0) return 0;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        uintptr_t ptr;
        if (mp_alloc(p, nbytes, stream, &ptr) != MP_OK) return 0;
        if (mp_free(p, ptr, 0, 0) != MP_OK) return 0;
    }
    return elapsed_since(t0);
}

uint64_t mp_bench_core_mix(mp_pool *p, const uint64_t *sizes, size_t n, uint64_t *ring,
                           size_t live, uintptr_t stream) {
    if (p == NULL || sizes == NULL || ring == NULL || n == 0 || live == 0) return 0;
    uint64_t t0 = now_ns();
    for (size_t k = 0; k < n; k++) {
        uintptr_t ptr;
        size_t slot = k % live;
        if (mp_alloc(p, (size_t)sizes[k], stream, &ptr) != MP_OK) return 0;
        if (ring[slot] != 0 && mp_free(p, (uintptr_t)ring[slot], 0, 0) != MP_OK) {
            /* Keep the ring truthful for the caller's cleanup: the new block is live. */
            mp_free(p, ptr, 0, 0);
            return 0;
        }
        ring[slot] = (uint64_t)ptr;
    }
    return elapsed_since(t0);
}

uint64_t mp_bench_fn_roundtrips(uintptr_t alloc_fn, uintptr_t free_fn, size_t nbytes, size_t n,
                                int device, uintptr_t stream) {
    if (alloc_fn == 0 || free_fn == 0 || n == 0) return 0;
    mp_bench_alloc_fn alloc = (mp_bench_alloc_fn)alloc_fn;
    mp_bench_free_fn release = (mp_bench_free_fn)free_fn;
    void *s = (void *)stream;
    ssize_t size = (ssize_t)nbytes;
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n; i++) {
        void *ptr = alloc(size, device, s);
        if (ptr == NULL) return 0;
        release(ptr, size, device, s);
    }
    return elapsed_since(t0);
}

void *mp_bench_libc_alloc(ssize_t size, int device, void *stream) {
    (void)device;
    (void)stream;
    return size > 0 ? malloc((size_t)size) : NULL;
}

void mp_bench_libc_free(void *ptr, ssize_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream;
    free(ptr);
}
