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

/* Split free block b at addr (inside it, page-aligned) using the spare struct n: both
 * halves stay free, same owner. Returns the upper half. */
static mp_block *split_free_at_locked(mp_pool *p, mp_block *b, uintptr_t addr, mp_block *n) {
    mp_remove_free_locked(p, b);
    n->ptr = addr;
    n->nbytes = b->ptr + b->nbytes - addr;
    n->seg = b->seg;
    n->stream = b->stream;
    n->prev = b;
    n->next = b->next;
    if (b->next) b->next->prev = n;
    b->next = n;
    b->nbytes = addr - b->ptr;
    mp_insert_free_locked(p, b);
    mp_insert_free_locked(p, n);
    return n;
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

typedef struct release_jobs {
    mp_block **unmapped;        /* busy unmapped blocks to unmap after the lock is dropped */
    size_t n, cap;
    uintptr_t *streams;         /* owners of the pages: synchronized before any unmap */
    size_t nstreams, cap_streams;
    int sync_every_stream;      /* no host memory to list the owners: sync them all */
} release_jobs;

static int reserve_job(release_jobs *j) {
    if (j->n < j->cap) return 1;
    size_t cap = j->cap ? j->cap * 2 : 16;
    mp_block **grown = realloc(j->unmapped, cap * sizeof *grown);
    if (!grown) return 0;
    j->unmapped = grown;
    j->cap = cap;
    return 1;
}

static void note_stream(release_jobs *j, uintptr_t h) {
    for (size_t i = 0; i < j->nstreams; i++)
        if (j->streams[i] == h) return;
    if (j->nstreams == j->cap_streams) {
        size_t cap = j->cap_streams ? j->cap_streams * 2 : 8;
        uintptr_t *grown = realloc(j->streams, cap * sizeof *grown);
        if (!grown) {
            j->sync_every_stream = 1;
            return;
        }
        j->streams = grown;
        j->cap_streams = cap;
    }
    j->streams[j->nstreams++] = h;
}

/* Turn the whole pages [lo, hi) of a run of free blocks (of any owners: blocks of different
 * streams never merge, but their pages are all free) into one busy unmapped block. */
static mp_block *carve_run_locked(mp_pool *p, mp_block *first, uintptr_t lo, uintptr_t hi,
                                  release_jobs *jobs) {
    /* Both structs a split may need are taken first: nothing changes unless all succeed. */
    mp_block *spare1 = mp_block_new_locked(p), *spare2 = spare1 ? mp_block_new_locked(p) : NULL;
    if (!spare2) {
        if (spare1) mp_block_delete_locked(p, spare1);
        return NULL;
    }
    mp_block *x = first;
    while (x->ptr + x->nbytes <= lo) x = x->next;
    if (x->ptr < lo) {
        x = split_free_at_locked(p, x, lo, spare1);
        spare1 = NULL;
    }
    mp_block *y = x;
    while (y->ptr + y->nbytes < hi) y = y->next;
    if (y->ptr + y->nbytes > hi) {
        split_free_at_locked(p, y, hi, spare2);
        spare2 = NULL;
    }
    if (spare1) mp_block_delete_locked(p, spare1);
    if (spare2) mp_block_delete_locked(p, spare2);
    /* x..y now cover exactly [lo, hi) */
    for (mp_block *b = x;; b = b->next) {
        note_stream(jobs, b->stream->handle);
        if (b == y) break;
    }
    mp_block *stop = y->next;
    mp_remove_free_locked(p, x);
    for (mp_block *b = x->next; b != stop;) {
        mp_block *next = b->next;
        mp_remove_free_locked(p, b);
        mp_block_delete_locked(p, b);
        b = next;
    }
    x->next = stop;
    if (stop) stop->prev = x;
    x->nbytes = hi - lo;
    x->state = MP_BLOCK_UNMAPPED;
    x->busy = 1;
    return x;
}

size_t mp_expand_release_locked(mp_pool *p, size_t target) {
    size_t g = p->up.granularity, released = 0;
    release_jobs jobs = {0};
    for (mp_segment *seg = p->segments; seg && released < target; seg = seg->next) {
        if (!seg->expandable) continue;
        mp_block *b = seg->first;
        while (b && released < target) {
            if (b->state != MP_BLOCK_FREE) {
                b = b->next;
                continue;
            }
            mp_block *last = b;
            while (last->next && last->next->state == MP_BLOCK_FREE) last = last->next;
            mp_block *after = last->next;
            uintptr_t lo = round_up(b->ptr, g), hi = round_down(last->ptr + last->nbytes, g);
            if (hi > lo) {
                mp_block *u = reserve_job(&jobs) ? carve_run_locked(p, b, lo, hi, &jobs) : NULL;
                if (!u) break;   /* out of host memory: release what was carved so far */
                jobs.unmapped[jobs.n++] = u;
                size_t bytes = hi - lo;
                released += bytes;
                seg->mapped_bytes -= bytes;
                p->stats.num_device_free++;
                mp_stat3_dec(p->stats.reserved_bytes, seg->kind, (int64_t)bytes);
                mp_stat_dec(&p->stats.mapped_bytes, (int64_t)bytes);
                mp_trace_locked(p, MP_TRACE_SEGMENT_UNMAP, lo, bytes, seg->stream->handle);
            }
            b = after;
        }
    }
    if (!jobs.n) {
        free(jobs.unmapped);
        free(jobs.streams);
        return 0;
    }
    /* Out of host memory for the owner list (rare): sync every stream, with the lock held
     * since the stream table may grow once it is dropped. */
    if (jobs.sync_every_stream)
        for (size_t i = 0; i < p->nstreams; i++) p->up.stream_synchronize(p->up.ctx, p->streams[i]->handle);
    mp_lock_release(&p->lock);
    for (size_t i = 0; i < jobs.nstreams && !jobs.sync_every_stream; i++)
        p->up.stream_synchronize(p->up.ctx, jobs.streams[i]);
    for (size_t i = 0; i < jobs.n; i++) p->up.unmap(p->up.ctx, jobs.unmapped[i]->ptr, jobs.unmapped[i]->nbytes);
    mp_lock_acquire(&p->lock);
    /* One at a time: a later job's block stays busy (unmerged, so valid) until its turn. */
    for (size_t i = 0; i < jobs.n; i++) {
        jobs.unmapped[i]->busy = 0;
        merge_unmapped_locked(p, jobs.unmapped[i]);
    }
    free(jobs.unmapped);
    free(jobs.streams);
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
