/* Expandable segments' ranges (Note [Expandable segments] in mp_expand.c): a stream's range
 * found or reserved, blocks linked and merged in it, the physical allocations mapped in it
 * (its extents), and a range detached and given back. */
/* Note [Growth extents]
 * A driver's cost follows the number of physical allocations, not their bytes, and it maps
 * and unmaps a physical allocation only whole (cuMemMap at an offset into a larger one is
 * not supported, cuMemUnmap refuses part of a mapping). So a growth of N pages is one map
 * call, one physical allocation (cut into pieces of max_map_size, default
 * MP_DEFAULT_MAX_MAP, when larger). Each segment keeps its allocations ("extents") in address
 * order; they tile its mapped bytes exactly, so the edges between mapped and unmapped blocks
 * are extent edges. Every release unmaps only extents wholly inside a run of free blocks
 * (run_pages), from a run's high end, as few as cover what is wanted; the high-water rule
 * counts only those as idle. Blocks split and merge across extents freely. An extent being
 * mapped or unmapped is busy (inside the busy unmapped block), so check_invariants' tiling
 * holds while the lock is dropped. sim and host keep the driver's rule (mp_mappings_whole in
 * mp_budget.h): an unmap that cuts an allocation is refused.
 * Limits: a free page of an allocation that still holds a block cannot be released, and the
 * high-water rule finds fewer idle allocations whole. Under a limit, where giving back
 * matters most, a pool maps one allocation per page unless max_map_size is set. */
#include <stdlib.h>
#include <string.h>

#include "mp_capture.h"
#include "mp_expand_internal.h"

/* Fold unmapped neighbours that are not busy into u (unmapped, not busy); u may go. */
void ex_merge_unmapped_locked(mp_pool *p, mp_block *u) {
    mp_assert(u->state == MP_BLOCK_UNMAPPED && !u->busy);
    mp_block *n = u->next;
    if (n && n->state == MP_BLOCK_UNMAPPED && !n->busy) {
        u->nbytes += n->nbytes;
        u->next = n->next;
        if (n->next) n->next->prev = u;
        mp_block_delete_locked(p, n);
    }
    mp_block *q = u->prev;
    if (q && q->state == MP_BLOCK_UNMAPPED && !q->busy) {
        q->nbytes += u->nbytes;
        q->next = u->next;
        if (u->next) u->next->prev = q;
        mp_block_delete_locked(p, u);
    }
}

void ex_count_mapped_locked(mp_pool *p, mp_segment *seg, size_t nbytes, int mapped) {
    if (mapped) {
        seg->mapped_bytes += nbytes;
        mp_stat3_inc(p->stats.reserved_bytes, seg->kind, (int64_t)nbytes);
        mp_publish_held_locked(p);
        mp_stat_inc(&p->stats.mapped_bytes, (int64_t)nbytes);
        if ((size_t)p->stats.mapped_bytes.current > p->mapped_high_water)
            p->mapped_high_water = (size_t)p->stats.mapped_bytes.current;
    } else {
        mp_check(seg->mapped_bytes >= nbytes);   /* unmapping more than is mapped */
        seg->mapped_bytes -= nbytes;
        mp_stat3_dec(p->stats.reserved_bytes, seg->kind, (int64_t)nbytes);
        mp_publish_held_locked(p);
        mp_stat_dec(&p->stats.mapped_bytes, (int64_t)nbytes);
    }
}

/* Room for n more extents in seg; 0 (nothing changed) when out of host memory. */
int ex_extents_reserve(mp_segment *seg, size_t n) {
    if (seg->nextents + n <= seg->cap_extents) return 1;
    size_t cap = seg->cap_extents ? 2 * seg->cap_extents : 16;
    while (cap < seg->nextents + n) cap *= 2;
    mp_extent *grown = realloc(seg->extents, cap * sizeof *grown);
    if (!grown) return 0;
    seg->extents = grown;
    seg->cap_extents = cap;
    return 1;
}

/* The pieces of growth c at `at`, as busy extents, in room extents_reserve made. */
void ex_extents_insert(mp_segment *seg, uintptr_t at, const growth_cut *c) {
    size_t i = extent_at(seg, at);
    memmove(&seg->extents[i + c->n], &seg->extents[i], (seg->nextents - i) * sizeof *seg->extents);
    for (size_t k = 0; k < c->n; k++)
        seg->extents[i + k] = (mp_extent){at + cut_off(c, k), cut_off(c, k + 1) - cut_off(c, k), 1};
    seg->nextents += c->n;
}

int mp_expand_check_extents_locked(const mp_pool *p, const mp_segment *seg, char *why, size_t n) {
    size_t g = p->up.granularity, held = 0;
    uintptr_t end = seg->ptr;
    const mp_block *b = seg->first;
    for (size_t i = 0; i < seg->nextents; i++) {
        const mp_extent *e = &seg->extents[i];
        uintptr_t e_end = e->ptr + e->nbytes;
        if (e->ptr < end || !e->nbytes || e->ptr % g || e->nbytes % g ||
            e_end > seg->ptr + seg->nbytes) {
            snprintf(why, n, "segment %#lx: extent [%#lx, +%zu) misplaced or overlapping",
                     (unsigned long)seg->ptr, (unsigned long)e->ptr, e->nbytes);
            return 1;
        }
        end = e_end;
        if (!e->busy) held += e->nbytes;
        while (b && b->ptr + b->nbytes <= e->ptr) b = b->next;
        /* Mapped blocks lie on idle extents; a busy extent inside a busy unmapped block. */
        for (const mp_block *c = b; c && c->ptr < e_end; c = c->next) {
            int ok = e->busy ? c->state == MP_BLOCK_UNMAPPED && c->busy : c->state != MP_BLOCK_UNMAPPED;
            if (!ok) {
                snprintf(why, n, "segment %#lx: extent [%#lx, +%zu)%s holds block %#lx in state %d",
                         (unsigned long)seg->ptr, (unsigned long)e->ptr, e->nbytes,
                         e->busy ? " (busy)" : "", (unsigned long)c->ptr, c->state);
                return 1;
            }
        }
    }
    if (held != seg->mapped_bytes) {
        snprintf(why, n, "segment %#lx: extents hold %zu bytes, %zu mapped", (unsigned long)seg->ptr,
                 held, seg->mapped_bytes);
        return 1;
    }
    return 0;
}

/* An address-space call, made with the lock dropped: it may wait on the driver's own locks
 * (Note [Events outside the lock]). */
static int va_call_unlocked(mp_pool *p, int reserve, size_t nbytes, uintptr_t *base) {
    mp_lock_drop(p);
    void *blocking = mp_blocking_begin();
    int rc = reserve ? p->up.va_reserve(p->up.ctx, nbytes, base)
                     : p->up.va_release(p->up.ctx, *base, nbytes);
    mp_blocking_end(blocking);
    mp_lock_retake(p);
    return rc;
}

/* The growing range of (s, kind), reserved on first use: address space for the whole
 * device (or for `size`, if larger), nothing mapped. The reservation drops the lock; when
 * another thread gave s a range meanwhile, this one goes back and that one serves (NULL:
 * none could be reserved and none was given). */
mp_segment *ex_segment_of_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    if (s->expandable[kind]) return s->expandable[kind];
    size_t g = p->up.granularity;
    size_t va = p->cfg.expandable_reserve ? p->cfg.expandable_reserve : p->capacity;
    if (!va) va = (size_t)1 << 40;
    va = mp_round_up(va > size ? va : size, g);
    mp_segment *seg = calloc(1, sizeof *seg);
    mp_block *u = seg ? mp_block_new_locked(p) : NULL;
    uintptr_t base = 0;
    int rc = u ? va_call_unlocked(p, 1, va, &base) : MP_ENOMEM;
    if (rc == MP_OK && s->expandable[kind]) {
        va_call_unlocked(p, 0, va, &base);
        rc = MP_EBUSY;
    }
    if (rc != MP_OK) {
        if (u) mp_block_delete_locked(p, u);
        free(seg);
        return s->expandable[kind];
    }
    seg->ptr = base;
    seg->nbytes = va;
    seg->stream = s;
    seg->kind = kind;
    seg->expandable = 1;
    seg->growing = 1;
    seg->first = u;
    seg->next = p->segments;
    if (p->segments) p->segments->prev = seg;
    p->segments = seg;
    p->nsegments++;
    u->ptr = base;
    u->nbytes = va;
    mp_block_join(u, seg);
    u->stream = s;
    u->state = MP_BLOCK_UNMAPPED;
    s->expandable[kind] = seg;
    mp_stat3_inc(p->stats.segment, kind, 1);
    mp_stat_inc(&p->stats.va_reserved_bytes, (int64_t)va);
    return seg;
}

int mp_expand_detach_range_locked(mp_pool *p, mp_segment *seg, mp_stream *only,
                                  mp_release_list *out) {
    if (seg->pinned) return 0;
    size_t nruns = 0;
    for (mp_block *b = seg->first; b; b = b->next) {
        if (b->state == MP_BLOCK_UNMAPPED) {
            if (b->busy) return 0;   /* being mapped by another thread */
            continue;
        }
        if (b->state != MP_BLOCK_FREE || b->stream != only) return 0;
        if (!b->prev || b->prev->state == MP_BLOCK_UNMAPPED) nruns++;
    }
    struct mp_run *runs = nruns ? malloc(nruns * sizeof *runs) : NULL;
    if (nruns && !runs) return 0;
    /* Mapped runs are whole allocations (Note [Growth extents]): note them for the
     * unmap, which runs without the lock (mp_release_finish). */
    size_t r = 0;
    for (mp_block *b = seg->first, *next; b; b = next) {
        next = b->next;
        if (b->state == MP_BLOCK_FREE) {
            if (!b->prev || b->prev->state == MP_BLOCK_UNMAPPED) runs[r++] = (struct mp_run){b->ptr, 0};
            runs[r - 1].nbytes += b->nbytes;
            mp_remove_free_locked(p, b);
        }
        mp_block_delete_locked(p, b);
    }
    seg->first = NULL;
    for (size_t i = 0; i < nruns; i++)
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_UNMAP, runs[i].ptr, runs[i].nbytes,
                                seg->stream->handle);
    p->stats.num_device_free += nruns;
    out->nbytes += seg->mapped_bytes;
    if (seg->mapped_bytes) ex_count_mapped_locked(p, seg, seg->mapped_bytes, 0);
    mp_stat3_dec(p->stats.segment, seg->kind, 1);
    mp_stat_dec(&p->stats.va_reserved_bytes, (int64_t)seg->nbytes);
    if (seg->prev) seg->prev->next = seg->next;
    else p->segments = seg->next;
    if (seg->next) seg->next->prev = seg->prev;
    p->nsegments--;
    seg->release_stream = seg->stream->handle;
    seg->release_runs = runs;
    seg->nrelease_runs = nruns;
    seg->inext = out->head;
    out->head = seg;
    return 1;
}

void mp_expand_drop_empty_locked(mp_pool *p, mp_release_list *out) {
    for (mp_segment *seg = p->segments, *next; seg; seg = next) {
        next = seg->next;
        if (seg->expandable && !seg->growing && !seg->mapped_bytes)
            mp_expand_detach_range_locked(p, seg, NULL, out);
    }
}

/* Note [Segment events at destroy]
 * A pool destroyed with segments still cached frees them with no release list, so nothing
 * told the trace or the observer of them (Note [Segment observer], mp_core.h), and PyTorch's
 * memory history and trace trackers (NCCL's registration of a MemPool's segments) kept them
 * for ever: a MemPool's or a graph's pool is destroyed that way once it is released and its
 * last block freed. Destroy tells of each segment here, as a release would: one
 * segment_free per plain segment, one segment_unmap per mapped run of a range. */
/* The next maximal run of mapped blocks from *b on, [*lo, *hi) (runs start and end on page
 * boundaries); *b moves past it. 0 when no mapped block is left. */
static int next_mapped_run(const mp_block **b, uintptr_t *lo, uintptr_t *hi) {
    const mp_block *x = *b;
    while (x && x->state == MP_BLOCK_UNMAPPED) x = x->next;
    if (!x) {
        *b = NULL;
        return 0;
    }
    *lo = x->ptr;
    *hi = x->ptr + x->nbytes;
    for (x = x->next; x && x->state != MP_BLOCK_UNMAPPED; x = x->next) *hi = x->ptr + x->nbytes;
    *b = x;
    return 1;
}

void mp_trace_segment_gone_locked(mp_pool *p, const mp_segment *seg) {
    if (!mp_segment_events_wanted(p)) return;
    uintptr_t stream = seg->stream->handle;
    if (!seg->expandable) {
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_FREE, seg->ptr, seg->nbytes, stream);
        return;
    }
    const mp_block *b = seg->first;
    uintptr_t lo, hi;
    while (next_mapped_run(&b, &lo, &hi))
        mp_trace_segment_locked(p, MP_TRACE_SEGMENT_UNMAP, lo, hi - lo, stream);
}

void mp_segment_release_upstream(mp_pool *p, mp_segment *seg) {
    if (!seg->expandable) {
        p->up.segment_free(p->up.ctx, seg->ptr, seg->nbytes, seg->release_stream);
        return;
    }
    if (!seg->first) {   /* detached: its mapped runs were noted (mp_expand_detach_range_locked) */
        for (size_t i = 0; i < seg->nrelease_runs; i++)
            p->up.unmap(p->up.ctx, seg->release_runs[i].ptr, seg->release_runs[i].nbytes);
        p->up.va_release(p->up.ctx, seg->ptr, seg->nbytes);
        return;
    }
    /* Maximal mapped runs start and end on page boundaries: unmap each, then the range. */
    const mp_block *b = seg->first;
    uintptr_t lo, hi;
    while (next_mapped_run(&b, &lo, &hi)) {
        mp_assert(lo % p->up.granularity == 0 && hi % p->up.granularity == 0 && lo < hi);
        p->up.unmap(p->up.ctx, lo, hi - lo);
    }
    p->up.va_release(p->up.ctx, seg->ptr, seg->nbytes);
}
