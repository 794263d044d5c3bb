/* Internal structures of the core, shared by its source files (the .c files of core/).
 * Everything here is guarded by mp_pool.lock unless a field says otherwise; functions named
 * *_locked expect it held. */
#ifndef MP_INTERNAL_H
#define MP_INTERNAL_H

#include <stdlib.h>
#include <string.h>

#include "mp_assert.h"
#include "mp_core.h"
#include "mp_freelist.h"
#include "mp_lock.h"
#include "mp_ptrmap.h"

enum { KIND_SMALL = 0, KIND_LARGE = 1 };

/* Branches off the round trip through a hot block: their code goes after it, so that the
 * instructions a round trip runs share as few lines as they can (Note [Hot lines]). */
#define MP_UNLIKELY(cond) __builtin_expect(!!(cond), 0)

/* Zeroed memory that starts on a cache line, for the structs of Note [Hot lines] (free it
 * with free()). */
static inline void *mp_calloc_lines(size_t nbytes) {
    void *mem = NULL;
    if (posix_memalign(&mem, 64, nbytes)) return NULL;
    return memset(mem, 0, nbytes);
}

typedef struct mp_stream mp_stream;
typedef struct mp_segment mp_segment;
typedef struct mp_block mp_block;

#define MP_INLINE_USES 2

/* Note [Hot lines]
 * Between two calls from an interpreter (torch.empty, cupy.empty), the cache lines an
 * allocation touched have mostly left the first-level caches, and each line missed costs
 * more than the instructions that use it. So an allocate + free through a hot block (Note
 * [Hot blocks]) is laid out to touch few lines:
 * - the pool's first line (its lock and the flags every call reads), its pointer map's
 *   header (the second) and the line of the configuration that holds the size policy;
 * - one line of the block (its fields in this struct's first line) and one of its stream;
 * - one line per counter family (Note [Hot counters]), and the pointer map's slot.
 * These structs start on a line (mp_calloc_lines, the block slabs). Branches that the round
 * trip does not take are marked MP_UNLIKELY, and the rest of an allocation is out of line
 * (alloc_from_lists_locked), so that its code too spans few lines; calls between the core's
 * functions bind inside the extension (setup.py). Counted with cachegrind on a compiled
 * round trip after the caches were emptied (bench/cold_lines.py, gcc 12): 26-27 lines of
 * data and 33 of code before, 13-14 and 29 after, at 512 B and 64 MiB. */
struct mp_block {
    /* The first line: every field an allocate or free through a hot block touches. */
    uintptr_t ptr;
    size_t nbytes;
    size_t requested;            /* bytes asked for; 0 unless allocated or pending */
    size_t last_requested;       /* bytes of the last request it served, kept once free: a
                                    merge keeps the freed block's (PyTorch's snapshot shows
                                    it as a free block's requested_size) */
    mp_stream *stream;           /* owner: the stream whose order makes reuse safe */
    mp_tally *tally;             /* allocated: counted there (Note [Block tallies]), or NULL */
    uint32_t cls;                /* size class while in a free list, else MP_NOT_LISTED */
    uint8_t state;               /* MP_BLOCK_* */
    uint8_t kind;                /* its segment's kind, KIND_SMALL or KIND_LARGE (set with
                                    the segment: mp_block_join) */
    uint8_t oversize;            /* allocated: counted in oversize_allocations (Note [Size
                                    policy at run time], mp_core.c) */
    uint8_t split_counted;       /* counted in inactive_split while free */
    uint16_t nuses;              /* streams recorded by record_stream (never the owner) */
    uint8_t busy;                /* unmapped: being mapped or unmapped with the lock dropped;
                                    pending: the freeing thread is synchronizing, without the
                                    lock, a stream it had no event for (events[i] == 0) */
    /* The rest: merges, lists, recorded streams. */
    mp_segment *seg;
    mp_block *prev, *next;       /* neighbours in address order within the segment */
    mp_block *fprev, *fnext;     /* free: bin links; pending: pending-list links */
    uint16_t cap_uses;
    mp_stream *inline_uses[MP_INLINE_USES];
    mp_stream **uses;            /* inline_uses, or a heap array when more are recorded */
    uintptr_t *events;           /* pending: one event per use, recorded at free */
    uintptr_t *markers;          /* pending, deferred during a capture: the capture's nodes
                                    its streams had reached at the free (Note [Capture
                                    reuse], mp_stream.c), or NULL */
    size_t nmarkers;
} __attribute__((aligned(64)));
_Static_assert(offsetof(struct mp_block, seg) <= 64,
               "Note [Hot lines]: a hot block's fields fit its first line");

struct mp_segment {
    uintptr_t ptr;
    size_t nbytes;               /* upstream size (address space for expandable) */
    size_t mapped_bytes;         /* == nbytes unless expandable */
    mp_stream *stream;           /* the stream it was allocated on; freed on it */
    int kind;
    int pinned;                  /* initial_pool_size: never released automatically */
    int expandable;
    int growing;                 /* expandable: some stream's growing range (expandable[kind]) */
    int ahead;                   /* Note [Mapper]: its edge wants stock (set by allocating
                                    threads, cleared by the mapper thread) */
    int oversize;                /* counted in oversize_segments (Note [Size policy at run
                                    time], mp_core.c) */
    mp_block *first;
    size_t nbusy;                /* allocated + pending blocks */
    mp_segment *prev, *next;     /* all segments */
    mp_segment *iprev, *inext;   /* idle list (nbusy == 0, not expandable), oldest first */
    uint64_t idle_since;
    /* Detached, on its way upstream (mp_release_list): the stream handle to free it on, and
     * for an expandable range the mapped runs to unmap (its blocks are gone by then). */
    uintptr_t release_stream;
    struct mp_run { uintptr_t ptr; size_t nbytes; } *release_runs;
    size_t nrelease_runs;
    /* Streams to synchronize first, where no event could be had to order the free after
     * their work (Note [Lock order]: never under the lock). */
    uintptr_t *release_sync;
    size_t nrelease_sync;
    /* Expandable: the physical allocations mapped in it, in address order, each unmapped only
     * whole (Note [Growth extents] in mp_expand.c). busy: being mapped or unmapped with the
     * lock dropped, inside a busy unmapped block. */
    struct mp_extent { uintptr_t ptr; size_t nbytes; int busy; } *extents;
    size_t nextents, cap_extents;
};

/* b becomes a block of seg, whose kind it keeps at hand (Note [Hot lines]). */
static inline void mp_block_join(mp_block *b, mp_segment *seg) {
    b->seg = seg;
    b->kind = (uint8_t)seg->kind;
}

/* Note [Hot blocks]: a freed block parked on its stream, unmerged and in no list, for the
 * next request of the same size there. Never seen outside the core: every view and every
 * release path folds hot blocks back first (mp_hot_flush_locked). */
#define MP_BLOCK_HOT 4

struct mp_stream {
    /* Note [Hot lines]: its first line is what a round trip through its hot block touches;
     * the struct starts on a line (mp_calloc_lines). */
    uintptr_t handle;
    mp_block *hot;               /* Note [Hot blocks]: at most one per stream */
    uint64_t frees;              /* frees completed into this stream's lists, ever */
    uint64_t hot_frees;          /* `frees` when `hot` was parked */
    /* Note [Streams without end] (mp_stream.c): links in the pool's list of streams that may
     * hold free or hot blocks, its place in `streams` (MP_STREAM_DEAD once forgotten), and
     * the mark of a sweep. */
    mp_stream *hprev, *hnext;
    uint32_t index;
    uint8_t holding;
    uint8_t mark;
    mp_freelist lists[2];        /* KIND_SMALL, KIND_LARGE */
    mp_segment *expandable[2];   /* the growing segment per kind, when expandable */
    mp_stream *next_dead;        /* in mp_pool.dead (Note [Forgotten streams]) */
} __attribute__((aligned(64)));

typedef struct mp_block_slab {
    struct mp_block_slab *next;
    mp_block blocks[];
} mp_block_slab;

/* Note [Hot counters]
 * The five counter families every allocate and free moves
 * (allocation, active, allocated_bytes, active_bytes, requested_bytes) live in the pool as
 * one line each (Note [Hot lines]), not in mp_stats' columns of three, where one family
 * spans two lines and a round trip's five touched eight to ten. A family keeps each pool's
 * current, peak and allocated counts and the `all` column's peak; a pool's freed count is
 * its allocated less its current plus freed_base (its current at the last reset of the
 * accumulated counts), and the `all` column's current, allocated and freed are the pools'
 * sums, as for every family (Note [Derived totals]). mp_stats_compose_locked writes them
 * into mp_stats' layout for every reader; the pool's own mp_stats keeps those five
 * families at zero, which check_invariants checks. */
enum {
    MP_HOT_ALLOCATION,
    MP_HOT_ACTIVE,
    MP_HOT_ALLOCATED_BYTES,
    MP_HOT_ACTIVE_BYTES,
    MP_HOT_REQUESTED_BYTES,
    MP_HOT_FAMILIES
};
typedef struct mp_hot_family {
    int64_t current[2];          /* by kind: KIND_SMALL, KIND_LARGE */
    int64_t peak[2];
    int64_t allocated[2];
    int64_t all_peak;
} __attribute__((aligned(64))) mp_hot_family;

struct mp_pool {
    /* Note [Hot lines]: the pool's first line holds what every allocate and free reads
     * besides the pointer map (the second line) and the configuration (the third). */
    mp_lock lock;
    int refcount;                /* atomic; not guarded by the lock */
    uint64_t tick;               /* advances on every alloc and free */
    size_t npending;             /* blocks in the pending list (pending_head) */
    size_t nhot;                 /* streams holding a hot block (Note [Hot blocks]) */
    mp_stream *last_stream;      /* one-entry cache for the stream lookup */
    /* Trace recording (mp_trace.c): NULL when off, so it costs one branch. The ring holds
     * trace_cap entries and grows to trace_max as events come (Note [A ring that grows]). */
    mp_trace_entry *trace;
    size_t nevent_cache;         /* events in event_cache (Note [Events outside the lock]) */

    mp_ptrmap live __attribute__((aligned(64)));   /* allocated blocks by address */
    int inherited;               /* Note [Pools across fork]: this process is a forked child
                                    of the pool's creator (on the map's line, which every
                                    allocate and free reads already) */
    mp_config cfg __attribute__((aligned(64)));
    mp_upstream up;
    size_t capacity;             /* device total as the upstream reports it */

    mp_stream **streams;         /* the streams in use; forget_stream frees one (Note
                                    [Forgotten streams]) */
    size_t nstreams, cap_streams;
    /* Note [Streams without end]: the streams by handle (open addressing, NULL when free),
     * those that may hold blocks, and the count of streams at which the next new one sweeps
     * away the idle ones. */
    mp_stream **stab;
    size_t stab_mask;
    mp_stream *holding;
    size_t sweep_at;
    /* Note [Forgotten streams]: operations that dropped the lock in their middle while
     * holding stream pointers, and the forgotten streams whose struct waits for them. */
    uint32_t nunlocked;
    mp_stream *dead;
    size_t ndead;
    /* Note [Threshold releases without a sync]: threshold checks still to skip, and the
     * skip that the next attempt finding only busy streams sets (doubling, reset by one
     * that releases). */
    uint32_t threshold_skip, threshold_backoff;   /* at most MP_THRESHOLD_BACKOFF_MAX */
    mp_segment *segments;        /* all segments */
    mp_segment *idle_head, *idle_tail;
    size_t idle_bytes;           /* in idle segments that are not pinned */
    size_t nsegments;
    mp_block *pending_head, *pending_tail;
    size_t nmarked;              /* pending blocks with capture markers (Note [Capture reuse]) */

    /* Note [Events outside the lock]: created events not in use; room for all `nevents`
     * the pool made, so that a put never grows it. */
    uintptr_t *event_cache;
    size_t cap_event_cache;
    size_t nevents;              /* made and not destroyed: in the cache or held by blocks */

    mp_block *spare_blocks;      /* block structs not in use (linked by fnext) */
    mp_block_slab *slabs;

    size_t inflight_bytes;       /* segments being allocated with the lock dropped */
    size_t releasing_bytes;      /* Note [Releases in flight] (mp_release.c): segments
                                    detached whose upstream free has not returned yet */
    int released_unwaited;       /* atomic; Note [The last try waits for the device] */
    int released_since_give_back; /* atomic; a plain segment was freed to the upstream since
                                     the last mp_give_back (Note [Giving back to the device]) */
    /* Note [Shared limit] (mp_release.c): the pool whose limit this one's reserved bytes
     * count against too (retained), or NULL; on a pool, the reserved-now bytes of it and of
     * every pool sharing its limit (atomic: members add to it under their own locks); and
     * what this pool has added to its own or its owner's limit_held so far. */
    mp_pool *limit_owner;
    int64_t limit_held;
    int64_t limit_published;
    int limit_members;           /* pools sharing this one's limit (atomic) */
    size_t reserved_high_water;  /* fixed segments: the most bytes ever reserved at once
                                    (Note [Reserved high water]; never reset) */
    size_t mapped_high_water;    /* expandable segments: the most bytes ever mapped at once
                                    (mp_expand.c; unlike the stats' peak, never reset) */
    size_t live_high_water;      /* the most bytes ever allocated at once, as of the last
                                    restart of the stats' peaks (mp_live_mark_locked) */
    size_t layout_release_mark;  /* Note [Layout records]: the live mark at the last release
                                    for a layout's record (one per live mark) */
    int captures;                /* Note [Graph capture]: mp_capture_begin less mp_capture_end */
    mp_stream *capture_seen;     /* Note [Graph capture]: the stream last found capturing */
    mp_hot_family hot_stats[MP_HOT_FAMILIES];   /* Note [Hot counters] */
    int64_t freed_base[MP_HOT_FAMILIES][2];
    mp_stats stats;              /* the other counters (Note [Hot counters]) */
    int64_t closed_peak[MP_NSTATS];   /* Note [Peak windows]: peaks of closed windows */

    /* Note [Mapper] (mp_expand_mapper.c): the thread that maps ahead of growth and unmaps
     * behind the release threshold, made at its first use (the pointer is set under the
     * lock; NULL without one). */
    struct mp_mapper *mapper;
    uint8_t keep_struct;         /* mp_pool_keep_struct: destroy leaves the struct */
    /* Note [Pools across fork] (mp_fork.c): the process that made the pool, and its links
     * in the registry of live pools (guarded by the registry's mutex). */
    long creator_pid;
    mp_pool *reg_prev, *reg_next;

    size_t trace_cap, trace_len, trace_head, trace_max;   /* the ring of `trace` (above) */
    /* Note [Sharing across processes] (mp_share.c): the regions of other pools (any
     * process) this pool has open, by their handle's bytes, each counted. */
    struct mp_share_open *share_opens;
    size_t nshare_opens, cap_share_opens;
};

/* mp_freelist.h's list operations, here where the block is defined. */
static inline void mp_freelist_insert(mp_freelist *fl, mp_block *b) {
    uint32_t c = mp_class_of(b->nbytes);
    b->cls = c;
    b->fprev = NULL;
    b->fnext = fl->head[c];
    if (b->fnext) b->fnext->fprev = b;
    fl->head[c] = b;
    fl->bits[c >> 6] |= 1ull << (c & 63);
    fl->summary |= 1ull << (c >> 6);
    fl->count++;
    fl->nbytes += b->nbytes;
}

static inline void mp_freelist_remove(mp_freelist *fl, mp_block *b) {
    uint32_t c = b->cls;
    if (b->fprev) b->fprev->fnext = b->fnext;
    else fl->head[c] = b->fnext;
    if (b->fnext) b->fnext->fprev = b->fprev;
    if (!fl->head[c]) {
        fl->bits[c >> 6] &= ~(1ull << (c & 63));
        if (!fl->bits[c >> 6]) fl->summary &= ~(1ull << (c >> 6));
    }
    b->fprev = b->fnext = NULL;
    b->cls = MP_NOT_LISTED;
    fl->count--;
    fl->nbytes -= b->nbytes;
}


/* mp_freelist.c: a block into and out of its owner's list, with the split counters. */
void mp_insert_free_locked(mp_pool *p, mp_block *b);   /* no merging */
void mp_remove_free_locked(mp_pool *p, mp_block *b);
mp_block *mp_freelist_find_fit(const mp_pool *p, const mp_freelist *fl, size_t size);

/* mp_core.c */
int mp_reserve_initial(mp_pool *p, size_t nbytes);
mp_block *mp_search_lists_locked(mp_pool *p, mp_stream *s, int kind, size_t size);
size_t mp_reserved_now_locked(const mp_pool *p);
/* Note [Shared limit]: publish a change of reserved-now bytes to the pool whose limit
 * counts them (call after every change of reserved_bytes or inflight_bytes), and the bytes
 * by which `extra` more would pass this pool's limit or the limit it shares (0: none). */
void mp_publish_held_locked(mp_pool *p);
size_t mp_limit_excess_locked(mp_pool *p, size_t extra);
void mp_sync_pending_unlocked(mp_pool *p);
/* Note [Blocking upstream calls]: around each upstream call made without the lock that may
 * block. */
extern mp_blocking_begin_fn mp_blocking_begin_hook;
extern mp_blocking_end_fn mp_blocking_end_hook;
static inline void *mp_blocking_begin(void) {
    return mp_blocking_begin_hook ? mp_blocking_begin_hook() : NULL;
}
static inline void mp_blocking_end(void *state) {
    if (mp_blocking_end_hook) mp_blocking_end_hook(state);
}
/* mp_block.c (the rest of its interface is in mp_block.h) */
mp_block *mp_block_new_locked(mp_pool *p);
void mp_block_delete_locked(mp_pool *p, mp_block *b);
void mp_free_block_locked(mp_pool *p, mp_block *b);
void mp_insert_free_merged_locked(mp_pool *p, mp_block *b);
/* mp_stream.c (the rest of its interface is in mp_stream.h) */
/* Note [Events outside the lock]: get takes a cached event and never makes one (MP_ENOTREADY
 * when the cache is empty); stock makes them with the lock dropped, until the cache holds
 * `want` (MP_OK: all made; the caller starts its lookup again, since the pool may have
 * changed, and another thread may have drawn on them meanwhile). */
int mp_event_get_locked(mp_pool *p, uintptr_t *ev);
void mp_event_put_locked(mp_pool *p, uintptr_t ev);
int mp_event_stock_locked(mp_pool *p, size_t want);
#define MP_EVENT_TRIES 3   /* stockings before a path takes its fallback (another thread
                              may draw on the cache while the lock is dropped) */
mp_stream *mp_stream_lookup_locked(mp_pool *p, uintptr_t handle);
/* Note [Streams without end]: s may hold blocks from now on (in the pool's `holding` list). */
void mp_stream_hold_locked(mp_pool *p, mp_stream *s);
#define MP_STREAM_DEAD UINT32_MAX   /* mp_stream.index of a forgotten stream kept in `dead` */
/* The pool's struct for a stream handle, created on first use (NULL: out of host memory).
 * Inline for its one-entry cache: every allocation asks. */
static inline mp_stream *mp_stream_get_locked(mp_pool *p, uintptr_t handle) {
    if (p->last_stream && p->last_stream->handle == handle) return p->last_stream;
    return mp_stream_lookup_locked(p, handle);
}
/* Note [Forgotten streams]: drop the lock in the middle of an operation that keeps stream
 * pointers across it, and take it back. */
static inline void mp_lock_drop(mp_pool *p) {
    p->nunlocked++;
    mp_lock_release(&p->lock);
}
static inline void mp_lock_retake(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    p->nunlocked--;
}

/* Upstream stream and event calls, counted (mp_stats.num_stream_syncs ...). The count is a
 * relaxed atomic add: some are made without the lock. */
static inline void mp_count_call(uint64_t *counter) {
    __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
}
static inline int mp_up_sync(mp_pool *p, uintptr_t stream) {
    mp_count_call(&p->stats.num_stream_syncs);
    return p->up.stream_synchronize(p->up.ctx, stream);
}
/* The caller checks that the upstream has stream_query. */
static inline int mp_up_query(mp_pool *p, uintptr_t stream) {
    mp_count_call(&p->stats.num_stream_queries);
    return p->up.stream_query(p->up.ctx, stream);
}
static inline int mp_up_record(mp_pool *p, uintptr_t ev, uintptr_t stream) {
    mp_count_call(&p->stats.num_event_records);
    return p->up.event_record(p->up.ctx, ev, stream);
}
/* Note [Events outside the lock]: never with the pool lock held (the debug build checks). */
static inline int mp_up_event_create(mp_pool *p, uintptr_t *ev) {
    mp_assert(!mp_lock_held_by_me(&p->lock));
    return p->up.event_create(p->up.ctx, ev);
}

/* The high-water rules (Note [Expandable segments], Note [Reserved high water]) act only
 * on this much idle memory, and 1/MP_HIGH_WATER_IDLE_DIV of the mark: few releases. */
#define MP_HIGH_WATER_MIN_IDLE ((size_t)32 << 20)
#define MP_HIGH_WATER_IDLE_DIV 128
/* Note [Large growths] in mp_expand.c: a growth of at least 1/MP_HIGH_WATER_LARGE_DIV of
 * the mark and MP_HIGH_WATER_LARGE_MIN releases whatever is idle, with no floor. */
#define MP_HIGH_WATER_LARGE_DIV 8
#define MP_HIGH_WATER_LARGE_MIN ((size_t)256 << 20)
/* Note [Layout records] in mp_expand.c: a growth past the mapped mark while live bytes set
 * no record releases only with 1/MP_LAYOUT_IDLE_DIV of the mark idle, once for each live
 * mark, unless it would map more than 1/MP_LAYOUT_SLACK_DIV beyond the live mark. */
#define MP_LAYOUT_IDLE_DIV 64
#define MP_LAYOUT_SLACK_DIV 8

/* The limit the pool's growths answer to: its own, or its owner's under Note [Shared limit]
 * (mp_release.c), whichever is smaller; MP_UNLIMITED for none. What a limit turns off
 * (rounded segments, min_map_size, whole growth extents) it turns off under either. */
static inline size_t mp_effective_limit(const mp_pool *p) {
    size_t limit = p->cfg.limit;
    if (p->limit_owner) {
        size_t owner = __atomic_load_n(&p->limit_owner->cfg.limit, __ATOMIC_RELAXED);
        if (owner < limit) limit = owner;
    }
    return limit;
}

/* The reserved bytes above which a growth first gives idle memory back: that fraction
 * (garbage_collection_threshold) of the limit, else of the capacity; SIZE_MAX when it is
 * off (no threshold, or nothing to take a fraction of). */
static inline size_t mp_gc_threshold_bytes(const mp_pool *p) {
    size_t limit = mp_effective_limit(p);
    size_t base = limit != MP_UNLIMITED ? limit : p->capacity;
    if (!(p->cfg.gc_threshold > 0) || !base) return SIZE_MAX;
    return (size_t)(p->cfg.gc_threshold * (double)base);
}

/* The most bytes ever allocated at once: unlike the stats' peak, never reset. */
static inline size_t mp_live_mark_locked(const mp_pool *p) {
    size_t peak = (size_t)p->hot_stats[MP_HOT_ALLOCATED_BYTES].all_peak;
    return peak > p->live_high_water ? peak : p->live_high_water;
}

/* Note [Threshold releases without a sync]: the most threshold checks skipped in a row. */
#define MP_THRESHOLD_BACKOFF_MAX 64

/* mp_release.c: detach idle segments under the lock, free them upstream after. */
typedef struct mp_release_list {
    mp_segment *head;
    size_t nbytes;
    /* Note [Graph capture]: the stream of the alloc or free the list belongs to (NULL for
     * calls that have none), and whether it captures: 0 not asked yet, 1 no, 2 yes. */
    mp_stream *stream;
    int capture;
    /* Note [The last try waits for the device] (mp_core.c): the caller waits for the
     * streams of these segments right after they go (a growth does), so nothing they held
     * stays the device's. */
    int waited;
    /* Note [Releases in flight]: the bytes of this list counted in releasing_bytes. */
    size_t counted;
} mp_release_list;
/* Reserved-now bytes less the caller's own detached segments (`own`, may be NULL): those go
 * upstream before anything the caller asks of the upstream, so the caller's policy (the
 * limit, the garbage collection threshold, the high water mark) does not count them; other
 * threads' releases in flight still count (Note [Releases in flight], mp_release.c). */
static inline size_t mp_reserved_now_own_locked(const mp_pool *p, const mp_release_list *own) {
    return mp_reserved_now_locked(p) - (own ? own->counted : 0);
}
/* Note [Forgotten streams]: detach an expandable range that holds nothing but unmapped pages
 * and free blocks of `only` (NULL: of nobody): its mapped runs are unmapped and its address
 * space released by mp_release_finish. 0 when it holds anything else (nothing changes). */
int mp_expand_detach_range_locked(mp_pool *p, mp_segment *seg, mp_stream *only, mp_release_list *out);
void mp_detach_segment_locked(mp_pool *p, mp_segment *s, mp_release_list *out);
/* Release cached memory until at least `target` bytes are released or nothing releasable is
 * left: idle segments oldest first (pinned ones never), then free pages of expandable
 * segments. Returns the bytes released. May drop and retake the lock (expandable pages, an
 * event to make: Note [Events outside the lock]). */
size_t mp_release_idle_locked(mp_pool *p, size_t target, mp_release_list *out);
/* Release idle segments of one kind (small/large), oldest first, at least `target` bytes,
 * but only when that kind's idle segments hold that much: "release beyond need"; target 0:
 * all of them. May drop and retake the lock (an event to make). */
size_t mp_release_idle_kind_locked(mp_pool *p, int kind, size_t target, mp_release_list *out);
/* Note [Releases in flight] (mp_release.c): mp_limit_excess_locked for a caller whose own detached
 * segments (`own`) go upstream before anything it asks of the upstream; and the wait for
 * other threads' releases after a refusal (1: one returned: ask again). */
size_t mp_limit_excess_own_locked(mp_pool *p, size_t extra, const mp_release_list *own);
int mp_wait_releases_locked(mp_pool *p, mp_release_list *own);
#define MP_RELEASE_WAITS 64   /* waits of one request, each for another thread's release */
/* Add h to the distinct handles (*v)[0 .. *n), growing the array (0: no host memory, the
 * array as it was); and the distinct streams the fixed segments of a list are freed on. */
int mp_add_distinct_handle(uintptr_t **v, size_t *n, size_t *cap, uintptr_t h);
uintptr_t *mp_release_streams(const mp_release_list *rel, size_t *n);
void mp_release_finish_slow(mp_pool *p, mp_release_list *list);
/* Free what was detached, upstream; call WITHOUT the lock. Inline: usually nothing to do. */
static inline void mp_release_finish(mp_pool *p, mp_release_list *list) {
    if (MP_UNLIKELY(list->head)) mp_release_finish_slow(p, list);
}
int mp_process_pending_locked(mp_pool *p);
/* Note [Capture reuse] (mp_stream.c): complete the pending frees of s that its capture now
 * orders after every use. */
void mp_capture_reclaim_locked(mp_pool *p, mp_stream *s);
void mp_apply_release_threshold_slow_locked(mp_pool *p, mp_release_list *out);
static inline void mp_apply_release_threshold_locked(mp_pool *p, mp_release_list *out) {
    if (MP_UNLIKELY(p->cfg.release_threshold != MP_UNLIMITED))
        mp_apply_release_threshold_slow_locked(p, out);
}
void mp_segment_idle_push_locked(mp_pool *p, mp_segment *s);
void mp_segment_idle_remove_locked(mp_pool *p, mp_segment *s);

/* Note [Pools across fork]: take the lock of a pool that this process may use; 0, with the
 * lock not held, for a pool inherited through fork (the entry point fails with MP_EFORKED). */
int mp_lock_refuse_inherited(mp_pool *p);   /* mp_fork.c: releases the lock, returns 0 */
static inline int mp_lock_own(mp_pool *p) {
    mp_lock_acquire(&p->lock);
    /* The refusal is out of line: the allocate/free path keeps one compare of a field on a
     * line it reads anyway (Note [Hot lines]). */
    if (MP_UNLIKELY(p->inherited)) return mp_lock_refuse_inherited(p);
    return 1;
}
/* mp_fork.c: Note [Pools across fork]. Register a new pool (and, once per process, the
 * fork handlers); take it out of the registry at its destroy. */
void mp_fork_register(mp_pool *p);
void mp_fork_unregister(mp_pool *p);

/* mp_share.c: close every region still open, at the pool's destroy (no lock held). */
void mp_share_close_all(mp_pool *p);

/* mp_trace.c */
void mp_trace_record_locked(mp_pool *p, int action, uintptr_t ptr, size_t nbytes,
                            uintptr_t stream);
static inline void mp_trace_locked(mp_pool *p, int action, uintptr_t ptr, size_t nbytes,
                                   uintptr_t stream) {
    if (MP_UNLIKELY(p->trace)) mp_trace_record_locked(p, action, ptr, nbytes, stream);
}

/* Note [Segment observer] (mp_core.h): segment events go to the trace and the observer. */
extern mp_segment_observer mp_observer_fn;   /* atomic */
extern void *mp_observer_ctx;
static inline int mp_segment_events_wanted(const mp_pool *p) {
    return p->trace || __atomic_load_n(&mp_observer_fn, __ATOMIC_ACQUIRE);
}
static inline void mp_trace_segment_locked(mp_pool *p, int action, uintptr_t ptr,
                                           size_t nbytes, uintptr_t stream) {
    mp_trace_locked(p, action, ptr, nbytes, stream);
    mp_segment_observer fn = __atomic_load_n(&mp_observer_fn, __ATOMIC_ACQUIRE);
    if (fn) fn(mp_observer_ctx, p, action, ptr, nbytes, stream);
}

/* Note [Release observer] (mp_core.h): called with no lock held, before the upstream frees. */
extern mp_release_observer mp_release_observer_fn;   /* atomic */
extern void *mp_release_observer_ctx;
static inline void mp_tell_release_observer(mp_pool *p) {
    mp_release_observer fn = __atomic_load_n(&mp_release_observer_fn, __ATOMIC_ACQUIRE);
    if (fn) fn(mp_release_observer_ctx, p);
}

/* Note [Derived totals]
 * PyTorch's statistics come in families (allocation, active, allocated_bytes, ...), each
 * with an `all`, a `small_pool` and a `large_pool` column of current, peak, allocated and
 * freed. A round trip moves five families twice, and updating both `all` and the pool's
 * column made most of a round trip's stores. The core keeps only the pool columns and
 * `all`'s peak (checked against the pools' sum at each increase, so it is exact); `all`'s
 * current, allocated and freed are filled in from the two pools when the stats are read
 * (fill_totals in mp_inspect.c), and code that needs a total reads mp_stat3_current.
 * check_invariants checks that each `all` peak is at least the current total. */

/* Stats helpers. A single counter moves as it goes (mp_stat_inc/dec). A family of three,
 * [all, small, large] (mp_stat3_*), moves in its pool's column only, and its `all` column
 * keeps just its peak here: its current, allocated and freed are the sums of the two pools,
 * filled in when the stats are read (Note [Derived totals]), so an update stores half as
 * much on the hot path. Read a family's current total with mp_stat3_current. */
static inline void mp_stat_inc(mp_stat *s, int64_t n) {
    s->current += n;
    if (s->current > s->peak) s->peak = s->current;
    s->allocated += n;
}
static inline void mp_stat_dec(mp_stat *s, int64_t n) {
    s->current -= n;
    s->freed += n;
}
static inline int64_t mp_stat3_current(const mp_stat *s) {
    return s[MP_STAT_SMALL].current + s[MP_STAT_LARGE].current;
}
static inline void mp_stat3_inc(mp_stat *s, int kind, int64_t n) {
    mp_stat_inc(&s[kind == KIND_SMALL ? MP_STAT_SMALL : MP_STAT_LARGE], n);
    int64_t all = mp_stat3_current(s);
    if (all > s[MP_STAT_ALL].peak) s[MP_STAT_ALL].peak = all;
}
static inline void mp_stat3_dec(mp_stat *s, int kind, int64_t n) {
    mp_stat_dec(&s[kind == KIND_SMALL ? MP_STAT_SMALL : MP_STAT_LARGE], n);
}

/* Note [Hot counters]: a family of mp_hot_family moves by n in one pool (`kind`). */
static inline void mp_hot_inc(mp_pool *p, int family, int kind, int64_t n) {
    mp_hot_family *f = &p->hot_stats[family];
    int64_t current = f->current[kind] += n;
    if (current > f->peak[kind]) f->peak[kind] = current;
    f->allocated[kind] += n;
    int64_t all = f->current[KIND_SMALL] + f->current[KIND_LARGE];
    if (all > f->all_peak) f->all_peak = all;
}
static inline void mp_hot_dec(mp_pool *p, int family, int kind, int64_t n) {
    p->hot_stats[family].current[kind] -= n;
}
static inline int64_t mp_hot_current(const mp_pool *p, int family) {
    return p->hot_stats[family].current[KIND_SMALL] + p->hot_stats[family].current[KIND_LARGE];
}
/* mp_inspect.c: every counter in mp_stats' layout, the hot families included, with the
 * `all` columns holding only their peaks (Note [Derived totals]). */
void mp_stats_compose_locked(const mp_pool *p, mp_stats *out);

/* mp_inspect.c: the calling thread's OOM record (mp_oom_take), filled at the failure point. */
__attribute__((cold)) void mp_oom_record_locked(mp_pool *p, int code, size_t nbytes,
                                               size_t rounded, uintptr_t stream);

/* Note [Hot blocks]: free every parked block as the plain free path would have. */
void mp_hot_flush_locked(mp_pool *p);

#endif
