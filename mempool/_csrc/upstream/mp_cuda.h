/* The CUDA upstream ("cuda-pool"): segments from a cudaMemPool_t through the driver's
 * stream-ordered allocator, events and stream waits, and expandable segments through the
 * driver's virtual-memory calls.
 *
 * Built without CUDA headers or libraries: the driver (libcuda.so.1) is opened at run time
 * and its entry points resolved once. Runtime and driver handles for pools, streams and
 * events are interchangeable, so the cudaMemPool_t and cudaStream_t values that CuPy,
 * PyTorch or JAX hand out are used here as they are.
 *
 * Stream handles: 0 = the legacy default stream, 1 = CU_STREAM_LEGACY, 2 =
 * CU_STREAM_PER_THREAD (the calling thread's default stream), anything else a CUstream.
 *
 * Threads: every function of the upstream may be called from any thread, without the GIL,
 * concurrently (the expandable-segment bookkeeping has its own mutex). Each call makes the
 * device's primary context current on the calling thread first; see "Note [Context]" in
 * mp_cuda_driver.c.
 */
#ifndef MP_CUDA_H
#define MP_CUDA_H

#include <stddef.h>
#include <stdint.h>

#include "mp_upstream.h"

/* Fill *up with the CUDA upstream of device ordinal `device`, allocating segments from the
 * cudaMemPool_t `mempool_handle` (0 = the device's current pool, through cuMemAllocAsync).
 * Retains the device's primary context until up->destroy. Expandable segments are offered
 * (up->granularity > 0) when the device supports virtual memory management.
 * Returns MP_OK, or an MP_E* code with a message in err (when errlen > 0) and *up untouched. */
int mp_cuda_upstream(mp_upstream *up, int device, uintptr_t mempool_handle, char *err,
                     size_t errlen);

/* 1 when libcuda.so.1 loads, cuInit(0) succeeds and at least one device is visible; else 0.
 * Never fails otherwise; safe to call at any time. */
int mp_cuda_available(void);

/* Note [Set-up during a capture] (mp_cuda_capture.c): put the calling thread in CUDA's relaxed
 * capture mode and return the mode to restore with mp_cuda_restore_capture_mode; -1 (nothing
 * changed) when the driver is not there, lacks capture support or refuses the exchange. */
int mp_cuda_relax_capture_mode(void);
/* Restore the mode mp_cuda_relax_capture_mode returned (-1: nothing to restore). */
void mp_cuda_restore_capture_mode(int mode);

/* The CUresult of the latest MP_EUPSTREAM failure of this upstream (0 when none), or -1 for
 * a failure the driver did not report (a segment the driver returned misaligned). `up` is
 * any copy of the struct mp_cuda_upstream filled. */
int mp_cuda_last_error(const mp_upstream *up);

/* Make the upstream also write its latest error into up->last_error, for the copy of the
 * struct at `up` (the pool keeps its own copy: pass mp_pool_upstream(pool)). The struct must
 * stay at that address until destroy. */
void mp_cuda_bind_errors(mp_upstream *up);

/* Hand the cudaMemPool_t to the upstream: destroy calls cuMemPoolDestroy on it. For a pool
 * the Pool created, whose lifetime ends with the C pool's last reference (which Python
 * does not see). Call on the struct mp_cuda_upstream filled, before or after it is copied. */
void mp_cuda_own_pool(mp_upstream *up);

/* "CUDA_ERROR_NAME: description" for a CUresult (or -1, see mp_cuda_last_error), into buf. */
void mp_cuda_error_string(int code, char *buf, size_t buflen);

/* ---- Peer access (see "Note [Peer access]" in mp_cuda_peers.c and docs/multigpu.md) ---- */

/* Let device ordinal `peer` read and write the upstream's memory: the cudaMemPool's (through
 * cuMemPoolSetAccess, which covers every allocation of the pool, made or to be made) and
 * every expandable-segment page, those mapped now and those mapped later. Idempotent.
 * Returns MP_OK; MP_EINVAL for a peer outside [0, device count) or the upstream's own
 * device; MP_EUNSUPPORTED when the peer cannot access this device's memory
 * (cuDeviceCanAccessPeer) or the driver lacks the calls; MP_EUPSTREAM on a driver failure.
 * On failure nothing changed, and a message is in err (when errlen > 0). */
int mp_cuda_enable_peer_access(mp_upstream *up, int peer, char *err, size_t errlen);

/* The peers enabled so far, ascending, into out[0 .. cap); returns how many there are. */
size_t mp_cuda_peer_devices(const mp_upstream *up, int *out, size_t cap);

/* In *mask, bit d set when device d may read and write all of [addr, addr + nbytes): from
 * cuMemGetAccess for expandable-segment pages (and'ed over the pages), else from
 * cuMemPoolGetAccess of the upstream's cudaMemPool. Devices from 64 on are not reported.
 * MP_EUNSUPPORTED when the driver lacks the calls; MP_EUPSTREAM on a driver failure, with a
 * message in err. */
int mp_cuda_access_mask(const mp_upstream *up, uintptr_t addr, size_t nbytes, uint64_t *mask,
                        char *err, size_t errlen);

/* Make the pages of expandable segments `page` bytes, the driver's allocation granularity
 * times a power of two (Note [Expandable pages]); call on the struct mp_cuda_upstream filled,
 * before it is copied and before any reservation. MP_EINVAL for any other size, MP_EUNSUPPORTED without virtual memory management, MP_EBUSY once address space
 * is reserved; `err` says which. */
int mp_cuda_set_page_size(mp_upstream *up, size_t page, char *err, size_t errlen);

/* ---- Sharing with other processes (Note [Sharing CUDA memory] in mp_cuda_share.c) ---- */

/* Say whether the upstream's memory will be shared with other processes; call on the struct
 * mp_cuda_upstream filled, before any segment or reservation. On: expandable pages are
 * created exportable (POSIX file descriptors; where cuMemCreate refuses that they are made
 * without, and sharing them is refused), and share serves; the cudaMemPool must have been
 * created with the POSIX file-descriptor handle type for its segments to be shared. Off (the
 * default): share refuses. Opening other processes' handles needs neither. MP_EINVAL when
 * `up` is no cuda upstream, MP_EBUSY once address space is reserved, MP_EUNSUPPORTED (on)
 * when the driver lacks the sharing entry points; mp_cuda_share_message says why. */
int mp_cuda_set_shareable(mp_upstream *up, int on);

/* Why the calling thread's latest share, open or mp_cuda_set_shareable of a cuda upstream
 * failed (empty when it did not), into buf. */
void mp_cuda_share_message(char *buf, size_t buflen);

/* 1 when `up` was made by mp_cuda_upstream (its ctx is this file's), else 0. */
int mp_cuda_owns(const mp_upstream *up);

/* A cuda upstream for the same device as `like` (a cuda upstream) whose segments are plain
 * cuMemAlloc allocations: legal while a stream captures a CUDA graph (stream-ordered
 * allocation there would become a node of the graph), released with cuMemFree (mp_cuda_capture.c). */
int mp_cuda_plain_upstream(const mp_upstream *like, mp_upstream *out);

#endif
