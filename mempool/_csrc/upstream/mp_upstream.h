/* The upstream contract: where a pool's segments, events and stream operations come from.
 *
 * One struct of function pointers plus a context pointer, in the manner of mimalloc's
 * primitive layer. Every function
 *   - returns an int error code: MP_OK (0) on success, an MP_E* code otherwise;
 *   - never raises, never calls into Python and never needs the GIL;
 *   - may be called from any thread and concurrently on the same context: the pool calls
 *     segment allocation and release, syncs and map/unmap with its lock dropped, and the
 *     DLPack hand-off makes event calls outside the pool lock (Note [Lock order], mp_core.c). The sim and host upstreams guard their state with a mutex; the
 *     CUDA driver is thread-safe.
 * Handles (pointers, streams, events, address ranges) are plain uintptr_t values.
 *
 * Implementations: mp_sim*.c (simulated device), mp_host.c (host memory), mp_cuda*.c
 * (cudaMemPool segments and CUDA virtual memory, resolved at run time from libcuda).
 */
#ifndef MP_UPSTREAM_H
#define MP_UPSTREAM_H

#include <stddef.h>
#include <stdint.h>

#include "mp_errors.h"   /* MP_OK and the MP_E* codes every function returns */

typedef struct mp_upstream {
    void *ctx;
    const char *name;       /* "sim", "host", "cuda-pool", "cuda-vmm" */
    int last_error;         /* the native error code of the last MP_EUPSTREAM, for messages */

    /* Allocate a segment of exactly nbytes (> 0, a multiple of 512) usable in stream order
     * on `stream`. On success *out is non-zero and 512-byte aligned. MP_ENOMEM when the
     * device is out of memory; nothing is allocated on failure. */
    int (*segment_alloc)(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out);
    /* Free a segment obtained from segment_alloc, in stream order on `stream`: work queued
     * on `stream` before this call may still use it. */
    int (*segment_free)(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream);

    /* Events: create one (disable-timing), record it on a stream, query it (MP_OK when
     * complete, MP_ENOTREADY when not), make a stream wait for it without blocking the
     * host, destroy it. */
    int (*event_create)(void *ctx, uintptr_t *out);
    int (*event_record)(void *ctx, uintptr_t event, uintptr_t stream);
    int (*event_query)(void *ctx, uintptr_t event);
    int (*stream_wait_event)(void *ctx, uintptr_t stream, uintptr_t event);
    int (*event_destroy)(void *ctx, uintptr_t event);

    /* Block the host until all work queued on `stream` has completed. */
    int (*stream_synchronize)(void *ctx, uintptr_t stream);
    /* Without blocking: MP_OK when all work queued on `stream` has completed, MP_ENOTREADY
     * when not (optional, may be NULL: then never known to be complete). */
    int (*stream_query)(void *ctx, uintptr_t stream);
    /* Block the host until all work on the device has completed (optional, may be NULL).
     * Needs no stream handle: the pool uses it at destroy, when streams it saw may be gone. */
    int (*device_synchronize)(void *ctx);
    /* Whether `stream` is capturing a CUDA graph now: *capturing = 1 or 0, MP_OK; an error
     * code when the upstream cannot tell (the core then takes the stream as capturing).
     * Optional, may be NULL: the upstream's streams never capture (host). Never itself
     * breaks a capture. While a stream captures, segment_alloc on it must give a segment
     * outside the graph (not a graph allocation node), and segment_free of that segment
     * must not be stream-ordered; the core makes no other call that a capture refuses
     * (Note [Graph capture], mp_capture.h). */
    int (*stream_capturing)(void *ctx, uintptr_t stream, int *capturing);
    /* Graph capture reuse (Note [Capture reuse], core/mp_stream.c); both optional, may be
     * NULL: then a free with recorded streams waits for the capture's end.
     * capture_frontier: the nodes that work queued next on capturing `stream` would depend
     * on (its capture's terminal nodes), their count in *n, at most `cap` of them written to
     * nodes[] (call again with more room when *n > cap), and an id of the capture in *graph.
     * MP_EINVAL when the stream does not capture. Never breaks the capture.
     * capture_follows: followed[i] = 1 when nodes[i] is `stream`'s frontier or one of its
     * ancestors in the graph, so that work queued next on it runs after it; else 0 (one
     * walk of the graph answers for all n). Never breaks the capture. */
    int (*capture_frontier)(void *ctx, uintptr_t stream, uint64_t *graph, uintptr_t *nodes,
                            size_t cap, size_t *n);
    int (*capture_follows)(void *ctx, uintptr_t stream, const uintptr_t *nodes, size_t n,
                           unsigned char *followed);

    /* Device memory: *free_bytes and *total_bytes as the device reports them. */
    int (*mem_info)(void *ctx, size_t *free_bytes, size_t *total_bytes);

    /* Optional: give the device back what the upstream still keeps of the segments freed to
     * it, down to `keep` bytes, of those whose frees have run (a cudaMemPool's
     * cuMemPoolTrimTo). NULL where nothing is kept once the frees' work has run (sim,
     * host). mp_give_back calls it after a device sync (Note [Giving back to the device],
     * core/mp_release.c). */
    int (*trim)(void *ctx, size_t keep);

    /* Expandable segments (all NULL, granularity 0, when unsupported).
     * va_reserve: reserve nbytes (a multiple of granularity) of address space, nothing mapped.
     * map: back [va, va + nbytes) (granularity-aligned, inside a reservation, unmapped) with
     *      one physical allocation readable and writable by the device; all or nothing: on
     *      failure nothing of the range stays mapped. MP_ENOMEM when the device is full.
     * unmap: release the physical memory of a mapped range made of whole allocations, one
     *      or several adjacent ones, each as one map call made it (a driver maps and unmaps
     *      physical allocations only whole): MP_EINVAL, nothing changed, when it would cut
     *      one. It does not wait for queued work: the caller synchronizes the streams that
     *      used the range first (Note [Growth extents] in core/mp_expand_range.c).
     * va_release: give back a reservation with nothing mapped in it. */
    size_t granularity;
    int (*va_reserve)(void *ctx, size_t nbytes, uintptr_t *out);
    int (*map)(void *ctx, uintptr_t va, size_t nbytes);
    int (*unmap)(void *ctx, uintptr_t va, size_t nbytes);
    int (*va_release)(void *ctx, uintptr_t va, size_t nbytes);

    /* Sharing with other processes (Note [Sharing across processes], core/mp_share.c). All
     * three NULL when the upstream cannot share; then the core answers MP_EUNSUPPORTED.
     * share: describe [base, base + nbytes) for another process: a segment whole (base and
     *   nbytes as segment_alloc gave them, expandable 0) or a run of mapped pages of a
     *   reservation made of whole physical allocations (expandable 1). At most cap bytes into
     *   buf, the length in *len; MP_EINVAL with *len set to the length needed when cap is too
     *   small. The bytes differ whenever the memory they name differs (a later segment at the
     *   same address included), and stay valid while the memory stays allocated (mapped) here.
     * open: map a description that share made, in another process or this one: *out is the
     *   start of nbytes (as shared) in this process. Each open is a mapping of its own, undone
     *   by close(out, nbytes); MP_EINVAL for bytes share did not make (never a crash).
     * close: undo an open; the sharing process's memory stays its own. */
    int (*share)(void *ctx, uintptr_t base, size_t nbytes, int expandable, unsigned char *buf,
                 size_t cap, size_t *len);
    int (*open)(void *ctx, const unsigned char *buf, size_t len, size_t nbytes, uintptr_t *out);
    int (*close)(void *ctx, uintptr_t ptr, size_t nbytes);

    /* Release the context. Called once, after every segment and event has been freed. */
    void (*destroy)(void *ctx);
} mp_upstream;

/* Constructors. Each fills *up and returns MP_OK, or an error code with *up untouched. */
int mp_sim_upstream(mp_upstream *up, size_t capacity, size_t granularity);
int mp_host_upstream(mp_upstream *up, size_t capacity, size_t granularity);
/* Back the host upstream's memory with memfds, so that other processes can map it (Note
 * [Host sharing], mp_host.c); only before its first allocation (MP_EBUSY after). */
int mp_host_set_shareable(mp_upstream *up, int on);

#endif
