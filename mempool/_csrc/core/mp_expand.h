/* Expandable segments: one growing address range per (stream, small/large), mapped in pages
 * of the upstream's granularity as blocks need them, one physical allocation per growth. See
 * "Note [Expandable segments]" in mp_expand.c, "Note [Growth extents]" in mp_expand_range.c and
 * docs/expandable.md. */
#ifndef MP_EXPAND_H
#define MP_EXPAND_H

#include "mp_expand_mapper.h"
#include "mp_internal.h"

/* Find or make a free block of at least `size` for stream s: the free lists first, then
 * mapping more pages (after releasing free pages elsewhere when the limit, the garbage
 * collection threshold or the device require it), then waiting for pending frees. The
 * block returned is in no free list. May drop and retake the lock. */
int mp_expand_alloc_locked(mp_pool *p, mp_stream *s, int kind, size_t size,
                           mp_release_list *rel, mp_block **out);
/* Unmap whole free physical allocations (Note [Growth extents]), largest runs first, until
 * `target` bytes are released; the owner streams of those pages are synchronized first.
 * Drops and retakes the lock. Returns the bytes unmapped. */
size_t mp_expand_release_locked(mp_pool *p, size_t target);
/* The same without waiting: only pages whose owner streams have no work left now (a
 * stream_query each); *busy is set when pages stayed for a busy stream, and *unmaps (may be
 * NULL) counts the physical allocations unmapped. */
size_t mp_expand_release_idle_locked(mp_pool *p, size_t target, int *busy, uint64_t *unmaps);
/* initial_pool_size for an expandable pool: map that much (rounded up to pages) at the start
 * of stream 0's large segment and pin it there. Takes the lock. */
int mp_expand_reserve_initial(mp_pool *p, size_t nbytes);
/* Note [Forgotten streams]: detach every range that no stream grows any more and that has
 * nothing mapped, for mp_release_finish to give back. */
void mp_expand_drop_empty_locked(mp_pool *p, mp_release_list *out);
/* check_invariants: the extents of expandable segment seg tile its mapped blocks exactly
 * (Note [Growth extents]). 0 when they do, else 1 with the reason in why. */
int mp_expand_check_extents_locked(const mp_pool *p, const mp_segment *seg, char *why, size_t n);
/* Give a detached (or, at destroy, any) segment back to the upstream. Without the lock. */
void mp_segment_release_upstream(mp_pool *p, mp_segment *seg);
/* Note [Segment events at destroy] (mp_expand_range.c): the events of a segment freed by
 * destroy. */
void mp_trace_segment_gone_locked(mp_pool *p, const mp_segment *seg);

#endif
