/* Reading the pool: stats, the invariant check the tests call after every step, and
 * layout copies for snapshots. Each takes the lock and copies out. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mp_capture.h"
#include "mp_expand.h"
#include "mp_internal.h"

/* The families of three, [all, small, large], at the start of mp_stats. */
#define NFAMILIES (offsetof(mp_stats, oversize_allocations) / (MP_STAT_TYPES * sizeof(mp_stat)))

/* Note [Derived totals]: the `all` column's current, allocated and freed of every family,
 * from its pools' columns (the pool's own `all` columns keep only their peaks). */
static void fill_totals(mp_stats *st) {
    mp_stat *f = (mp_stat *)st;
    for (size_t i = 0; i < NFAMILIES; i++, f += MP_STAT_TYPES) {
        f[MP_STAT_ALL].current = f[MP_STAT_SMALL].current + f[MP_STAT_LARGE].current;
        f[MP_STAT_ALL].allocated = f[MP_STAT_SMALL].allocated + f[MP_STAT_LARGE].allocated;
        f[MP_STAT_ALL].freed = f[MP_STAT_SMALL].freed + f[MP_STAT_LARGE].freed;
    }
}

/* Note [Peak windows]
 * PyTorch reports one peak per statistic for a device, over all of its memory, CUDA graphs'
 * private pools included; the glue keeps those in pools of their own. The sum of each
 * pool's peak is only an upper bound (the pools peak at different times: 1.27 GiB
 * reported for 1.11 under torch.compile's CUDA graphs), and tracking the device's total on
 * every allocation would cost the hot path. But the private pools change only at their own
 * allocations and frees, which are rare: between two of those, the device's peak is this
 * pool's peak over that stretch plus what the private pools held through it. So the pool
 * keeps windows: mp_stats_window reads the peaks of the current one and, with close,
 * starts the next from the current values, keeping the closed windows' peaks in
 * closed_peak, so that mp_get_stats still reports the peaks since the last reset. The hot
 * path is unchanged (it updates peak as always); the glue's use is in mp_torch.c
 * (device_stats). */
/* Where each family of Note [Hot counters] sits in mp_stats. */
static const size_t hot_family_offset[MP_HOT_FAMILIES] = {
    [MP_HOT_ALLOCATION] = offsetof(mp_stats, allocation),
    [MP_HOT_ACTIVE] = offsetof(mp_stats, active),
    [MP_HOT_ALLOCATED_BYTES] = offsetof(mp_stats, allocated_bytes),
    [MP_HOT_ACTIVE_BYTES] = offsetof(mp_stats, active_bytes),
    [MP_HOT_REQUESTED_BYTES] = offsetof(mp_stats, requested_bytes),
};

static mp_stat *hot_family_in(mp_stats *st, int family) {
    return (mp_stat *)((char *)st + hot_family_offset[family]);
}

void mp_stats_compose_locked(const mp_pool *p, mp_stats *out) {
    *out = p->stats;
    for (int f = 0; f < MP_HOT_FAMILIES; f++) {
        const mp_hot_family *h = &p->hot_stats[f];
        mp_stat *s = hot_family_in(out, f);
        for (int k = KIND_SMALL; k <= KIND_LARGE; k++) {
            mp_stat *pool = &s[k == KIND_SMALL ? MP_STAT_SMALL : MP_STAT_LARGE];
            pool->current = h->current[k];
            pool->peak = h->peak[k];
            pool->allocated = h->allocated[k];
            pool->freed = h->allocated[k] - h->current[k] + p->freed_base[f][k];
        }
        s[MP_STAT_ALL].peak = h->all_peak;
    }
}

static void stats_locked(mp_pool *p, mp_stats *out, int with_closed) {
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    mp_stats_compose_locked(p, out);
    out->num_streams = p->nstreams;
    mp_stat *o = (mp_stat *)out;
    for (size_t i = 0; with_closed && i < MP_NSTATS; i++)
        if (p->closed_peak[i] > o[i].peak) o[i].peak = p->closed_peak[i];
}

void mp_get_stats(mp_pool *p, mp_stats *out) {
    mp_lock_acquire(&p->lock);
    stats_locked(p, out, 1);
    mp_lock_release(&p->lock);
    fill_totals(out);
}

/* Every peak from its current value; an `all` column holds only its peak (Note [Derived
 * totals]), which starts again from the current total of its two pools. */
static void restart_peaks_locked(mp_pool *p) {
    p->live_high_water = mp_live_mark_locked(p);   /* the pool's own mark outlives resets */
    mp_stat *s = (mp_stat *)&p->stats;
    for (size_t i = 0; i < MP_NSTATS; i++) s[i].peak = s[i].current;
    mp_stat *f = (mp_stat *)&p->stats;
    for (size_t i = 0; i < NFAMILIES; i++, f += MP_STAT_TYPES)
        f[MP_STAT_ALL].peak = mp_stat3_current(f);
    for (int i = 0; i < MP_HOT_FAMILIES; i++) {   /* Note [Hot counters] */
        mp_hot_family *h = &p->hot_stats[i];
        h->peak[KIND_SMALL] = h->current[KIND_SMALL];
        h->peak[KIND_LARGE] = h->current[KIND_LARGE];
        h->all_peak = mp_hot_current(p, i);
    }
}

void mp_stats_window(mp_pool *p, mp_stats *out, int close) {
    mp_lock_acquire(&p->lock);
    stats_locked(p, out, 0);
    if (close) {
        const mp_stat *s = (const mp_stat *)out;   /* this window's peaks, as composed */
        for (size_t i = 0; i < MP_NSTATS; i++)
            if (s[i].peak > p->closed_peak[i]) p->closed_peak[i] = s[i].peak;
        restart_peaks_locked(p);
    }
    mp_lock_release(&p->lock);
    fill_totals(out);
}

void mp_reset_peak_stats(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    memset(p->closed_peak, 0, sizeof p->closed_peak);
    restart_peaks_locked(p);
    mp_lock_release(&p->lock);
}

void mp_reset_accumulated_stats(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    mp_stat *s = (mp_stat *)&p->stats;
    for (size_t i = 0; i < MP_NSTATS; i++) s[i].allocated = s[i].freed = 0;
    for (int i = 0; i < MP_HOT_FAMILIES; i++) {   /* Note [Hot counters] */
        for (int k = KIND_SMALL; k <= KIND_LARGE; k++) {
            p->hot_stats[i].allocated[k] = 0;
            p->freed_base[i][k] = p->hot_stats[i].current[k];
        }
    }
    p->stats.num_alloc_retries = p->stats.num_ooms = p->stats.num_sync_all_streams = 0;
    p->stats.num_device_alloc = p->stats.num_device_free = 0;
    p->stats.num_ahead_maps = p->stats.num_behind_unmaps = 0;
    p->stats.num_cross_stream_reuse = p->stats.num_event_waits = 0;
    p->stats.num_stream_syncs = p->stats.num_event_records = p->stats.num_stream_queries = 0;
    mp_lock_release(&p->lock);
}

size_t mp_used_bytes(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    size_t n = (size_t)mp_hot_current(p, MP_HOT_ALLOCATED_BYTES);
    mp_lock_release(&p->lock);
    return n;
}

size_t mp_reserved_bytes(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    size_t n = (size_t)mp_stat3_current(p->stats.reserved_bytes);
    mp_lock_release(&p->lock);
    return n;
}

size_t mp_cached_bytes(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    size_t n = (size_t)(mp_stat3_current(p->stats.reserved_bytes) -
                        mp_hot_current(p, MP_HOT_ACTIVE_BYTES));
    mp_lock_release(&p->lock);
    return n;
}

static size_t largest_free_block_locked(mp_pool *p) {
    size_t best = 0;
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    for (size_t i = 0; i < p->nstreams; i++) {
        for (int k = 0; k < 2; k++) {
            const mp_freelist *fl = &p->streams[i]->lists[k];
            if (!fl->summary) continue;
            int w = 63 - __builtin_clzll(fl->summary);
            int c = w * 64 + 63 - __builtin_clzll(fl->bits[w]);
            for (mp_block *b = fl->head[c]; b; b = b->fnext)
                if (b->nbytes > best) best = b->nbytes;
        }
    }
    return best;
}

size_t mp_largest_free_block(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    size_t best = largest_free_block_locked(p);
    mp_lock_release(&p->lock);
    return best;
}

/* ---------------------------------------------------------------- OOM records */

static _Thread_local mp_oom thread_oom;
static _Thread_local int thread_has_oom;

static void oom_fill_locked(mp_pool *p, int code, size_t nbytes, size_t rounded,
                            uintptr_t stream, mp_oom *out) {
    size_t reserved = (size_t)mp_stat3_current(p->stats.reserved_bytes);
    size_t active = (size_t)mp_hot_current(p, MP_HOT_ACTIVE_BYTES);
    size_t used = (size_t)mp_hot_current(p, MP_HOT_ALLOCATED_BYTES);
    out->pool = p;
    out->code = code;
    out->nbytes = nbytes;
    out->rounded = rounded;
    out->stream = stream;
    out->reserved_bytes = reserved;
    out->used_bytes = used;
    out->pending_bytes = active - used;
    out->cached_bytes = reserved - active;
    out->largest_free_block = largest_free_block_locked(p);
    out->limit = mp_effective_limit(p);
    out->capacity = p->capacity;
    /* As mp_capture_active; the upstream's answer needs no lock. */
    out->capturing = p->captures > 0 || mp_capture_handle(p, stream);
    out->num_ooms = p->stats.num_ooms;
}

void mp_oom_record_locked(mp_pool *p, int code, size_t nbytes, size_t rounded, uintptr_t stream) {
    oom_fill_locked(p, code, nbytes, rounded, stream, &thread_oom);
    thread_has_oom = 1;
}

int mp_oom_take(mp_oom *out) {
    if (!thread_has_oom) return MP_ENOTFOUND;
    *out = thread_oom;
    thread_has_oom = 0;
    return MP_OK;
}

void mp_oom_snapshot(mp_pool *p, int code, size_t nbytes, uintptr_t stream, mp_oom *out) {
    mp_lock_acquire(&p->lock);
    size_t rounded = nbytes > MP_MAX_ALLOC ? nbytes : mp_round_size(&p->cfg, nbytes);
    oom_fill_locked(p, code, nbytes, rounded, stream, out);
    mp_lock_release(&p->lock);
}

size_t mp_capacity(mp_pool *p) { return p->capacity; }
const mp_config *mp_pool_config(mp_pool *p) { return &p->cfg; }
mp_upstream *mp_pool_upstream(mp_pool *p) { return &p->up; }

/* ---------------------------------------------------------------- invariants */

typedef struct {
    char *msg;
    size_t len;
    int failed;
} report;

static int fail(report *r, const char *fmt, ...) {
    if (!r->failed) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->msg, r->len, fmt, ap);
        va_end(ap);
    }
    r->failed = 1;
    return 0;
}

#define CHECK(cond, ...) ((cond) ? 1 : fail(&r, __VA_ARGS__))

static int in_list(const mp_freelist *fl, const mp_block *b) {
    if (b->cls >= MP_NCLASSES) return 0;
    for (mp_block *x = fl->head[b->cls]; x; x = x->fnext)
        if (x == b) return 1;
    return 0;
}

static int cmp_uintptr(const void *a, const void *b) {
    uintptr_t x = *(const uintptr_t *)a, y = *(const uintptr_t *)b;
    return x < y ? -1 : x > y;
}

int mp_check_invariants(mp_pool *p, char *msg, size_t msglen) {
    report r = {msg, msglen, 0};
    if (msglen) msg[0] = 0;
    mp_lock_acquire(&p->lock);
    /* Hot blocks are checked where they are (Note [Hot blocks]), not folded in first, so
     * that a caller checking after every step sees them persist across steps. */
    int64_t alloc_n[3] = {0}, alloc_b[3] = {0}, req_b[3] = {0}, active_n[3] = {0},
            active_b[3] = {0}, split_n[3] = {0}, split_b[3] = {0}, seg_n[3] = {0},
            reserved_b[3] = {0};
    size_t nfree = 0, free_bytes = 0, npending = 0, nsegs = 0, nhot = 0, nheld_events = 0;
    /* Note [Block tallies]: the blocks carrying each tally seen (the first few tallies;
     * clients are few), against what the tally counts. */
    enum { MAX_TALLIES = 8 };
    const mp_tally *tallies[MAX_TALLIES];
    int64_t tallied[MAX_TALLIES];
    int ntallies = 0;
    uintptr_t *bounds = malloc(2 * (p->nsegments + 1) * sizeof *bounds);

    for (mp_segment *seg = p->segments; seg && !r.failed; seg = seg->next) {
        int k = seg->kind == KIND_SMALL ? MP_STAT_SMALL : MP_STAT_LARGE;
        if (bounds && nsegs < p->nsegments) {
            bounds[2 * nsegs] = seg->ptr;
            bounds[2 * nsegs + 1] = seg->ptr + seg->nbytes;
        }
        nsegs++;
        seg_n[k]++;
        CHECK(seg->next == NULL || seg->next->prev == seg, "segment %#lx: broken list link", (unsigned long)seg->ptr);
        uintptr_t expect = seg->ptr;
        size_t busy = 0, mapped = 0;
        mp_block *prev = NULL;
        for (mp_block *b = seg->first; b && !r.failed; prev = b, b = b->next) {
            CHECK(b->seg == seg, "block %#lx: wrong segment", (unsigned long)b->ptr);
            CHECK(b->kind == seg->kind, "block %#lx: kind %d in a segment of kind %d",
                  (unsigned long)b->ptr, b->kind, seg->kind);
            CHECK(b->prev == prev, "block %#lx: broken neighbour link", (unsigned long)b->ptr);
            CHECK(b->ptr == expect, "segment %#lx: gap or overlap at %#lx (block starts at %#lx)",
                  (unsigned long)seg->ptr, (unsigned long)expect, (unsigned long)b->ptr);
            CHECK(b->nbytes > 0 && b->nbytes % MP_MIN_BLOCK == 0, "block %#lx: bad size %zu",
                  (unsigned long)b->ptr, b->nbytes);
            expect = b->ptr + b->nbytes;
            if (b->state != MP_BLOCK_UNMAPPED) mapped += b->nbytes;
            CHECK(b->state == MP_BLOCK_ALLOCATED || !b->tally,
                  "block %#lx: carries a tally but is not allocated", (unsigned long)b->ptr);
            switch (b->state) {
            case MP_BLOCK_FREE:
                nfree++;
                free_bytes += b->nbytes;
                CHECK(in_list(&b->stream->lists[seg->kind], b) && b->cls == mp_size_class(b->nbytes),
                      "free block %#lx: not in its stream's free list", (unsigned long)b->ptr);
                CHECK(!(b->next && b->next->state == MP_BLOCK_FREE && b->next->stream == b->stream),
                      "free blocks %#lx and %#lx of one stream are adjacent but not merged",
                      (unsigned long)b->ptr, (unsigned long)(b->next ? b->next->ptr : 0));
                CHECK(b->split_counted == (b->prev || b->next), "free block %#lx: split flag wrong",
                      (unsigned long)b->ptr);
                CHECK(b->requested == 0, "free block %#lx: requested bytes left", (unsigned long)b->ptr);
                if (b->split_counted) {
                    split_n[k]++;
                    split_b[k] += (int64_t)b->nbytes;
                }
                break;
            case MP_BLOCK_ALLOCATED:
                busy++;
                CHECK(mp_ptrmap_get(&p->live, b->ptr) == b, "allocated block %#lx: not in the live map",
                      (unsigned long)b->ptr);
                CHECK(b->requested <= b->nbytes, "block %#lx: requested %zu > size %zu",
                      (unsigned long)b->ptr, b->requested, b->nbytes);
                alloc_n[k]++;
                alloc_b[k] += (int64_t)b->nbytes;
                req_b[k] += (int64_t)b->requested;
                active_n[k]++;
                active_b[k] += (int64_t)b->nbytes;
                if (b->tally) {
                    int t = 0;
                    while (t < ntallies && tallies[t] != b->tally) t++;
                    if (t == ntallies && ntallies < MAX_TALLIES) {
                        tallies[ntallies] = b->tally;
                        tallied[ntallies++] = 0;
                    }
                    if (t < ntallies) tallied[t]++;
                }
                break;
            case MP_BLOCK_PENDING:
                busy++;
                npending++;
                /* no events: a free deferred during a capture (Note [Graph capture]) */
                CHECK(b->nuses > 0, "pending block %#lx: no recorded streams", (unsigned long)b->ptr);
                CHECK(mp_ptrmap_get(&p->live, b->ptr) == NULL, "pending block %#lx: still live",
                      (unsigned long)b->ptr);
                CHECK(b->requested <= b->nbytes, "block %#lx: requested %zu > size %zu",
                      (unsigned long)b->ptr, b->requested, b->nbytes);
                req_b[k] += (int64_t)b->requested;   /* until the free completes, as PyTorch */
                for (uint16_t i = 0; b->events && i < b->nuses; i++)
                    nheld_events += b->events[i] != 0;   /* 0: synchronized instead */
                active_n[k]++;
                active_b[k] += (int64_t)b->nbytes;
                break;
            case MP_BLOCK_HOT:
                busy++;   /* its segment stays busy while it is parked */
                nhot++;
                CHECK(b->stream->hot == b && b->stream->hot_frees <= b->stream->frees,
                      "hot block %#lx: not its stream's hot block", (unsigned long)b->ptr);
                CHECK(!in_list(&b->stream->lists[seg->kind], b),
                      "hot block %#lx: in a free list", (unsigned long)b->ptr);
                CHECK(mp_ptrmap_get(&p->live, b->ptr) == b, "hot block %#lx: not in the pointer map",
                      (unsigned long)b->ptr);
                CHECK(b->requested == 0 && b->nuses == 0 && !b->split_counted,
                      "hot block %#lx: left with a request, uses or a split count",
                      (unsigned long)b->ptr);
                break;
            case MP_BLOCK_UNMAPPED:
                CHECK(seg->expandable, "block %#lx: unmapped in a plain segment", (unsigned long)b->ptr);
                CHECK(p->up.granularity && b->ptr % p->up.granularity == 0 &&
                          b->nbytes % p->up.granularity == 0,
                      "unmapped block %#lx: not page-aligned", (unsigned long)b->ptr);
                break;
            default:
                fail(&r, "block %#lx: unknown state %d", (unsigned long)b->ptr, b->state);
            }
        }
        CHECK(expect == seg->ptr + seg->nbytes, "segment %#lx: blocks cover %zu of %zu bytes",
              (unsigned long)seg->ptr, (size_t)(expect - seg->ptr), seg->nbytes);
        CHECK(busy == seg->nbusy, "segment %#lx: busy count %zu, counted %zu", (unsigned long)seg->ptr,
              seg->nbusy, busy);
        CHECK(mapped == seg->mapped_bytes, "segment %#lx: mapped %zu, counted %zu", (unsigned long)seg->ptr,
              seg->mapped_bytes, mapped);
        reserved_b[k] += (int64_t)mapped;
        if (seg->expandable && !r.failed) {
            char why[200];
            if (mp_expand_check_extents_locked(p, seg, why, sizeof why)) fail(&r, "%s", why);
        }
        int idle = 0;
        for (mp_segment *i = p->idle_head; i; i = i->inext) idle |= i == seg;
        CHECK(idle == (!seg->expandable && busy == 0), "segment %#lx: idle list membership wrong",
              (unsigned long)seg->ptr);
    }
    CHECK(nsegs == p->nsegments, "segment count %zu, counted %zu", p->nsegments, nsegs);
    CHECK(nhot == p->nhot, "hot blocks: %zu counted, %zu recorded", nhot, p->nhot);
    /* An mp_alloc_tallied that dropped the lock to grow counts before its block exists. */
    for (int t = 0; t < ntallies && !r.failed; t++)
        CHECK(tallies[t]->blocks >= tallied[t], "tally %p: %lld counted, %lld blocks carry it",
              (const void *)tallies[t], (long long)tallies[t]->blocks, (long long)tallied[t]);
    size_t idle_bytes = 0;
    for (mp_segment *i = p->idle_head; i; i = i->inext)
        if (!i->pinned) idle_bytes += i->nbytes;
    CHECK(idle_bytes == p->idle_bytes, "idle bytes %zu, counted %zu", p->idle_bytes, idle_bytes);
    if (bounds && !r.failed && nsegs) {
        qsort(bounds, nsegs, 2 * sizeof *bounds, cmp_uintptr);
        for (size_t i = 1; i < nsegs; i++)
            CHECK(bounds[2 * i] >= bounds[2 * i - 1], "segments overlap at %#lx", (unsigned long)bounds[2 * i]);
    }
    free(bounds);

    size_t list_count = 0, list_bytes = 0;
    for (size_t i = 0; i < p->nstreams; i++)
        for (int k = 0; k < 2; k++) {
            list_count += p->streams[i]->lists[k].count;
            list_bytes += p->streams[i]->lists[k].nbytes;
        }
    for (mp_stream *d = p->dead; d; d = d->next_dead)   /* Note [Forgotten streams] */
        for (int k = 0; k < 2; k++) {
            list_count += d->lists[k].count;
            list_bytes += d->lists[k].nbytes;
        }
    CHECK(list_count == nfree && list_bytes == free_bytes,
          "free lists hold %zu blocks / %zu bytes, segments %zu / %zu", list_count, list_bytes, nfree, free_bytes);
    CHECK(npending == p->npending, "pending list %zu, counted %zu", p->npending, npending);
    size_t nmarked = 0;
    for (mp_block *b = p->pending_head; b; b = b->fnext) {
        if (!b->markers) continue;
        nmarked++;
        CHECK(!b->events && b->nmarkers > 0, "pending block %#lx: markers with events or none",
              (unsigned long)b->ptr);
    }
    CHECK(nmarked == p->nmarked, "marked pending blocks %zu, counted %zu", p->nmarked, nmarked);
    /* Note [Events outside the lock]: every event made is cached or held by a pending free,
     * and the cache has room for all of them. */
    CHECK(p->nevent_cache + nheld_events == p->nevents && p->nevents <= p->cap_event_cache,
          "events: %zu made, %zu cached, %zu held by pending frees, room for %zu", p->nevents,
          p->nevent_cache, nheld_events, p->cap_event_cache);
    CHECK(p->live.count == (size_t)(alloc_n[1] + alloc_n[2]) + nhot,
          "live map holds %zu, counted %lld and %zu hot", p->live.count,
          (long long)(alloc_n[1] + alloc_n[2]), nhot);

    /* Note [Hot counters]: the pool's own mp_stats leaves the hot families to hot_stats. */
    for (int f = 0; f < MP_HOT_FAMILIES && !r.failed; f++) {
        const mp_stat *own = hot_family_in(&p->stats, f);
        for (int k = 0; k < MP_STAT_TYPES; k++)
            CHECK(!own[k].current && !own[k].peak && !own[k].allocated && !own[k].freed,
                  "hot family %d has counts in the pool's mp_stats", f);
    }
    mp_stats composed;
    mp_stats_compose_locked(p, &composed);
    const mp_stats *st = &composed;
    struct { const char *name; const mp_stat *stat; const int64_t *counted; } rows[] = {
        {"allocation", st->allocation, alloc_n}, {"allocated_bytes", st->allocated_bytes, alloc_b},
        {"requested_bytes", st->requested_bytes, req_b}, {"active", st->active, active_n},
        {"active_bytes", st->active_bytes, active_b}, {"inactive_split", st->inactive_split, split_n},
        {"inactive_split_bytes", st->inactive_split_bytes, split_b}, {"segment", st->segment, seg_n},
        {"reserved_bytes", st->reserved_bytes, reserved_b},
    };
    for (size_t i = 0; i < sizeof rows / sizeof rows[0] && !r.failed; i++) {
        for (int k = 1; k <= 2; k++)
            CHECK(rows[i].stat[k].current == rows[i].counted[k], "%s.%s.current is %lld, counted %lld",
                  rows[i].name, k == 1 ? "small_pool" : "large_pool", (long long)rows[i].stat[k].current,
                  (long long)rows[i].counted[k]);
        CHECK(rows[i].stat[0].peak >= mp_stat3_current(rows[i].stat),
              "%s.all.peak is %lld, below the current total %lld", rows[i].name,
              (long long)rows[i].stat[0].peak, (long long)mp_stat3_current(rows[i].stat));
    }
    /* Note [Shared limit]: every change of reserved-now bytes was published. */
    CHECK(p->limit_published == (int64_t)mp_reserved_now_locked(p),
          "published %lld reserved-now bytes for the limit, holds %zu",
          (long long)p->limit_published, mp_reserved_now_locked(p));
    mp_lock_release(&p->lock);
    return r.failed ? MP_EINVAL : MP_OK;
}

/* ---------------------------------------------------------------- layout */

int mp_layout_take(mp_pool *p, mp_layout *out) {
    memset(out, 0, sizeof *out);
    mp_lock_acquire(&p->lock);
    mp_hot_flush_locked(p);   /* Note [Hot blocks] */
    size_t nblocks = 0, nmaps = 0;
    for (mp_segment *s = p->segments; s; s = s->next) {
        for (mp_block *b = s->first; b; b = b->next) nblocks++;
        nmaps += s->nextents;
    }
    out->segments = malloc((p->nsegments + 1) * sizeof *out->segments);
    out->blocks = malloc((nblocks + 1) * sizeof *out->blocks);
    out->maps = malloc((2 * nmaps + 1) * sizeof *out->maps);
    if (!out->segments || !out->blocks || !out->maps) {
        mp_lock_release(&p->lock);
        mp_layout_free(out);
        return MP_ENOMEM;
    }
    size_t i = 0, j = 0;
    for (mp_segment *s = p->segments; s; s = s->next, i++) {
        mp_segment_view *v = &out->segments[i];
        v->ptr = s->ptr;
        v->nbytes = s->nbytes;
        v->mapped_bytes = s->mapped_bytes;
        v->stream = s->stream->handle;
        v->is_small = s->kind == KIND_SMALL;
        v->is_expandable = s->expandable;
        v->is_pinned = s->pinned;
        v->first_map = out->nmaps;
        v->nmaps = s->nextents;
        for (size_t k = 0; k < s->nextents; k++, out->nmaps++) {
            out->maps[2 * out->nmaps] = s->extents[k].ptr;
            out->maps[2 * out->nmaps + 1] = s->extents[k].nbytes;
        }
        v->first_block = j;
        for (mp_block *b = s->first; b; b = b->next, j++) {
            mp_block_view *bv = &out->blocks[j];
            bv->ptr = b->ptr;
            bv->nbytes = b->nbytes;
            bv->requested = b->requested;
            bv->last_requested = b->last_requested;
            bv->stream = b->stream->handle;
            bv->state = b->state;
        }
        v->nblocks = j - v->first_block;
    }
    out->nsegments = i;
    out->nblocks = j;
    mp_lock_release(&p->lock);
    return MP_OK;
}

void mp_layout_free(mp_layout *l) {
    free(l->segments);
    free(l->blocks);
    free(l->maps);
    memset(l, 0, sizeof *l);
}
