/* How the core knows that a CUDA graph capture is under way, so that it makes none of the
 * calls a capture refuses or that would break it (stream syncs and queries, event queries,
 * event waits across the capture's edge, segment frees and unmaps). Every function expects
 * the pool lock held unless its name says otherwise, and asks the upstream only when the
 * cheap answers do not settle it.
 *
 * Note [Graph capture]
 * While a stream captures a CUDA graph, its work is recorded, not run, and the driver
 * refuses what would need it run: a sync or query of the stream fails and invalidates the
 * capture; an event recorded on it becomes a graph node that can never be queried
 * (CUDA_ERROR_CAPTURED_EVENT); it may not wait on an event recorded outside the capture,
 * nor another stream on one recorded inside; a stream-ordered allocation or free on it
 * becomes a graph memory node, memory the graph owns, not the pool. In the global capture
 * mode (PyTorch's default) every thread is also refused the "unsafe" calls (syncs, queries,
 * cuMemFree, cuMemAlloc) while any capture runs. A caching pool makes all of these on its
 * slow paths.
 *
 * How the core knows: the upstream's optional stream_capturing (cuStreamIsCapturing; an
 * error counts as capturing, since skipping is always safe), asked only where the core is
 * about to make one of those calls, never on the free-list path; the stream last found
 * capturing is remembered (capture_seen) and asked again, so calls on other streams see
 * that capture too; and a counter, mp_capture_begin/mp_capture_end, for glue that knows of
 * captures the core cannot see (captures on streams the pool never involves, such as
 * PyTorch's around beginAllocateToPool/endAllocateToPool).
 *
 * What it does meanwhile, as PyTorch's caching allocator does: allocations are served from
 * the free lists as usual; a miss asks the upstream for a segment, which for a capturing
 * stream comes from outside the graph (cuda: plain cuMemAlloc in the thread's relaxed mode,
 * remembered and freed with cuMemFree, Note [Capture segments] in mp_cuda_capture.c; sim:
 * the same, counted in capture_allocs); expandable segments map pages as usual (PyTorch maps them for
 * its graph pools). Skipped: cross-stream reuse (its event would cross the capture's edge),
 * every release (idle segments, release threshold, garbage collection, beyond need, trim,
 * empty_cache, page unmaps), every sync of pending frees, the OOM retries; and above the
 * core, the Pool's trim of its cudaMemPool after empty_cache and trim, which synchronizes
 * the device (asked through mp_capture_known). Past the limit
 * or out of memory the allocation fails at once, and the error says a capture was under way
 * (mp_oom.capturing). A free with recorded streams stays pending with no events (PyTorch's
 * needs_events_deferred_until_no_capture); check_invariants accepts such blocks.
 * forget_stream of a capturing stream is refused. Once the capture is over, the next call
 * that finds none does what was skipped: the pending frees record their events, the
 * threshold releases; mp_capture_end of the last capture does both at once.
 *
 * Limits: a capture on a stream the call does not involve, made by another thread in the
 * global mode and not told through the counter, goes unseen until the pool finds it; and
 * the pool cannot be destroyed during a capture (it synchronizes the device). Memory freed
 * during a capture is free in the pool afterwards: a graph replayed later needs its blocks
 * kept live, or a pool of its own (PyTorch's private pools). The simulated device refuses,
 * counts (capture_violations) and lets break the capture every call the driver's global
 * mode refuses; tests/core/test_capture.py runs every kind of pressure on a capturing stream
 * with none. */

#ifndef MP_CAPTURE_H
#define MP_CAPTURE_H

#include "mp_internal.h"

/* 1 when stream handle `handle` captures now, or the upstream cannot tell (an error: the
 * safe answer, since skipping a release, a query or a reuse is always allowed). 0 without
 * an upstream stream_capturing. Needs no lock: the upstream is thread-safe. */
int mp_capture_handle(mp_pool *p, uintptr_t handle);

/* 1 when the pool was told of a capture (mp_capture_begin), stream s (may be NULL)
 * captures, or the stream last found capturing still does (p->capture_seen, which this
 * sets and clears). */
int mp_capture_stream_locked(mp_pool *p, mp_stream *s);

/* The same for the stream of the alloc or free that `rel` belongs to, asked of the
 * upstream once per call and kept in rel. */
int mp_capture_call_locked(mp_pool *p, mp_release_list *rel);

/* 1 when releasing idle segment `seg` now is unsafe: the call's capture (rel), or the
 * segment's stream or a stream owning one of its blocks captures (the release waits on
 * the owners and frees on the segment's stream). */
int mp_capture_segment_locked(mp_pool *p, mp_release_list *rel, mp_segment *seg);

/* 1 when the free of b, whose recorded streams (b->uses) need an event each, must wait for
 * the capture to end: the pool was told of one, or b's stream (the freeing one) or a
 * recorded stream captures. Such a free stays pending with no events (b->events == NULL)
 * until a later call finds no capture. */
int mp_capture_uses_locked(mp_pool *p, const mp_block *b);

#endif
