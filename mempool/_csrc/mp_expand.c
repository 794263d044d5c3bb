/* Note [Expandable segments]
 *
 * Why: a caching pool fragments when a freed block cannot serve a larger request next to it;
 * memory sits reserved but unusable. With an address range reserved far beyond what is
 * mapped, every block of a stream lives in one contiguous range, so free neighbours always
 * merge, and growth maps pages at a free edge or into an unmapped hole instead of taking a
 * new segment.
 *
 * How: a segment here is a VA reservation covering blocks of three kinds: allocated or
 * pending, free (mapped, in the owner's free list), and unmapped (in no list). Growth picks
 * the first unmapped block that, with the free block of the same stream before it (or
 * after it), holds the request, and maps just the pages needed at its start. Release unmaps
 * the whole pages inside free blocks, after synchronizing the streams that own them, since
 * an unmap does not wait for queued work. reserved_bytes counts mapped bytes; the address
 * space shows in va_reserved_bytes.
 *
 * Limits: while pages are mapped or unmapped the lock is dropped and the unmapped block is
 * marked busy, so no other thread maps it or merges it meanwhile. max_split_size has no
 * meaning with expandable segments (the configuration refuses the pair).
 */
#include <stdlib.h>

#include "mp_expand.h"

static size_t round_up(size_t n, size_t g) { return (n + g - 1) / g * g; }
static size_t round_down(size_t n, size_t g) { return n / g * g; }

static mp_segment *expandable_segment_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    if (s->expandable[kind]) return s->expandable[kind];
    size_t g = p->up.granularity;
    size_t va = p->cfg.expandable_reserve ? p->cfg.expandable_reserve : p->capacity;
    if (!va) va = (size_t)1 << 40;
    va = round_up(va > size ? va : size, g);
    mp_segment *seg = calloc(1, sizeof *seg);
    mp_block *u = seg ? mp_block_new_locked(p) : NULL;
    uintptr_t base = 0;
    if (!u || p->up.va_reserve(p->up.ctx, va, &base) != MP_OK) {
        if (u) mp_block_delete_locked(p, u);
        free(seg);
        return NULL;
    }
    seg->ptr = base;
    seg->nbytes = va;
    seg->stream = s;
    seg->kind = kind;
    seg->expandable = 1;
    seg->first = u;
    seg->next = p->segments;
    if (p->segments) p->segments->prev = seg;
    p->segments = seg;
    p->nsegments++;
    u->ptr = base;
    u->nbytes = va;
    u->seg = seg;
    u->stream = s;
    u->state = MP_BLOCK_UNMAPPED;
    s->expandable[kind] = seg;
    mp_stat3_inc(p->stats.segment, kind, 1);
    mp_stat_inc(&p->stats.va_reserved_bytes, (int64_t)va);
    return seg;
}

static int free_of(const mp_block *b, const mp_stream *s) {
    return b && b->state == MP_BLOCK_FREE && b->stream == s;
}

/* Map pages into s's segment so that a free block of at least `size` exists there. */
static int grow_locked(mp_pool *p, mp_stream *s, int kind, size_t size) {
    size_t g = p->up.granularity;
    mp_segment *seg = expandable_segment_locked(p, s, kind, size);
    if (!seg) return MP_ENOMEM;
    mp_block *u = NULL;
    size_t map_bytes = 0;
    for (mp_block *b = seg->first; b; b = b->next) {
        if (b->state != MP_BLOCK_UNMAPPED || b->busy) continue;
        size_t have = free_of(b->prev, s) ? b->prev->nbytes : 0;
        if (have + b->nbytes >= size) {
            u = b;
            map_bytes = round_up(size - (have < size ? have : size), g);
            if (map_bytes == 0) map_bytes = g;
            break;
        }
        if (free_of(b->next, s) && have + b->nbytes + b->next->nbytes >= size) {
            u = b;
            map_bytes = b->nbytes;
            break;
        }
    }
    if (!u) return MP_ENOMEM;   /* the address range itself is full */
    if (p->cfg.limit != MP_UNLIMITED && mp_reserved_now_locked(p) + map_bytes > p->cfg.limit)
        return MP_ELIMIT;
    if (p->cfg.gc_threshold > 0) {
        size_t base = p->cfg.limit != MP_UNLIMITED ? p->cfg.limit : p->capacity;
        size_t threshold = (size_t)(p->cfg.gc_threshold * (double)base);
        if (base && mp_reserved_now_locked(p) + map_bytes > threshold)
            mp_expand_release_locked(p, mp_reserved_now_locked(p) + map_bytes - threshold);
        if (u->state != MP_BLOCK_UNMAPPED) return MP_OK;   /* changed meanwhile: search again */
    }
    mp_block *m = map_bytes < u->nbytes ? mp_block_new_locked(p) : u;
    if (!m) return MP_ENOMEM;

    u->busy = 1;
    p->inflight_bytes += map_bytes;
    mp_lock_release(&p->lock);
    int rc = p->up.map(p->up.ctx, u->ptr, map_bytes);
    mp_lock_acquire(&p->lock);
    p->inflight_bytes -= map_bytes;
    u->busy = 0;
    if (rc != MP_OK) {
        if (m != u) mp_block_delete_locked(p, m);
        return rc;
    }
    if (m != u) {
        m->ptr = u->ptr;
        m->nbytes = map_bytes;
        m->seg = seg;
        m->prev = u->prev;
        m->next = u;
        if (u->prev) u->prev->next = m;
        else seg->first = m;
        u->prev = m;
        u->ptr += map_bytes;
        u->nbytes -= map_bytes;
    }
    m->stream = s;
    seg->mapped_bytes += map_bytes;
    p->stats.num_device_alloc++;
    mp_stat3_inc(p->stats.reserved_bytes, kind, (int64_t)map_bytes);
    mp_stat_inc(&p->stats.mapped_bytes, (int64_t)map_bytes);
    mp_trace_locked(p, MP_TRACE_SEGMENT_MAP, m->ptr, map_bytes, s->handle);
    mp_insert_free_merged_locked(p, m);
    return MP_OK;
}

int mp_expand_alloc_locked(mp_pool *p, mp_stream *s, int kind, size_t size,
                           mp_release_list *rel, mp_block **out) {
    (void)rel;
    int rc = MP_ENOMEM, retries = 0;
    for (int round = 0; round < 8; round++) {
        if ((*out = mp_search_lists_locked(p, s, kind, size))) return MP_OK;
        rc = grow_locked(p, s, kind, size);
        if (rc == MP_OK) continue;
        if (rc != MP_ENOMEM && rc != MP_ELIMIT) return rc;
        /* Out of memory or over the limit: unmap free pages elsewhere, then wait for
         * pending frees, then give up. */
        if (retries == 0) {
            p->stats.num_alloc_retries++;
            if (!mp_expand_release_locked(p, size)) retries++;
        }
        if (retries == 1) {
            p->stats.num_alloc_retries++;
            if (!p->npending) return rc;
            mp_sync_pending_unlocked(p);
            mp_expand_release_locked(p, SIZE_MAX);
        }
        if (retries >= 2) return rc;
        retries++;
    }
    return rc;
}

typedef struct unmap_job {
    mp_block *u;
    uintptr_t stream;
} unmap_job;

/* Split free block b around its whole pages [lo, hi): the middle becomes a busy unmapped
 * block, the partial pages at either end stay free. Returns the unmapped block. */
static mp_block *carve_pages_locked(mp_pool *p, mp_block *b, uintptr_t lo, uintptr_t hi) {
    mp_block *head = NULL, *tail = NULL;
    if (lo > b->ptr && !(head = mp_block_new_locked(p))) return NULL;
    if (hi < b->ptr + b->nbytes && !(tail = mp_block_new_locked(p))) {
        if (head) mp_block_delete_locked(p, head);
        return NULL;
    }
    mp_remove_free_locked(p, b);
    mp_segment *seg = b->seg;
    if (head) {
        head->ptr = b->ptr;
        head->nbytes = lo - b->ptr;
        head->seg = seg;
        head->stream = b->stream;
        head->prev = b->prev;
        head->next = b;
        if (b->prev) b->prev->next = head;
        else seg->first = head;
        b->prev = head;
    }
    if (tail) {
        tail->ptr = hi;
        tail->nbytes = b->ptr + b->nbytes - hi;
        tail->seg = seg;
        tail->stream = b->stream;
        tail->next = b->next;
        tail->prev = b;
        if (b->next) b->next->prev = tail;
        b->next = tail;
    }
    b->ptr = lo;
    b->nbytes = hi - lo;
    b->state = MP_BLOCK_UNMAPPED;
    b->busy = 1;
    if (head) mp_insert_free_locked(p, head);
    if (tail) mp_insert_free_locked(p, tail);
    return b;
}

static void merge_unmapped_locked(mp_pool *p, mp_block *u) {
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

size_t mp_expand_release_locked(mp_pool *p, size_t target) {
    size_t g = p->up.granularity, released = 0, n = 0, cap = 0;
    unmap_job *jobs = NULL;
    for (mp_segment *seg = p->segments; seg && released < target; seg = seg->next) {
        if (!seg->expandable) continue;
        for (mp_block *b = seg->first; b && released < target; b = b->next) {
            if (b->state != MP_BLOCK_FREE) continue;
            uintptr_t lo = round_up(b->ptr, g), hi = round_down(b->ptr + b->nbytes, g);
            if (hi <= lo) continue;
            if (n == cap) {
                size_t ncap = cap ? cap * 2 : 16;
                unmap_job *grown = realloc(jobs, ncap * sizeof *grown);
                if (!grown) break;
                jobs = grown;
                cap = ncap;
            }
            uintptr_t owner = b->stream->handle;
            mp_block *u = carve_pages_locked(p, b, lo, hi);
            if (!u) break;
            jobs[n].u = u;
            jobs[n].stream = owner;
            n++;
            size_t bytes = hi - lo;
            released += bytes;
            seg->mapped_bytes -= bytes;
            p->stats.num_device_free++;
            mp_stat3_dec(p->stats.reserved_bytes, seg->kind, (int64_t)bytes);
            mp_stat_dec(&p->stats.mapped_bytes, (int64_t)bytes);
            mp_trace_locked(p, MP_TRACE_SEGMENT_UNMAP, lo, bytes, owner);
            b = u;   /* continue after the unmapped block (the tail, if any, is partial) */
        }
    }
    if (!n) {
        free(jobs);
        return 0;
    }
    mp_lock_release(&p->lock);
    for (size_t i = 0; i < n; i++) {
        int seen = 0;
        for (size_t j = 0; j < i && !seen; j++) seen = jobs[j].stream == jobs[i].stream;
        if (!seen) p->up.stream_synchronize(p->up.ctx, jobs[i].stream);
    }
    for (size_t i = 0; i < n; i++) p->up.unmap(p->up.ctx, jobs[i].u->ptr, jobs[i].u->nbytes);
    mp_lock_acquire(&p->lock);
    /* One at a time: a later job's block stays busy (unmerged, so valid) until its turn. */
    for (size_t i = 0; i < n; i++) {
        jobs[i].u->busy = 0;
        merge_unmapped_locked(p, jobs[i].u);
    }
    free(jobs);
    return released;
}

void mp_segment_release_upstream(mp_pool *p, mp_segment *seg) {
    if (!seg->expandable) {
        p->up.segment_free(p->up.ctx, seg->ptr, seg->nbytes, seg->stream->handle);
        return;
    }
    /* Maximal mapped runs start and end on page boundaries: unmap each, then the range. */
    mp_block *b = seg->first;
    while (b) {
        if (b->state == MP_BLOCK_UNMAPPED) {
            b = b->next;
            continue;
        }
        uintptr_t lo = b->ptr, hi = b->ptr + b->nbytes;
        for (b = b->next; b && b->state != MP_BLOCK_UNMAPPED; b = b->next) hi = b->ptr + b->nbytes;
        p->up.unmap(p->up.ctx, lo, hi - lo);
    }
    p->up.va_release(p->up.ctx, seg->ptr, seg->nbytes);
}
