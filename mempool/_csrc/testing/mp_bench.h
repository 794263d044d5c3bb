/* A test and benchmark control, not part of the product: the testing layer, which may use
 * any layer and which no product code uses (docs/architecture.md).
 *
 * Compiled benchmark loops: allocate/free round trips timed inside C, so that the figure is
 * the allocator's own cost with no interpreter in the loop (see bench/README.md).
 *
 * Each loop returns the elapsed nanoseconds (CLOCK_MONOTONIC), at least 1, or 0 when any
 * call failed; it stops at the first failure. Nothing here needs the GIL.
 */
#ifndef MP_BENCH_H
#define MP_BENCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "mp_core.h"

/* n pairs of mp_alloc(nbytes, stream) + mp_free of the same block. n > 0. */
uint64_t mp_bench_core_roundtrips(mp_pool *p, size_t nbytes, size_t n, uintptr_t stream);

/* n steps of a mix with `live` blocks held: step k allocates sizes[k], then frees the block
 * held in ring[k % live] (if non-zero) and puts the new one there. The ring persists between
 * calls, so the caller can measure a steady state; it frees what is left in it. */
uint64_t mp_bench_core_mix(mp_pool *p, const uint64_t *sizes, size_t n, uint64_t *ring,
                           size_t live, uintptr_t stream);

/* The signatures of PyTorch's pluggable allocator (torch.cuda.memory.CUDAPluggableAllocator). */
typedef void *(*mp_bench_alloc_fn)(ssize_t size, int device, void *stream);
typedef void (*mp_bench_free_fn)(void *ptr, ssize_t size, int device, void *stream);

/* n pairs of alloc_fn(nbytes, device, stream) + free_fn(ptr, nbytes, device, stream), through
 * function pointers given as addresses. A NULL from alloc_fn counts as a failure. */
uint64_t mp_bench_fn_roundtrips(uintptr_t alloc_fn, uintptr_t free_fn, size_t nbytes, size_t n,
                                int device, uintptr_t stream);

/* libc malloc/free behind the pluggable-allocator signatures: a C reference point for the
 * function-pointer loop, and what lets that loop be exercised without a GPU. */
void *mp_bench_libc_alloc(ssize_t size, int device, void *stream);
void mp_bench_libc_free(void *ptr, ssize_t size, int device, void *stream);

#endif
