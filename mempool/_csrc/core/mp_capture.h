/* Note [Graph capture] (docs/architecture.md): how the core knows that a CUDA graph capture
 * is under way, so that it makes none of the calls a capture refuses or that would break it
 * (stream syncs and queries, event queries, event waits across the capture's edge, segment
 * frees and unmaps). Every function expects the pool lock held unless its name says
 * otherwise, and asks the upstream only when the cheap answers do not settle it. */
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
