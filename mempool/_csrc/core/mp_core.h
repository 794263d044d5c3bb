/* The allocator core: the C data plane behind mempool.Pool.
 *
 * Vocabulary: an upstream gives segments; a segment is split into blocks; free blocks live in
 * per-stream free lists. Sizes are bytes. Every function returns an MP_* code from
 * mp_upstream.h and never needs the GIL; each takes the pool's own lock (the caller must not
 * hold it). docs/architecture.md draws the layers; the design notes are beside the code they govern.
 */
#ifndef MP_CORE_H
#define MP_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "mp_size.h"   /* the size policy: MP_MIN_BLOCK, rounding, classes */
#include "mp_upstream.h"

#define MP_MAX_RECORDED_STREAMS 32768            /* record_stream: streams per block */

/* The core's own error code beyond mp_upstream.h's: the pool was made by another process,
 * of which this one is a forked child (Note [Pools across fork], mp_fork.c). */
#define MP_EFORKED 12

typedef struct mp_config {
    /* The fields every allocate and free reads come first, on one line with the divisions
     * of requests under 64 MiB (Note [Hot lines] in mp_internal.h). */
    size_t max_split_size;       /* MP_UNLIMITED = split every block */
    size_t release_threshold;    /* cached bytes kept; MP_UNLIMITED = keep all */
    /* Power-of-two rounding divisions per size interval, as PyTorch's
     * roundup_power2_divisions (mp_round_with in mp_size.h). */
    size_t roundup_divisions[MP_ROUNDUP_INTERVALS];
    int cross_stream_reuse;      /* take other streams' free blocks through an event wait */
    size_t segment_round;        /* every fixed segment a multiple of this, a small one
                                    exactly one; 0 = plain (Note [Segment rounding]) */
    size_t limit;                /* cap on reserved bytes; MP_UNLIMITED = none */
    size_t initial_pool_size;    /* reserved at creation and never released automatically */
    double gc_threshold;         /* 0 = off; else fraction of limit (or capacity) */
    int expandable_segments;
    size_t expandable_reserve;   /* address space per expandable segment; 0 = from capacity */
    size_t max_map_size;         /* expandable: most bytes one physical allocation of a growth
                                    holds (rounded down to pages); 0 = MP_DEFAULT_MAX_MAP, or
                                    one page under a limit */
    size_t min_map_size;         /* expandable: the least bytes a growth at a range's edge
                                    maps (rounded up to pages); 0 = what the request needs.
                                    Not under a limit (Note [Edge growth] in mp_expand.c) */
    int capture_reuse;           /* a free with recorded streams during a graph capture is
                                    reused within it once the capture orders it (PyTorch's
                                    graph_capture_record_stream_reuse; Note [Capture reuse]
                                    in mp_stream.c) */
    int keep_idle;               /* give no idle segment back on its own: only mp_empty_cache,
                                    mp_trim, the release threshold and an out-of-memory retry
                                    release (Note [Keep idle], mp_core.c) */
    int no_split;                /* hand out free blocks whole, never split (Note [No split],
                                    mp_core.c); set with mp_set_no_split */
    size_t map_ahead;            /* expandable: the free bytes a mapper thread keeps mapped at
                                    the end of each growing range; 0 = no mapper (Note
                                    [Mapper] in mp_expand_mapper.c) */
} mp_config;

/* Expandable segments: the most bytes one physical allocation of a growth holds unless
 * max_map_size says (Note [Growth extents] in mp_expand.c). */
#define MP_DEFAULT_MAX_MAP ((size_t)1 << 30)

void mp_config_default(mp_config *cfg);

enum { MP_STAT_ALL = 0, MP_STAT_SMALL = 1, MP_STAT_LARGE = 2, MP_STAT_TYPES = 3 };

typedef struct mp_stat {
    int64_t current, peak, allocated, freed;
} mp_stat;

/* Counters with the meaning of PyTorch's memory_stats() key families. */
typedef struct mp_stats {
    mp_stat allocation[MP_STAT_TYPES];        /* allocated blocks */
    mp_stat segment[MP_STAT_TYPES];           /* segments reserved from the upstream */
    mp_stat active[MP_STAT_TYPES];            /* allocated + pending-free blocks */
    mp_stat inactive_split[MP_STAT_TYPES];    /* free blocks that are part of a split segment */
    mp_stat allocated_bytes[MP_STAT_TYPES];
    mp_stat reserved_bytes[MP_STAT_TYPES];
    mp_stat active_bytes[MP_STAT_TYPES];
    mp_stat inactive_split_bytes[MP_STAT_TYPES];
    mp_stat requested_bytes[MP_STAT_TYPES];
    mp_stat oversize_allocations;             /* allocations >= max_split_size */
    mp_stat oversize_segments;
    mp_stat mapped_bytes;                     /* expandable segments: physically backed */
    mp_stat va_reserved_bytes;                /* expandable segments: address space */
    uint64_t num_alloc_retries;
    uint64_t num_ooms;
    uint64_t num_sync_all_streams;
    uint64_t num_device_alloc;
    uint64_t num_device_free;
    uint64_t num_cross_stream_reuse;          /* blocks taken from another stream */
    uint64_t num_event_waits;
    uint64_t num_streams;                     /* streams the pool keeps state for now */
    /* Upstream calls besides segments and maps (num_device_alloc/free), for replays and
     * docs/expandable.md's counts per step. */
    uint64_t num_stream_syncs;
    uint64_t num_event_records;
    uint64_t num_stream_queries;
    /* Note [Mapper] (mp_expand_mapper.c): physical allocations the mapper thread mapped
     * ahead of growth and unmapped behind the release threshold (num_device_alloc and
     * num_device_free count them too). */
    uint64_t num_ahead_maps;
    uint64_t num_behind_unmaps;
} mp_stats;

typedef struct mp_pool mp_pool;

/* Create a pool over `up` (copied; the pool owns it and calls up->destroy at the end).
 * Fails with MP_EINVAL for an inconsistent config, MP_ENOMEM when initial_pool_size cannot
 * be reserved (the upstream is then destroyed too). */
int mp_pool_create(const mp_config *cfg, const mp_upstream *up, mp_pool **out);
/* Free every cached segment and event and the pool itself. Live blocks are released with
 * their segments: call only when nothing uses the pool's memory. */
void mp_pool_destroy(mp_pool *p);
/* Reference counting, for owners that outlive the Python Pool object (DLPack capsules, the
 * PyTorch device table): mp_pool_create returns one reference; mp_pool_release drops one
 * and destroys the pool at zero. Both are safe from any thread, without the GIL. */
void mp_pool_retain(mp_pool *p);
void mp_pool_release(mp_pool *p);
/* Note [Pools across fork] (mp_fork.c): the id of the process that made the pool when the
 * caller is a forked child of it (every other call on the pool then fails with MP_EFORKED,
 * and its destroy gives nothing back), else 0. No lock. */
long mp_pool_inherited(const mp_pool *p);

/* Note [Blocking upstream calls]
 * A segment allocation can take tens of microseconds when the driver maps new memory, a
 * release or empty_cache may synchronize streams, and under a tool such as compute-
 * sanitizer driver calls take far longer. A Pool method making these calls while holding
 * the GIL would stop every other Python thread meanwhile (CuPy's own cudaMalloc and
 * cudaFree release it).
 *
 * The core stays free of Python: a binding that holds an interpreter lock installs these
 * hooks once, before any pool exists. The core calls begin() just before an upstream call
 * it makes without its own lock that may block (segment allocation and release, stream
 * synchronization, page map and unmap, event creation and address reservation:
 * Note [Events outside the lock]) and end() with what begin() returned just after, in the
 * same thread; never around the event records, queries and waits made under the lock, and
 * never with the lock held, so the order "GIL, then pool lock" of Note [Lock order] holds:
 * a thread waiting for the GIL back holds no pool lock. NULL hooks (the default): nothing
 * is called. The pairs may nest (a release before a growth, inside the growth's pair).
 *
 * The binding's hooks let the GIL go only in a thread that marked itself: Pool.alloc, free,
 * malloc (the CuPy hook), trim, empty_cache, forget_stream and _capture_end set a
 * thread-local mark around their core call (an initial-exec TLS store, free on the hot path);
 * an inner pair finds the mark cleared and does nothing. The PyTorch entry points, DLPack
 * deleters and deallocators do not mark: they may run without the GIL, or where giving it up
 * is not theirs to decide. The simulated device can hold segment allocations
 * (device.hold_allocs), syncs and event creations: tests/core/test_blocking_upstream.py and
 * tests/core/test_events_outside_lock.py check that another thread runs Python, and allocates from
 * the same pool, while a call waits there. */
typedef void *(*mp_blocking_begin_fn)(void);
typedef void (*mp_blocking_end_fn)(void *state);
void mp_set_blocking_hooks(mp_blocking_begin_fn begin, mp_blocking_end_fn end);

int mp_alloc(mp_pool *p, size_t nbytes, uintptr_t stream, uintptr_t *out);
/* Note [Block tallies]
 * A client that hands a pool's blocks on and must know when none is out (PyTorch's device
 * table, mp_torch.c) keeps a tally of them in its own memory: the core has no field or
 * function for any one client. The count must move under the pool's lock, together with the
 * block, or a pool could leave the table between a block's allocation and its count; an
 * atomic of the client's own would cost every allocate/free pair two atomic adds more (docs/decisions.md).
 * So the core moves it:
 * mp_alloc_tallied is mp_alloc that counts the block in *t from before it looks for memory
 * (the lock may be dropped to grow) until its free (mp_free, whoever calls it; after its
 * last touch of the pool when a release follows the unlock), and refuses with MP_ERETIRED
 * once t is closed. mp_tally_close closes t (MP_EBUSY while it counts anything);
 * mp_tally_blocks reads it. The fields are guarded by the lock of the one pool t is used
 * with; check_invariants checks that each tally counts at least the blocks that carry it. */
typedef struct mp_tally {
    int64_t blocks;   /* live blocks allocated through the tally, and allocations in flight */
    int closed;       /* mp_alloc_tallied refuses */
} mp_tally;
int mp_alloc_tallied(mp_pool *p, size_t nbytes, uintptr_t stream, mp_tally *t, uintptr_t *out);
int mp_tally_close(mp_pool *p, mp_tally *t);
int64_t mp_tally_blocks(mp_pool *p, const mp_tally *t);
/* From now on mp_pool_destroy frees everything but the pool's struct, which stays, with a
 * working lock, for a caller that read the pool's address from a table just before it was
 * taken out (its tally closed) and so only finds its allocation refused. Once per pool. */
void mp_pool_keep_struct(mp_pool *p);
/* Allocate the free memory at [ptr, ptr + nbytes) on `stream` (Note [Allocation at an
 * address]): MP_ENOTFOUND when no segment of the pool holds ptr, MP_EBUSY when that memory is
 * not free, MP_EINVAL for a pointer not 512-byte aligned. The block may be larger than
 * nbytes where the size policy does not split off the rest. */
int mp_alloc_at(mp_pool *p, uintptr_t ptr, size_t nbytes, uintptr_t stream);
/* Free a live block. `stream` is where it was last used when has_stream, else the stream it
 * was allocated on (or last freed to). MP_ENOTFOUND / MP_EINTERIOR / MP_EDOUBLEFREE for a
 * pointer that is not the start of a live block; nothing changes then. */
int mp_free(mp_pool *p, uintptr_t ptr, uintptr_t stream, int has_stream);
/* Declare that a live block is used on `stream` too: at free it waits for that stream. */
int mp_record_stream(mp_pool *p, uintptr_t ptr, uintptr_t stream);
/* Before a stream the pool has used is destroyed: wait for its queued work, then hand every
 * block and segment the pool keeps on it to the legacy stream (0), so that no later call is
 * made on the dead handle. Handle 0 and unknown handles are a no-op. */
int mp_forget_stream(mp_pool *p, uintptr_t stream);
/* CUDA graph capture (Note [Graph capture], mp_capture.h). The core finds a
 * capture on the streams a call involves by itself (the upstream's stream_capturing); a
 * capture on a stream it does not involve, made by another thread in CUDA's global capture
 * mode, also forbids its syncs, queries and frees, and only the caller knows of it: call
 * mp_capture_begin before such a capture starts and mp_capture_end after it has ended.
 * They count (captures nest or overlap); while the count is above 0 the pool releases
 * nothing, makes no stream sync, event query or cross-stream reuse, and defers frees with
 * recorded streams. mp_capture_end with no capture begun: MP_EINVAL, nothing changes.
 * mp_capture_active: 1 while the count is above 0 or `stream` captures, else 0.
 * mp_capture_known: 1 while the count is above 0 or any stream the pool uses captures (asked
 * of the upstream, stream by stream), else 0: for callers about to make a call of their own
 * that a capture refuses (the Pool's cudaMemPool trim after empty_cache). */
int mp_capture_begin(mp_pool *p);
int mp_capture_end(mp_pool *p);
int mp_capture_active(mp_pool *p, uintptr_t stream);
int mp_capture_known(mp_pool *p);
/* Size and stream of a live block (MP_ENOTFOUND otherwise). */
int mp_block_info(mp_pool *p, uintptr_t ptr, size_t *nbytes, size_t *requested,
                  uintptr_t *stream);

/* Sharing blocks with other processes (Note [Sharing across processes], core/mp_share.c).
 * mp_share: the handle of the memory holding the live block at ptr, for another process:
 *   at most cap bytes into buf, the length in *len (MP_EINVAL with *len the length needed
 *   when cap is too small), and in *offset where the block starts in the memory the handle
 *   maps. Blocks of one segment (one run of pages) give equal handles. MP_ENOTFOUND,
 *   MP_EINTERIOR or MP_EDOUBLEFREE as mp_free for a pointer that is no live block's start;
 *   MP_EUNSUPPORTED when the upstream cannot share. The handle stays valid while the block
 *   stays live; keeping it live until every other process let go is the caller's part.
 * mp_share_open: map a handle from mp_share (made by a pool on the same kind of upstream,
 *   in any process): *base is the start of the memory in this process and *nbytes its size.
 *   A handle opened again while open gives the same base and is counted; MP_EINVAL for
 *   bytes mp_share did not make.
 * mp_share_close: one mp_share_open of `base` undone; the last unmaps it. MP_ENOTFOUND
 *   for a base not open. */
#define MP_SHARE_HANDLE_MAX 65536
int mp_share(mp_pool *p, uintptr_t ptr, unsigned char *buf, size_t cap, size_t *len,
             size_t *offset);
int mp_share_open(mp_pool *p, const unsigned char *buf, size_t len, uintptr_t *base,
                  size_t *nbytes);
int mp_share_close(mp_pool *p, uintptr_t base);

/* Release cached memory: every idle segment (empty_cache), or oldest first down to `keep`
 * cached bytes (trim). Pinned (initial_pool_size) memory stays. */
int mp_empty_cache(mp_pool *p);
int mp_trim(mp_pool *p, size_t keep);
/* After mp_empty_cache or mp_trim: wait for the device (only when a plain segment was
 * freed since the last call) and have the upstream give back what it still keeps of freed
 * segments beyond `keep` bytes, so the device shows them free (Note [Giving back to the
 * device], mp_release.c). MP_EBUSY, nothing done, while a capture is known. */
int mp_give_back(mp_pool *p, size_t keep);
/* Note [Mapper] (mp_expand_mapper.c): return once the pool's mapper thread has no work
 * flagged and no map or unmap in flight (at once when it has none), so that a test or a
 * benchmark reads a settled pool. */
int mp_mapper_wait_idle(mp_pool *p);

/* mp_size.h's rounding under a pool's config (inline: every allocation rounds). */
static inline size_t mp_round_size(const mp_config *cfg, size_t nbytes) {
    return mp_round_with(cfg->roundup_divisions, nbytes);
}

/* An allocation's refusal as the pool stood at that moment: filled under the pool's lock
 * where the fallback chain gave up, so that its figures are one snapshot (read one by one
 * after the lock is dropped, they could mix two moments while other threads allocate,
 * free or release). reserved_bytes == used_bytes + pending_bytes + cached_bytes. */
typedef struct mp_oom {
    const mp_pool *pool;         /* the pool that refused */
    int code;                    /* what the allocation returned (MP_ENOMEM, MP_ELIMIT, ...) */
    size_t nbytes;               /* requested */
    size_t rounded;              /* the block it needed (nbytes itself over MP_MAX_ALLOC) */
    uintptr_t stream;
    size_t reserved_bytes;
    size_t used_bytes;           /* in allocated blocks */
    size_t pending_bytes;        /* in freed blocks that wait for other streams */
    size_t cached_bytes;         /* in free blocks, hot ones included */
    size_t largest_free_block;
    size_t limit;                /* MP_UNLIMITED: none */
    size_t capacity;             /* the device's, as the upstream reports it (0: unknown) */
    int capturing;               /* Note [Graph capture]: a capture was under way */
    uint64_t num_ooms;           /* the pool's refusals so far, this one included */
} mp_oom;
/* The calling thread's last refusal by mp_alloc (and the allocations built on it), taken:
 * MP_ENOTFOUND when there is none since the last take. Per thread, so another thread's
 * refusal in between cannot replace it; no lock. */
int mp_oom_take(mp_oom *out);
/* A record of the pool as it stands now, for a refusal that left none (e.g. out of host
 * memory before the pool was asked). Takes the lock. */
void mp_oom_snapshot(mp_pool *p, int code, size_t nbytes, uintptr_t stream, mp_oom *out);

/* ---- Out-of-memory diagnosis (mp_oom.c, Note [One OOM explainer]) ----------------------
 * What refused a request and which option would help, from its record and the pool's
 * options: the one rule set behind the Pool's OutOfMemoryError and PyTorch's. */
enum {
    MP_OOM_BY_DEVICE = 0,      /* the device (or the upstream's capacity) is full */
    MP_OOM_BY_LIMIT = 1,       /* the pool's limit, or the limit it shares */
    MP_OOM_BY_MAX_ALLOC = 2,   /* larger than any request accepted (MP_MAX_ALLOC) */
    MP_OOM_BY_UPSTREAM = 3,    /* an upstream error, not a lack of memory */
};
enum {
    MP_OOM_ADVICE_NONE = 0,                /* an upstream error: nothing to advise */
    MP_OOM_ADVICE_FREE_MEMORY = 1,         /* free memory or make room on the device */
    MP_OOM_ADVICE_RAISE_LIMIT = 2,
    MP_OOM_ADVICE_EXPANDABLE = 3,          /* fragmented: expandable segments would merge */
    MP_OOM_ADVICE_EXPANDABLE_OR_LIMIT = 4, /* the same under a limit that refused */
    MP_OOM_ADVICE_MAX_SPLIT = 5,           /* enough is cached, in blocks max_split_size keeps */
    MP_OOM_ADVICE_REDUCE_REQUEST = 6,
    MP_OOM_ADVICE_CAPTURE = 7,             /* a graph capture kept the cache from release */
};
typedef struct mp_oom_diagnosis {
    int refused_by;   /* MP_OOM_BY_* */
    int advice;       /* MP_OOM_ADVICE_* */
    int fragmented;   /* enough is cached for the block, but no free block holds it */
} mp_oom_diagnosis;
void mp_oom_explain(const mp_oom *rec, const mp_config *cfg, mp_oom_diagnosis *out);
/* The options a message names: a Pool's keyword arguments, or PyTorch's ways to set them. */
enum { MP_OOM_WORDS_POOL = 0, MP_OOM_WORDS_TORCH = 1 };
/* The refusal in `rec` (of pool p, on `backend` device `device`) as one sentence: the
 * request, what refused it, the pool's figures and a hint. Always NUL-terminated; returns
 * the length the whole message needs, as snprintf. */
size_t mp_oom_message(mp_pool *p, const mp_oom *rec, const char *backend, int device,
                      int words, char *buf, size_t buflen);
/* A byte count as every message spells it ("20.00 MiB", "512 bytes"; with exact, "3.99 GiB
 * (4,284,481,536 bytes)"): mempool._units.format_bytes in C. Returns as snprintf. */
size_t mp_format_bytes(size_t nbytes, int exact, char *buf, size_t buflen);

/* ---- A pool's upstream, for front ends (mp_upstream_ops.c) -------------------------------
 * A capture-safe upstream for the same device as p's (plain segments: legal while a stream
 * captures a CUDA graph), owned by the caller; MP_EINVAL when p's upstream has none (sim,
 * host), MP_EUNSUPPORTED when the driver lacks the calls. */
int mp_pool_plain_upstream(mp_pool *p, mp_upstream *out);
/* Let device `peer` read and write p's memory; MP_EUNSUPPORTED when p's upstream has no
 * peers to grant (sim, host). A message is in err on failure (when errlen > 0). */
int mp_pool_enable_peer_access(mp_pool *p, int peer, char *err, size_t errlen);

void mp_get_stats(mp_pool *p, mp_stats *out);
void mp_reset_peak_stats(mp_pool *p);
/* Note [Peak windows]: the stats with each peak taken over the current window only (since
 * the last mp_stats_window with close, or the last reset), and with close a new window
 * starts (each peak from the current value; mp_get_stats still reports the pool's peaks
 * since the last reset). For a client that adds other memory to this pool's figures, and
 * must know the pool's peak between two changes of that other memory. */
#define MP_NSTATS (offsetof(mp_stats, num_alloc_retries) / sizeof(mp_stat))
void mp_stats_window(mp_pool *p, mp_stats *out, int close);
void mp_reset_accumulated_stats(mp_pool *p);
size_t mp_used_bytes(mp_pool *p);
size_t mp_cached_bytes(mp_pool *p);
size_t mp_reserved_bytes(mp_pool *p);
size_t mp_largest_free_block(mp_pool *p);
size_t mp_capacity(mp_pool *p);
const mp_config *mp_pool_config(mp_pool *p);
mp_upstream *mp_pool_upstream(mp_pool *p);
/* Change limit / release_threshold on a live pool (e.g. torch's memory_fraction). */
int mp_set_limit(mp_pool *p, size_t limit);
int mp_set_release_threshold(mp_pool *p, size_t threshold);
/* Change the size policy of a live pool: rounding divisions, max_split_size (MP_UNLIMITED
 * for none; must be that on an expandable pool) and gc_threshold, from the next request on
 * (Note [Size policy at run time], mp_core.c). MP_EINVAL for a gc_threshold outside [0, 1)
 * or a max_split_size on an expandable pool, with nothing changed. */
int mp_set_size_policy(mp_pool *p, const size_t divisions[MP_ROUNDUP_INTERVALS],
                       size_t max_split_size, double gc_threshold);
/* Turn Note [Capture reuse] (mp_stream.c) on or off from the next free on (PyTorch sets it
 * at run time through _set_allocator_settings). */
void mp_set_capture_reuse(mp_pool *p, int on);
/* Note [No split] (mp_core.c): from the next request on, hand out free blocks whole.
 * MP_EINVAL on an expandable pool, with nothing changed. */
int mp_set_no_split(mp_pool *p);
/* Make `member` count its reserved bytes against `owner`'s limit too, as PyTorch's memory
 * fraction caps a device's graph and MemPool pools with its own (Note [Shared limit],
 * mp_release.c). Call before the member holds memory; the member keeps a reference to the
 * owner until it is destroyed. MP_EINVAL: the same pool, an owner that is a member itself,
 * a member that already shares or is shared; MP_EBUSY: the member holds memory. Not to be
 * called on the same pools from two threads at once (the torch glue calls it where it makes
 * a private pool). */
int mp_share_limit(mp_pool *member, mp_pool *owner);

/* Check every structural invariant; on a breach return MP_EINVAL with a message in msg. */
int mp_check_invariants(mp_pool *p, char *msg, size_t msglen);

/* A copy of the pool's layout, taken under the lock, for snapshots and reports. */
enum { MP_BLOCK_FREE = 0, MP_BLOCK_ALLOCATED = 1, MP_BLOCK_PENDING = 2, MP_BLOCK_UNMAPPED = 3 };

typedef struct mp_block_view {
    uintptr_t ptr;
    size_t nbytes, requested;
    size_t last_requested;      /* the bytes of the last request it served, free or not */
    uintptr_t stream;
    int state;
} mp_block_view;

typedef struct mp_segment_view {
    uintptr_t ptr;
    size_t nbytes;              /* reserved (address space for expandable segments) */
    size_t mapped_bytes;        /* == nbytes unless expandable */
    uintptr_t stream;
    int is_small, is_expandable, is_pinned;
    size_t first_block, nblocks;  /* into mp_layout.blocks */
    /* expandable: the physical allocations mapped, each released only whole (Note [Growth
     * extents]), into mp_layout.maps as (address, bytes) pairs */
    size_t first_map, nmaps;
} mp_segment_view;

typedef struct mp_layout {
    mp_segment_view *segments;
    size_t nsegments;
    mp_block_view *blocks;
    size_t nblocks;
    uintptr_t *maps;            /* address, bytes, address, bytes, ... */
    size_t nmaps;
} mp_layout;

int mp_layout_take(mp_pool *p, mp_layout *out);
void mp_layout_free(mp_layout *l);

/* Trace recording: a ring of the last `max_entries` events, off (and free) by default. */
enum {
    MP_TRACE_ALLOC = 0, MP_TRACE_FREE_REQUESTED = 1, MP_TRACE_FREE_COMPLETED = 2,
    MP_TRACE_SEGMENT_ALLOC = 3, MP_TRACE_SEGMENT_FREE = 4, MP_TRACE_OOM = 5,
    MP_TRACE_SEGMENT_MAP = 6, MP_TRACE_SEGMENT_UNMAP = 7,
    MP_TRACE_EMPTY_CACHE = 8,   /* empty_cache was called (ptr, nbytes, stream 0): what it
                                   released follows; a replay empties its pool there too */
    MP_TRACE_TRIM = 9,          /* trim was called, nbytes = its keep (ptr, stream 0): what
                                   it released follows; a replay trims its pool there too */
};

typedef struct mp_trace_entry {
    int action;
    uintptr_t ptr;
    size_t nbytes;
    uintptr_t stream;
    uint64_t time_ns;
} mp_trace_entry;

int mp_trace_enable(mp_pool *p, size_t max_entries);   /* 0 turns recording off */

/* Note [Segment observer]
 * One process-wide function is told of every segment event of every pool as it happens:
 * the MP_TRACE_SEGMENT_* actions (a segment allocated or freed, pages of an expandable
 * segment mapped or unmapped), whether or not the pool records a trace. The PyTorch glue
 * puts them in _snapshot()'s trace, where PyTorch's allocator records its own, so that
 * memory_viz shows the pool's segments over time, and hands them to PyTorch's trace
 * trackers (NCCL's segment registration). It runs under the pool's lock, on the
 * thread that caused the event: it must return at once and call no pool. Set it once (or
 * to NULL, when no pool is in use); NULL, the default, costs one load per segment event. */
typedef void (*mp_segment_observer)(void *ctx, mp_pool *p, int action, uintptr_t ptr,
                                    size_t nbytes, uintptr_t stream);
void mp_set_segment_observer(mp_segment_observer fn, void *ctx);

/* Note [Release observer]
 * PyTorch's allocator hands a segment_free to its trace trackers before cudaFree, while the
 * memory is still its own: ProcessGroupNCCL's registration hook deregisters the segment from
 * NCCL there. The segment observer cannot call trackers (it runs under the pool's lock), so
 * the glue queues what it is told. This second process-wide function is called with no lock
 * held just before a pool gives the upstream segments or mapped pages whose events the
 * segment observer has already been told (mp_release_finish, and each segment at a pool's
 * destroy): the glue hands its queued events to the trackers there, before the driver frees
 * the memory. Unmaps that release_pages_locked makes with the lock dropped are told after
 * the unmap, as PyTorch records its own segment_unmap. Set it once (or to NULL); NULL, the
 * default, costs one load per release. */
typedef void (*mp_release_observer)(void *ctx, mp_pool *p);
void mp_set_release_observer(mp_release_observer fn, void *ctx);
/* Copy out the recorded entries, oldest first; *n receives the count. Caller frees. */
int mp_trace_take(mp_pool *p, mp_trace_entry **entries, size_t *n);

#endif
