/* Graph capture on the CUDA upstream: whether a stream captures, where its capture's graph
 * stands (Note [Capture reuse]), and segments made outside a capture's graph.
 *
 * Note [Capture segments]
 * A segment asked for on a stream that is capturing a CUDA graph must not come from
 * cuMemAllocFromPoolAsync there: that would be a graph allocation node, memory the graph
 * owns and frees, not a segment of the pool. cu_segment_alloc asks cuStreamIsCapturing
 * first (an error counts as capturing: the legacy stream cannot be asked while another
 * stream captures) and then allocates with plain cuMemAlloc, in the thread's relaxed capture
 * mode (cuThreadExchangeStreamCaptureMode), as PyTorch's allocator does: cuMemAlloc is not
 * stream-ordered, and the global mode counts it as unsafe. Such segments are remembered
 * (`plain`) and freed with cuMemFree, which waits for the device, never with cuMemFreeAsync.
 * A growth of an expandable segment during a capture reserves and maps pages (PyTorch's
 * graph pools map them too): those calls run in the relaxed mode as well.
 * See docs/architecture.md, Note [Graph capture], for the rest of the core's rules.
 */
#include "mp_cuda_internal.h"

#include <stdlib.h>

/* Note [Capture segments]: whether `stream` captures (an error counts as capturing). */
int cu_capturing(mp_cuda *c, uintptr_t stream) {
    if (!mp_cu.has_capture) return 0;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r;
    CU_CALL(c, r, mp_cu.StreamIsCapturing((CUstream)stream, &status));
    return r != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE;
}

int cu_stream_capturing(void *ctx, uintptr_t stream, int *out) {
    mp_cuda *c = ctx;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r;
    CU_CALL(c, r, mp_cu.StreamIsCapturing((CUstream)stream, &status));
    int rc = cu_check(c, r);
    if (rc == MP_OK) *out = status != CU_STREAM_CAPTURE_STATUS_NONE;
    return rc;
}

/* Note [Capture reuse] (core/mp_stream.c) on the driver: a stream's frontier is what
 * cuStreamGetCaptureInfo calls its dependencies (the nodes its next captured work will
 * depend on), and capture_follows walks cuGraphNodeGetDependencies back from it. Neither
 * call is refused during a capture nor breaks it (PyTorch's allocator makes both).
 * capture_frontier: the frontier of `stream`'s capture (valid until the next call on the
 * stream) and the capture's id; MP_EINVAL when the stream does not capture. */
static int capture_frontier(mp_cuda *c, uintptr_t stream, unsigned long long *id,
                            const CUgraphNode **deps, size_t *n) {
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUgraph graph;
    const CUgraphEdgeData *edges = NULL;   /* unread; without it an edge with data makes the
                                              query CUDA_ERROR_LOSSY_QUERY */
    CUresult r;
    *deps = NULL;
    *n = 0;
    if (mp_cu.StreamGetCaptureInfo3)
        CU_CALL(c, r, mp_cu.StreamGetCaptureInfo3((CUstream)stream, &status, id, &graph, deps,
                                              &edges, n));
    else
        CU_CALL(c, r, mp_cu.StreamGetCaptureInfo2((CUstream)stream, &status, id, &graph, deps, n));
    int rc = cu_check(c, r);
    if (rc != MP_OK) return rc;
    return status == CU_STREAM_CAPTURE_STATUS_ACTIVE ? MP_OK : MP_EINVAL;
}

int cu_capture_frontier(void *ctx, uintptr_t stream, uint64_t *graph, uintptr_t *nodes,
                               size_t cap, size_t *n) {
    unsigned long long id = 0;
    const CUgraphNode *deps;
    size_t count;
    int rc = capture_frontier(ctx, stream, &id, &deps, &count);
    if (rc != MP_OK) return rc;
    *graph = id;
    *n = count;
    for (size_t i = 0; i < count && i < cap; i++) nodes[i] = (uintptr_t)deps[i];
    return MP_OK;
}

/* A set of graph nodes: open addressing over a power-of-two table (host pointers, so the
 * low bits carry little). */
typedef struct {
    uintptr_t *slots;
    size_t mask, count;
} node_set;

static size_t node_slot(const node_set *set, uintptr_t v) {
    size_t i = (size_t)((v >> 4) * 0x9E3779B97F4A7C15ull) & set->mask;
    while (set->slots[i] && set->slots[i] != v) i = (i + 1) & set->mask;
    return i;
}

/* 1 when v was added, 0 when it was there, -1 when out of memory. */
static int node_set_add(node_set *set, uintptr_t v) {
    if ((set->count + 1) * 2 > set->mask + 1) {
        node_set grown = {calloc(2 * (set->mask + 1), sizeof *grown.slots), 2 * set->mask + 1, 0};
        if (!grown.slots) return -1;
        for (size_t i = 0; i <= set->mask; i++)
            if (set->slots[i]) grown.slots[node_slot(&grown, set->slots[i])] = set->slots[i];
        grown.count = set->count;
        free(set->slots);
        *set = grown;
    }
    size_t i = node_slot(set, v);
    if (set->slots[i]) return 0;
    set->slots[i] = v;
    set->count++;
    return 1;
}

/* The dependencies of `node` into *buf (room for *cap, grown as needed); their count, or
 * (size_t)-1 on an error. The count first (a call with no array), since a call with too
 * small an array fills it and does not say that more exist; the edge data too, which the
 * edge-data form wants when an edge is not a plain one. */
static size_t node_parents(mp_cuda *c, CUgraphNode node, CUgraphNode **buf, size_t *cap,
                           CUgraphEdgeData **edges) {
    size_t n = 0;
    CUresult r;
    if (mp_cu.GraphNodeGetDependencies2)
        CU_CALL(c, r, mp_cu.GraphNodeGetDependencies2(node, NULL, NULL, &n));
    else
        CU_CALL(c, r, mp_cu.GraphNodeGetDependencies1(node, NULL, &n));
    if (cu_check(c, r) != MP_OK) return (size_t)-1;
    if (!n) return 0;
    if (n > *cap) {
        CUgraphNode *more = realloc(*buf, n * sizeof *more);
        if (more) *buf = more;
        CUgraphEdgeData *more_edges = more ? realloc(*edges, n * sizeof *more_edges) : NULL;
        if (!more || !more_edges) return (size_t)-1;
        *edges = more_edges;
        *cap = n;
    }
    if (mp_cu.GraphNodeGetDependencies2)
        CU_CALL(c, r, mp_cu.GraphNodeGetDependencies2(node, *buf, *edges, &n));
    else
        CU_CALL(c, r, mp_cu.GraphNodeGetDependencies1(node, *buf, &n));
    return cu_check(c, r) == MP_OK ? n : (size_t)-1;
}

int cu_capture_follows(void *ctx, uintptr_t stream, const uintptr_t *nodes, size_t n,
                              unsigned char *followed) {
    mp_cuda *c = ctx;
    unsigned long long id = 0;
    const CUgraphNode *deps;
    size_t count;
    int rc = capture_frontier(c, stream, &id, &deps, &count);
    if (rc != MP_OK) return rc;
    node_set seen = {calloc(64, sizeof(uintptr_t)), 63, 0};
    size_t top = 0, room = count + 16, pcap = 16;
    uintptr_t *stack = malloc(room * sizeof *stack);
    CUgraphNode *parents = malloc(pcap * sizeof *parents);
    CUgraphEdgeData *edges = malloc(pcap * sizeof *edges);
    rc = seen.slots && stack && parents && edges ? MP_OK : MP_ENOMEM;
    for (size_t i = 0; rc == MP_OK && i < count; i++) {
        int added = node_set_add(&seen, (uintptr_t)deps[i]);
        if (added < 0) rc = MP_ENOMEM;
        else if (added) stack[top++] = (uintptr_t)deps[i];
    }
    while (rc == MP_OK && top) {   /* every ancestor of the frontier, each once */
        size_t np = node_parents(c, (CUgraphNode)stack[--top], &parents, &pcap, &edges);
        if (np == (size_t)-1) {
            rc = MP_EUPSTREAM;
            break;
        }
        for (size_t j = 0; rc == MP_OK && j < np; j++) {
            int added = node_set_add(&seen, (uintptr_t)parents[j]);
            if (added < 0) rc = MP_ENOMEM;
            if (added <= 0) continue;
            if (top == room) {
                uintptr_t *more = realloc(stack, 2 * room * sizeof *more);
                if (!more) {
                    rc = MP_ENOMEM;
                    break;
                }
                stack = more;
                room *= 2;
            }
            stack[top++] = (uintptr_t)parents[j];
        }
    }
    for (size_t i = 0; rc == MP_OK && i < n; i++)
        followed[i] = seen.slots[node_slot(&seen, nodes[i])] != 0;
    free(seen.slots);
    free(stack);
    free(parents);
    free(edges);
    return rc;
}

/* Note [Capture segments]: the calling thread in the relaxed capture mode until
 * cu_relaxed_leave(the returned mode), for calls that are not stream-ordered (cuMemAlloc, and
 * the virtual-memory calls of a growth during a capture), which the global mode refuses. */
int cu_relaxed_enter(void) {
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    /* -1: nothing changed (no capture support, or the exchange failed), nothing to restore. */
    if (!mp_cu.has_capture || mp_cu.ThreadExchangeStreamCaptureMode(&mode) != CUDA_SUCCESS)
        return -1;
    return mode;
}

void cu_relaxed_leave(int mode) {
    if (mode >= 0) mp_cu.ThreadExchangeStreamCaptureMode(&mode);
}

/* Note [Capture segments]: a segment outside the capture's graph, remembered as plain. */
int cu_plain_alloc(mp_cuda *c, size_t nbytes, CUdeviceptr *p) {
    CUresult r;
    int mode = cu_relaxed_enter();
    CU_CALL(c, r, mp_cu.MemAlloc(p, nbytes));
    cu_relaxed_leave(mode);
    int rc = cu_check(c, r);
    if (rc != MP_OK) return rc;
    pthread_mutex_lock(&c->plain_lock);
    if (c->nplain == c->cap_plain) {
        size_t cap = c->cap_plain ? 2 * c->cap_plain : 16;
        CUdeviceptr *grown = realloc(c->plain, cap * sizeof *grown);
        if (grown) {
            c->plain = grown;
            c->cap_plain = cap;
        } else {
            rc = MP_ENOMEM;
        }
    }
    if (rc == MP_OK) {
        c->plain[c->nplain] = *p;
        __atomic_store_n(&c->nplain, c->nplain + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&c->plain_lock);
    if (rc != MP_OK) {
        /* Out of host memory for the note: give it back. Only after the capture would be
         * legal, but a capture that allocates with no host memory left fails anyway. */
        mode = cu_relaxed_enter();
        CU_CALL(c, r, mp_cu.MemFree(*p));
        cu_relaxed_leave(mode);
    }
    return rc;
}

/* 1 when p was a plain segment (now forgotten): the caller frees it with cuMemFree. */
int cu_plain_take(mp_cuda *c, CUdeviceptr p) {
    if (!__atomic_load_n(&c->nplain, __ATOMIC_ACQUIRE)) return 0;   /* the usual case */
    pthread_mutex_lock(&c->plain_lock);
    size_t i = 0;
    while (i < c->nplain && c->plain[i] != p) i++;
    int found = i < c->nplain;
    if (found) {
        c->plain[i] = c->plain[c->nplain - 1];
        __atomic_store_n(&c->nplain, c->nplain - 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&c->plain_lock);
    return found;
}

/* Note [Set-up during a capture]
 * Making a cuda Pool creates a cudaMemPool, sets its attributes, and the first Pool of a
 * process measures the cudaMemPool's unit with a probe of its own (a pool, a stream, one
 * allocation: mempool/_cuda.py allocation_unit). None of these touches a capturing stream,
 * and in the relaxed capture mode a capture on another stream or thread survives them (the
 * graph replays right: tests/gpu/test_gpu_capture.py). The global mode, in which CuPy and
 * PyTorch users often capture, refuses them all the same: cudaMemPoolCreate failed with
 * cudaErrorStreamCaptureUnsupported and the capture was invalidated, on the capturing thread
 * and on another. So Pool() makes those calls in the thread's relaxed mode, as the upstream
 * makes its capture segments (Note [Capture segments]), and restores the mode after.
 * Pool.stats() reads the cudaMemPool's attributes in that mode too: a metrics thread
 * (mempool.prometheus) reads them at any time, a capture on another thread included. */
int mp_cuda_relax_capture_mode(void) { return mp_cuda_available() ? cu_relaxed_enter() : -1; }

void mp_cuda_restore_capture_mode(int mode) { cu_relaxed_leave(mode); }

/* ---- Plain segments for private pools (Note [Torch allocator glue]). ----
 *
 * A CUDA graph's private pool gets its segments while the graph's stream captures, and a
 * stream-ordered allocation on a capturing stream would become a node of the graph: its
 * memory would exist only while the graph runs. Every segment of such a pool is therefore a
 * plain one, as a capture segment is (Note [Capture segments]): cu_plain_alloc makes it, in the
 * thread's relaxed capture mode, and cu_segment_free gives it back with cuMemFree, which the
 * owner calls only once no capture is under way. */

static int cu_plain_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_cuda *c = ctx;
    if (nbytes == 0 || !out) return MP_EINVAL;
    CUdeviceptr p = 0;
    int rc = cu_plain_alloc(c, nbytes, &p);
    if (rc != MP_OK) return rc;
    if (p & 511) {   /* the contract's 512-byte alignment, as cu_segment_alloc checks */
        cu_segment_free(c, (uintptr_t)p, nbytes, stream);
        return cu_fail(c, -1);
    }
    *out = (uintptr_t)p;
    return MP_OK;
}

int mp_cuda_plain_upstream(const mp_upstream *like, mp_upstream *out) {
    if (!mp_cuda_owns(like) || !out) return MP_EINVAL;
    if (!mp_cu.has_capture) return MP_EUNSUPPORTED;   /* no cuMemAlloc or capture modes */
    const mp_cuda *src = like->ctx;
    char err[64];
    int rc = mp_cuda_upstream(out, src->ordinal, 0, err, sizeof err);
    if (rc != MP_OK) return rc;
    out->name = "cuda-plain";
    out->segment_alloc = cu_plain_segment_alloc;   /* freed by cu_segment_free, as plain */
    /* Plain segments only: expandable pages would need the same capture care. */
    out->granularity = 0;
    out->va_reserve = NULL;
    out->map = NULL;
    out->unmap = NULL;
    out->va_release = NULL;
    return MP_OK;
}
