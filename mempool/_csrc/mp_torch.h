/* PyTorch's pluggable allocator over mempool pools: C-ABI entry points and the device table.
 *
 * torch.cuda.memory.CUDAPluggableAllocator loads the mempool extension (it is a shared
 * object like any other) and calls the mempool_torch_* functions below through plain C
 * function pointers, from any thread and without the GIL: the autograd engine allocates on
 * its own threads. Each call routes its device argument through a fixed table of pools
 * (mp_torch_register), so one allocator serves every GPU of the process.
 *
 * Signatures are those of torch/csrc/cuda/CUDAPluggableAllocator.h (torch 2.x): size_t and
 * ssize_t are the same width, cudaStream_t is a pointer.
 */
#ifndef MP_TORCH_H
#define MP_TORCH_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "mp_core.h"

#define MP_TORCH_MAX_DEVICES 64
#define MP_TORCH_API __attribute__((visibility("default")))

/* ---- the table (called from the Pool layer, with the GIL) ------------------------------- */

/* Route `device` to `p` (retained while registered). Re-registering the same pool is a
 * no-op. MP_EINVAL: device outside [0, MP_TORCH_MAX_DEVICES). MP_EBUSY: another pool is
 * registered there and torch still holds blocks of it (or is allocating from it). A pool
 * that was ever registered keeps its struct when destroyed (mp_torch.c). */
int mp_torch_register(int device, mp_pool *p);
/* Stop routing `device` (its pool's reference is dropped). MP_OK when nothing was
 * registered. MP_EBUSY while torch still holds blocks of the pool. */
int mp_torch_unregister(int device);
/* The pool routed to `device`, or NULL; borrowed (for checks, not for use). */
mp_pool *mp_torch_registered(int device);
/* Blocks handed to torch on `device` and not yet freed (with allocations in flight), and
 * allocations refused there. */
int64_t mp_torch_live_blocks(int device);
uint64_t mp_torch_failed_allocs(int device);

/* ---- the entry points (called by torch, without the GIL) -------------------------------- */

/* torch's alloc_fn. NULL for size 0, an unregistered device, or when the pool is out of
 * memory (for the last two one line on stderr says why: torch's pluggable allocator has no
 * other channel for the reason). An unregistered device never falls back to another
 * device's pool. */
MP_TORCH_API void *mempool_torch_alloc(ssize_t size, int device, void *stream);
/* torch's free_fn. Frees in stream order on the block's own stream; streams declared with
 * record_stream are waited for before reuse. Precondition (torch's own): ptr is NULL or a
 * block alloc returned and not yet freed; a NULL or unknown pointer is ignored, but only a
 * block torch holds pins the pool against a concurrent register/unregister (mp_torch.c). */
MP_TORCH_API void mempool_torch_free(void *ptr, ssize_t size, int device, void *stream);
/* set_record_stream_fn: Tensor.record_stream(s). torch passes no device, so the pointer is
 * looked up in each registered pool. */
MP_TORCH_API void mempool_torch_record_stream(void *ptr, void *stream);
/* set_reset_fn: torch.cuda.empty_cache() releases every registered pool's cached memory. */
MP_TORCH_API void mempool_torch_reset(void);
/* set_memory_fraction_fn: torch.cuda.set_per_process_memory_fraction(f, device) caps the
 * device's pool at f x its capacity. */
MP_TORCH_API void mempool_torch_memory_fraction(double fraction, int device);
/* set_base_alloc_fn: the allocation a pointer belongs to. Each block is its own base: ptr
 * itself, with *size set to the block's size (unchanged for an unknown pointer). */
MP_TORCH_API void *mempool_torch_base_alloc(void *ptr, size_t *size);

#endif
