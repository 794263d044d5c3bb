/* The CUDA upstream: driver entry points resolved once from libcuda.so.1 (see mp_cuda.h).
 *
 * Note [Context]
 * Driver calls act on the calling thread's current context: the legacy and per-thread
 * default streams, events and cuMemGetInfo all resolve through it. The pool is called from
 * any thread (Python threads, PyTorch's allocator hooks, DLPack deleters), so each call
 * first checks cuCtxGetCurrent (a thread-local read) against the device's primary context,
 * the one CuPy's, PyTorch's and JAX's runtimes use. When it differs:
 *   - no context current: make ours current and leave it so, as the runtime itself does on
 *     a thread's first call; later calls on that thread pay only the check;
 *   - another context current (the thread works on another device): switch for the call
 *     and switch back, so the caller's current device is unchanged.
 *
 * Note [Expandable pages]
 * Each map call is one physical allocation: one cuMemCreate of the whole range, one cuMemMap
 * and one cuMemSetAccess, however many pages it spans. The driver's cost follows the number
 * of physical allocations, not their bytes (bench/vmm_costs.py), and a physical allocation can
 * only be mapped and unmapped whole (cuMemMap at an offset into a larger handle is refused as
 * not supported, cuMemUnmap refuses part of a mapping), so the core remembers what each map
 * call covered and unmaps only whole ones (Note [Growth extents] in core/mp_expand.c); an
 * unmap may cover several, each unmapped and released in turn. The table per reservation
 * marks each mapped page as the head of its allocation (holding the handle) or a page after
 * it. The page, the unit of addresses and of growth, is the driver's granularity (2 MiB on
 * an H200) times a power of two through the pool's `granularity` option
 * (mp_cuda_set_page_size, before the first reservation). Access is granted per map call over
 * the whole range, for the device and its peers (Note [Peer access]).
 *
 * Note [Peer access]
 * Another device reaches this device's memory only where access was granted to it; without
 * it a kernel there faults. The two kinds of memory grant it differently:
 *   - cudaMemPool segments: cuMemPoolSetAccess on the pool, which covers every allocation of
 *     the pool, present and future, so it is set once per peer. The pool's setting is the
 *     driver's, shared with everyone allocating from the same pool ("default"/"current").
 *   - expandable segments: access is per mapping. cuMemSetAccess goes over every run of
 *     pages mapped now, and `access` (the device itself, then every peer) is what cu_map
 *     grants each range it maps later; both under vmm_lock, so no page is mapped between.
 * Enabling is all or nothing: the pages are granted first (their grants are ours alone and
 * revocable), the pool last; a failure revokes what was granted. Peer access is never
 * revoked otherwise: a pool's memory may be in use on the peer at any time.
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
#include "mp_cuda.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- The few driver types and constants used (values as in cuda.h, CUDA 11.2 .. 13). ---- */

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUmemPoolHandle_st *CUmemoryPool;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct {   /* CUgraphEdgeData (CUDA 12.3+) */
    unsigned char from_port, to_port, type, reserved[5];
} CUgraphEdgeData;

#define CU_STREAM_CAPTURE_STATUS_NONE 0
#define CU_STREAM_CAPTURE_STATUS_ACTIVE 1
#define CU_STREAM_CAPTURE_MODE_RELAXED 2

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_READY = 600,
};

#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED 102
#define CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED 115
#define CU_MEM_ALLOCATION_TYPE_PINNED 0x1
#define CU_MEM_HANDLE_TYPE_NONE 0x0
#define CU_MEM_LOCATION_TYPE_DEVICE 0x1
#define CU_MEM_ACCESS_FLAGS_PROT_NONE 0x0
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 0x3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0x0

/* Enums are int-sized in the driver's ABI. */
typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

/* ---- The driver table, resolved once per process. ---- */

static struct {
    CUresult (*Init)(unsigned int);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*MemAllocFromPoolAsync)(CUdeviceptr *, size_t, CUmemoryPool, CUstream);
    CUresult (*MemAllocAsync)(CUdeviceptr *, size_t, CUstream);
    CUresult (*MemFreeAsync)(CUdeviceptr, CUstream);
    CUresult (*MemPoolDestroy)(CUmemoryPool);
    CUresult (*CtxSynchronize)(void);
    CUresult (*EventCreate)(CUevent *, unsigned int);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventQuery)(CUevent);
    CUresult (*EventDestroy)(CUevent);
    CUresult (*StreamWaitEvent)(CUstream, CUevent, unsigned int);
    CUresult (*StreamSynchronize)(CUstream);
    CUresult (*StreamQuery)(CUstream);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    /* Virtual memory management: optional (expandable segments are off without them). */
    CUresult (*MemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
    CUresult (*MemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr,
                                  unsigned long long);
    CUresult (*MemAddressFree)(CUdeviceptr, size_t);
    CUresult (*MemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                          unsigned long long);
    CUresult (*MemRelease)(CUmemGenericAllocationHandle);
    CUresult (*MemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
                       unsigned long long);
    CUresult (*MemUnmap)(CUdeviceptr, size_t);
    CUresult (*MemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    /* Peer access: optional (enable_peer_access says so when missing). */
    CUresult (*DeviceCanAccessPeer)(int *, CUdevice, CUdevice);
    CUresult (*DeviceGetMemPool)(CUmemoryPool *, CUdevice);
    CUresult (*MemPoolTrimTo)(CUmemoryPool, size_t);
    CUresult (*MemPoolSetAccess)(CUmemoryPool, const CUmemAccessDesc *, size_t);
    CUresult (*MemPoolGetAccess)(int *, CUmemoryPool, CUmemLocation *);
    CUresult (*MemGetAccess)(unsigned long long *, const CUmemLocation *, CUdeviceptr);
    /* Graph capture: optional (without them the upstream reports no capture). */
    CUresult (*StreamIsCapturing)(CUstream, int *);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*ThreadExchangeStreamCaptureMode)(int *);
    /* Note [Capture reuse] (core/mp_stream.c): optional; the edge-data forms of CUDA 12.3+
     * where the driver has them, else the older ones. */
    CUresult (*StreamGetCaptureInfo3)(CUstream, int *, unsigned long long *, CUgraph *,
                                      const CUgraphNode **, const CUgraphEdgeData **, size_t *);
    CUresult (*StreamGetCaptureInfo2)(CUstream, int *, unsigned long long *, CUgraph *,
                                      const CUgraphNode **, size_t *);
    CUresult (*GraphNodeGetDependencies2)(CUgraphNode, CUgraphNode *, CUgraphEdgeData *,
                                          size_t *);
    CUresult (*GraphNodeGetDependencies1)(CUgraphNode, CUgraphNode *, size_t *);
    int has_vmm;
    int has_capture;
} D;

static pthread_once_t d_once = PTHREAD_ONCE_INIT;
static char d_error[256]; /* empty when the table is complete; written once, under d_once */

/* The exported names carry the ABI version (cuda.h maps cuMemGetInfo to cuMemGetInfo_v2 and
 * so on); the unversioned ones are the legacy-stream variants, which is what the handle
 * values 0/1/2 ask for. */
static void d_resolve(void) {
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(d_error, sizeof d_error, "the CUDA driver (libcuda.so.1) could not be loaded: %s",
                 why ? why : "unknown reason");
        return;
    }
    enum { REQUIRED, VMM, PEER, CAPTURE, OPTIONAL };   /* what lacks when the symbol does */
    struct { void **slot; const char *name; int kind; } table[] = {
        {(void **)&D.Init, "cuInit", REQUIRED},
        {(void **)&D.DeviceGetCount, "cuDeviceGetCount", REQUIRED},
        {(void **)&D.DeviceGet, "cuDeviceGet", REQUIRED},
        {(void **)&D.DeviceGetAttribute, "cuDeviceGetAttribute", REQUIRED},
        {(void **)&D.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", REQUIRED},
        {(void **)&D.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", REQUIRED},
        {(void **)&D.CtxGetCurrent, "cuCtxGetCurrent", REQUIRED},
        {(void **)&D.CtxSetCurrent, "cuCtxSetCurrent", REQUIRED},
        {(void **)&D.GetErrorName, "cuGetErrorName", REQUIRED},
        {(void **)&D.GetErrorString, "cuGetErrorString", REQUIRED},
        {(void **)&D.MemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", REQUIRED},
        {(void **)&D.MemAllocAsync, "cuMemAllocAsync", REQUIRED},
        {(void **)&D.MemFreeAsync, "cuMemFreeAsync", REQUIRED},
        {(void **)&D.MemPoolDestroy, "cuMemPoolDestroy", REQUIRED},
        {(void **)&D.CtxSynchronize, "cuCtxSynchronize", REQUIRED},
        {(void **)&D.EventCreate, "cuEventCreate", REQUIRED},
        {(void **)&D.EventRecord, "cuEventRecord", REQUIRED},
        {(void **)&D.EventQuery, "cuEventQuery", REQUIRED},
        {(void **)&D.EventDestroy, "cuEventDestroy_v2", REQUIRED},
        {(void **)&D.StreamWaitEvent, "cuStreamWaitEvent", REQUIRED},
        {(void **)&D.StreamSynchronize, "cuStreamSynchronize", REQUIRED},
        {(void **)&D.StreamQuery, "cuStreamQuery", REQUIRED},
        {(void **)&D.MemGetInfo, "cuMemGetInfo_v2", REQUIRED},
        {(void **)&D.MemGetAllocationGranularity, "cuMemGetAllocationGranularity", VMM},
        {(void **)&D.MemAddressReserve, "cuMemAddressReserve", VMM},
        {(void **)&D.MemAddressFree, "cuMemAddressFree", VMM},
        {(void **)&D.MemCreate, "cuMemCreate", VMM},
        {(void **)&D.MemRelease, "cuMemRelease", VMM},
        {(void **)&D.MemMap, "cuMemMap", VMM},
        {(void **)&D.MemUnmap, "cuMemUnmap", VMM},
        {(void **)&D.MemSetAccess, "cuMemSetAccess", VMM},
        {(void **)&D.DeviceCanAccessPeer, "cuDeviceCanAccessPeer", PEER},
        {(void **)&D.DeviceGetMemPool, "cuDeviceGetMemPool", PEER},
        {(void **)&D.MemPoolSetAccess, "cuMemPoolSetAccess", PEER},
        {(void **)&D.MemPoolGetAccess, "cuMemPoolGetAccess", PEER},
        {(void **)&D.MemGetAccess, "cuMemGetAccess", PEER},
        {(void **)&D.StreamIsCapturing, "cuStreamIsCapturing", CAPTURE},
        {(void **)&D.MemAlloc, "cuMemAlloc_v2", CAPTURE},
        {(void **)&D.MemFree, "cuMemFree_v2", CAPTURE},
        {(void **)&D.ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode", CAPTURE},
        {(void **)&D.MemPoolTrimTo, "cuMemPoolTrimTo", OPTIONAL},
        {(void **)&D.StreamGetCaptureInfo3, "cuStreamGetCaptureInfo_v3", OPTIONAL},
        {(void **)&D.StreamGetCaptureInfo2, "cuStreamGetCaptureInfo_v2", OPTIONAL},
        {(void **)&D.GraphNodeGetDependencies2, "cuGraphNodeGetDependencies_v2", OPTIONAL},
        {(void **)&D.GraphNodeGetDependencies1, "cuGraphNodeGetDependencies", OPTIONAL},
    };
    int has_vmm = 1, has_capture = 1;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++) {
        *table[i].slot = dlsym(lib, table[i].name);
        if (*table[i].slot) continue;
        if (table[i].kind == REQUIRED) {
            snprintf(d_error, sizeof d_error,
                     "the CUDA driver lacks %s (stream-ordered allocation needs driver 11.2+)",
                     table[i].name);
            return;  /* lib stays open: harmless, and other users may share it */
        }
        if (table[i].kind == VMM) has_vmm = 0;
        if (table[i].kind == CAPTURE) has_capture = 0;
    }
    D.has_vmm = has_vmm;
    D.has_capture = has_capture;
}

static const char *d_load(void) {
    pthread_once(&d_once, d_resolve);
    return d_error[0] ? d_error : NULL;
}

/* ---- The upstream context. ---- */

/* mapped[i]: page i of a reservation (Note [Expandable pages]) */
enum { PAGE_UNMAPPED = 0, PAGE_HEAD = 1, PAGE_REST = 2 };

typedef struct {
    CUdeviceptr va;
    size_t nbytes, npages, nmapped;
    CUmemGenericAllocationHandle *handles; /* per page; valid where mapped[i] == PAGE_HEAD */
    unsigned char *mapped;                 /* PAGE_* */
} mp_cuda_range;

/* The device itself and its peers: bounded by the 64-bit masks of mp_cuda_access_mask. */
#define MP_CUDA_MAX_ACCESS 64

typedef struct {
    CUdevice dev;
    int ordinal;
    int ndevices;                /* devices visible at creation; immutable */
    CUcontext ctx;               /* the retained primary context; immutable */
    CUmemoryPool pool;           /* NULL = the device's current pool; immutable */
    int owns_pool;               /* atomic; destroy destroys `pool` (mp_cuda_own_pool) */
    int last_error;              /* atomic */
    int *error_slot;             /* atomic; NULL until mp_cuda_bind_errors */
    size_t granularity;          /* the page: 0 without virtual memory management; set before
                                    any reservation (mp_cuda_set_page_size), then immutable */
    size_t driver_granularity;   /* the driver's minimum; pages are multiples of it */
    CUmemAllocationProp prop;    /* physical pages: pinned device memory on dev; immutable */
    pthread_mutex_t vmm_lock;    /* guards access, naccess, ranges, nranges, cap and every
                                    range's tables */
    /* Read/write for dev ([0]), then for each peer in the order enabled: what every mapped
     * range is granted (Note [Peer access]). */
    CUmemAccessDesc access[MP_CUDA_MAX_ACCESS];
    size_t naccess;
    mp_cuda_range *ranges;
    size_t nranges, cap;
    pthread_mutex_t plain_lock;  /* guards plain, cap_plain and the writes of nplain (atomic) */
    CUdeviceptr *plain;          /* Note [Capture segments]: segments from cuMemAlloc */
    size_t nplain, cap_plain;
} mp_cuda;

static int fail(mp_cuda *c, CUresult r) {
    __atomic_store_n(&c->last_error, r, __ATOMIC_RELAXED);
    int *slot = __atomic_load_n(&c->error_slot, __ATOMIC_ACQUIRE);
    if (slot) __atomic_store_n(slot, r, __ATOMIC_RELAXED);
    return MP_EUPSTREAM;
}

/* CUresult -> MP_* code; OUT_OF_MEMORY is the one failure the pool acts on. */
static int check(mp_cuda *c, CUresult r) {
    if (r == CUDA_SUCCESS) return MP_OK;
    if (r == CUDA_ERROR_OUT_OF_MEMORY) return MP_ENOMEM;
    return fail(c, r);
}

/* Note [Context]: returns the context to restore in *prev (NULL = nothing to restore). */
static CUresult ctx_enter(mp_cuda *c, CUcontext *prev) {
    CUcontext cur = NULL;
    *prev = NULL;
    CUresult r = D.CtxGetCurrent(&cur);
    if (r != CUDA_SUCCESS || cur == c->ctx) return r;
    r = D.CtxSetCurrent(c->ctx);
    if (r == CUDA_SUCCESS) *prev = cur;
    return r;
}

static void ctx_leave(CUcontext prev) {
    if (prev) D.CtxSetCurrent(prev);
}

/* result = expr, called with the device's context current (Note [Context]). */
#define CU_CALL(c, result, expr)                           \
    do {                                                   \
        CUcontext prev_;                                   \
        (result) = ctx_enter((c), &prev_);                 \
        if ((result) == CUDA_SUCCESS) {                    \
            (result) = (expr);                             \
            ctx_leave(prev_);                              \
        }                                                  \
    } while (0)

/* ---- Segments, events, streams. ---- */

/* Note [Capture segments]: whether `stream` captures (an error counts as capturing). */
static int capturing(mp_cuda *c, uintptr_t stream) {
    if (!D.has_capture) return 0;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r;
    CU_CALL(c, r, D.StreamIsCapturing((CUstream)stream, &status));
    return r != CUDA_SUCCESS || status != CU_STREAM_CAPTURE_STATUS_NONE;
}

static int cu_stream_capturing(void *ctx, uintptr_t stream, int *out) {
    mp_cuda *c = ctx;
    int status = CU_STREAM_CAPTURE_STATUS_NONE;
    CUresult r;
    CU_CALL(c, r, D.StreamIsCapturing((CUstream)stream, &status));
    int rc = check(c, r);
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
    if (D.StreamGetCaptureInfo3)
        CU_CALL(c, r, D.StreamGetCaptureInfo3((CUstream)stream, &status, id, &graph, deps,
                                              &edges, n));
    else
        CU_CALL(c, r, D.StreamGetCaptureInfo2((CUstream)stream, &status, id, &graph, deps, n));
    int rc = check(c, r);
    if (rc != MP_OK) return rc;
    return status == CU_STREAM_CAPTURE_STATUS_ACTIVE ? MP_OK : MP_EINVAL;
}

static int cu_capture_frontier(void *ctx, uintptr_t stream, uint64_t *graph, uintptr_t *nodes,
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
    if (D.GraphNodeGetDependencies2)
        CU_CALL(c, r, D.GraphNodeGetDependencies2(node, NULL, NULL, &n));
    else
        CU_CALL(c, r, D.GraphNodeGetDependencies1(node, NULL, &n));
    if (check(c, r) != MP_OK) return (size_t)-1;
    if (!n) return 0;
    if (n > *cap) {
        CUgraphNode *more = realloc(*buf, n * sizeof *more);
        if (more) *buf = more;
        CUgraphEdgeData *more_edges = more ? realloc(*edges, n * sizeof *more_edges) : NULL;
        if (!more || !more_edges) return (size_t)-1;
        *edges = more_edges;
        *cap = n;
    }
    if (D.GraphNodeGetDependencies2)
        CU_CALL(c, r, D.GraphNodeGetDependencies2(node, *buf, *edges, &n));
    else
        CU_CALL(c, r, D.GraphNodeGetDependencies1(node, *buf, &n));
    return check(c, r) == MP_OK ? n : (size_t)-1;
}

static int cu_capture_follows(void *ctx, uintptr_t stream, const uintptr_t *nodes, size_t n,
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
 * relaxed_leave(the returned mode), for calls that are not stream-ordered (cuMemAlloc, and
 * the virtual-memory calls of a growth during a capture), which the global mode refuses. */
static int relaxed_enter(void) {
    int mode = CU_STREAM_CAPTURE_MODE_RELAXED;
    /* -1: nothing changed (no capture support, or the exchange failed), nothing to restore. */
    if (!D.has_capture || D.ThreadExchangeStreamCaptureMode(&mode) != CUDA_SUCCESS) return -1;
    return mode;
}

static void relaxed_leave(int mode) {
    if (mode >= 0) D.ThreadExchangeStreamCaptureMode(&mode);
}

/* Note [Capture segments]: a segment outside the capture's graph, remembered as plain. */
static int plain_alloc(mp_cuda *c, size_t nbytes, CUdeviceptr *p) {
    CUresult r;
    int mode = relaxed_enter();
    CU_CALL(c, r, D.MemAlloc(p, nbytes));
    relaxed_leave(mode);
    int rc = check(c, r);
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
        mode = relaxed_enter();
        CU_CALL(c, r, D.MemFree(*p));
        relaxed_leave(mode);
    }
    return rc;
}

/* 1 when p was a plain segment (now forgotten): the caller frees it with cuMemFree. */
static int plain_take(mp_cuda *c, CUdeviceptr p) {
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

static int cu_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream);

static int cu_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_cuda *c = ctx;
    if (nbytes == 0 || !out) return MP_EINVAL;
    CUdeviceptr p = 0;
    CUresult r;
    if (capturing(c, stream)) {
        int rc = plain_alloc(c, nbytes, &p);
        if (rc != MP_OK) return rc;
        if (p & 511) {   /* see below; cuMemAlloc aligns to 256 bytes at least */
            cu_segment_free(c, (uintptr_t)p, nbytes, stream);
            return fail(c, -1);
        }
        *out = (uintptr_t)p;
        return MP_OK;
    }
    if (c->pool)
        CU_CALL(c, r, D.MemAllocFromPoolAsync(&p, nbytes, c->pool, (CUstream)stream));
    else
        CU_CALL(c, r, D.MemAllocAsync(&p, nbytes, (CUstream)stream));
    int rc = check(c, r);
    if (rc != MP_OK) return rc;
    if (p == 0 || (p & 511)) {
        /* The contract promises 512-byte aligned segments; the driver's pools have always
         * given more, but a silent misalignment would corrupt the core's arithmetic. */
        CU_CALL(c, r, D.MemFreeAsync(p, (CUstream)stream));
        return fail(c, -1);
    }
    *out = (uintptr_t)p;
    return MP_OK;
}

static int cu_segment_free(void *ctx, uintptr_t ptr, size_t nbytes, uintptr_t stream) {
    mp_cuda *c = ctx;
    (void)nbytes;
    CUresult r;
    if (plain_take(c, (CUdeviceptr)ptr))   /* Note [Capture segments] */
        CU_CALL(c, r, D.MemFree((CUdeviceptr)ptr));
    else
        CU_CALL(c, r, D.MemFreeAsync((CUdeviceptr)ptr, (CUstream)stream));
    return check(c, r);
}

static int cu_event_create(void *ctx, uintptr_t *out) {
    mp_cuda *c = ctx;
    CUevent e = NULL;
    CUresult r;
    CU_CALL(c, r, D.EventCreate(&e, CU_EVENT_DISABLE_TIMING));
    int rc = check(c, r);
    if (rc == MP_OK) *out = (uintptr_t)e;
    return rc;
}

static int cu_event_record(void *ctx, uintptr_t event, uintptr_t stream) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.EventRecord((CUevent)event, (CUstream)stream));
    return check(c, r);
}

static int cu_event_query(void *ctx, uintptr_t event) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.EventQuery((CUevent)event));
    if (r == CUDA_ERROR_NOT_READY) return MP_ENOTREADY;
    return check(c, r);
}

static int cu_stream_wait_event(void *ctx, uintptr_t stream, uintptr_t event) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.StreamWaitEvent((CUstream)stream, (CUevent)event, 0));
    return check(c, r);
}

static int cu_event_destroy(void *ctx, uintptr_t event) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.EventDestroy((CUevent)event));
    return check(c, r);
}

static int cu_stream_synchronize(void *ctx, uintptr_t stream) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.StreamSynchronize((CUstream)stream));
    return check(c, r);
}

static int cu_stream_query(void *ctx, uintptr_t stream) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.StreamQuery((CUstream)stream));
    if (r == CUDA_ERROR_NOT_READY) return MP_ENOTREADY;
    return check(c, r);
}

static int cu_device_synchronize(void *ctx) {
    mp_cuda *c = ctx;
    CUresult r;
    CU_CALL(c, r, D.CtxSynchronize());
    return check(c, r);
}

/* pool_of (below): the cudaMemPool the segments come from. */
static CUresult pool_of(mp_cuda *c, CUmemoryPool *pool);

/* Note [Giving back to the device] (core/mp_release.c): the cudaMemPool keeps freed
 * segments (up to its release threshold, and until a sync even below it); trimming it to
 * `keep` returns the rest of what its completed frees left. Nothing to do without the
 * symbol (a driver before 11.2 has no cudaMemPool either). */
static int cu_trim(void *ctx, size_t keep) {
    mp_cuda *c = ctx;
    if (!D.MemPoolTrimTo) return MP_OK;
    CUmemoryPool pool = NULL;
    CUresult r;
    CU_CALL(c, r, pool_of(c, &pool));
    if (r == CUDA_SUCCESS) CU_CALL(c, r, D.MemPoolTrimTo(pool, keep));
    return check(c, r);
}

static int cu_mem_info(void *ctx, size_t *free_bytes, size_t *total_bytes) {
    mp_cuda *c = ctx;
    size_t f = 0, t = 0;
    CUresult r;
    CU_CALL(c, r, D.MemGetInfo(&f, &t));
    int rc = check(c, r);
    if (rc == MP_OK) {
        *free_bytes = f;
        *total_bytes = t;
    }
    return rc;
}

/* ---- Expandable segments (Note [Expandable pages]). ---- */

/* The reservation holding [va, va + nbytes), or NULL. Caller holds vmm_lock. */
static mp_cuda_range *range_find_locked(mp_cuda *c, uintptr_t va, size_t nbytes) {
    for (size_t i = 0; i < c->nranges; i++) {
        mp_cuda_range *r = &c->ranges[i];
        if (va >= r->va && va - r->va <= r->nbytes && nbytes <= r->nbytes - (va - r->va))
            return r;
    }
    return NULL;
}

/* The pages of the physical allocation whose head is page `head` of r. */
static size_t allocation_pages(const mp_cuda_range *r, size_t head) {
    size_t end = head + 1;
    while (end < r->npages && r->mapped[end] == PAGE_REST) end++;
    return end - head;
}

/* Unmap and release the physical allocations that start in pages [first, first + n) of r
 * (whole ones: the caller checked). Returns the first failure; an allocation that failed
 * stays mapped. Caller holds vmm_lock and has the context current. */
static CUresult allocations_release_locked(mp_cuda *c, mp_cuda_range *r, size_t first, size_t n) {
    CUresult bad = CUDA_SUCCESS;
    for (size_t i = first; i < first + n; i++) {
        if (r->mapped[i] != PAGE_HEAD) continue;
        size_t k = allocation_pages(r, i);
        CUresult e = D.MemUnmap(r->va + i * c->granularity, k * c->granularity);
        if (e == CUDA_SUCCESS) e = D.MemRelease(r->handles[i]);
        if (e == CUDA_SUCCESS) {
            memset(&r->mapped[i], PAGE_UNMAPPED, k);
            r->nmapped -= k;
        } else if (bad == CUDA_SUCCESS) {
            bad = e;
        }
    }
    return bad;
}

static int aligned_range(mp_cuda *c, uintptr_t va, size_t nbytes) {
    size_t g = c->granularity;
    return nbytes > 0 && va % g == 0 && nbytes % g == 0;
}

static int cu_va_reserve(void *ctx, size_t nbytes, uintptr_t *out) {
    mp_cuda *c = ctx;
    if (nbytes == 0 || nbytes % c->granularity || !out) return MP_EINVAL;
    size_t npages = nbytes / c->granularity;
    /* calloc of large tables takes untouched zero pages: pages never mapped cost nothing. */
    CUmemGenericAllocationHandle *handles = calloc(npages, sizeof *handles);
    unsigned char *mapped = calloc(npages, 1);
    if (!handles || !mapped) {
        free(handles);
        free(mapped);
        return MP_ENOMEM;
    }
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    if (c->nranges == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 8;
        mp_cuda_range *grown = realloc(c->ranges, cap * sizeof *grown);
        if (!grown) {
            rc = MP_ENOMEM;
            goto out;
        }
        c->ranges = grown;
        c->cap = cap;
    }
    CUdeviceptr va = 0;
    CUresult r;
    int mode = relaxed_enter();   /* a first growth may come during a capture */
    CU_CALL(c, r, D.MemAddressReserve(&va, nbytes, c->granularity, 0, 0));
    relaxed_leave(mode);
    rc = check(c, r);
    if (rc != MP_OK) goto out;
    c->ranges[c->nranges++] = (mp_cuda_range){
        .va = va, .nbytes = nbytes, .npages = npages, .nmapped = 0,
        .handles = handles, .mapped = mapped,
    };
    handles = NULL;
    mapped = NULL;
    *out = (uintptr_t)va;
out:
    pthread_mutex_unlock(&c->vmm_lock);
    free(handles);
    free(mapped);
    return rc;
}

static int cu_map(void *ctx, uintptr_t va, size_t nbytes) {
    mp_cuda *c = ctx;
    if (!aligned_range(c, va, nbytes)) return MP_EINVAL;
    const size_t g = c->granularity;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = range_find_locked(c, va, nbytes);
    size_t first = r ? (va - r->va) / g : 0, n = nbytes / g;
    if (!r) {
        rc = MP_EINVAL;
        goto out;
    }
    for (size_t i = first; i < first + n; i++) {
        if (r->mapped[i]) {
            rc = MP_EINVAL;  /* the contract maps unmapped ranges only */
            goto out;
        }
    }
    CUcontext prev;
    int mode = relaxed_enter();   /* growth maps pages during a capture too */
    CUresult e = ctx_enter(c, &prev);
    CUmemGenericAllocationHandle h = 0;
    int created = 0, mapped = 0;
    /* One physical allocation for the whole range (Note [Expandable pages]). */
    if (e == CUDA_SUCCESS) created = (e = D.MemCreate(&h, nbytes, &c->prop, 0)) == CUDA_SUCCESS;
    if (e == CUDA_SUCCESS) mapped = (e = D.MemMap(va, nbytes, 0, h, 0)) == CUDA_SUCCESS;
    if (e == CUDA_SUCCESS) e = D.MemSetAccess(va, nbytes, c->access, c->naccess);
    if (e == CUDA_SUCCESS) {
        r->handles[first] = h;
        r->mapped[first] = PAGE_HEAD;
        memset(&r->mapped[first + 1], PAGE_REST, n - 1);
        r->nmapped += n;
    } else {   /* all or nothing */
        if (mapped) D.MemUnmap(va, nbytes);
        if (created) D.MemRelease(h);
    }
    ctx_leave(prev);
    relaxed_leave(mode);
    rc = check(c, e);
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

static int cu_unmap(void *ctx, uintptr_t va, size_t nbytes) {
    mp_cuda *c = ctx;
    if (!aligned_range(c, va, nbytes)) return MP_EINVAL;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = range_find_locked(c, va, nbytes);
    size_t first = r ? (va - r->va) / c->granularity : 0, n = nbytes / c->granularity;
    if (!r) {
        rc = MP_EINVAL;
        goto out;
    }
    /* The contract unmaps whole physical allocations only, as the driver does: the range
     * starts at one's head, is mapped throughout, and the page after it starts another. */
    int whole = r->mapped[first] == PAGE_HEAD &&
                (first + n == r->npages || r->mapped[first + n] != PAGE_REST);
    for (size_t i = first; i < first + n && whole; i++) whole = r->mapped[i] != PAGE_UNMAPPED;
    if (!whole) {
        rc = MP_EINVAL;
        goto out;
    }
    CUresult e;
    CU_CALL(c, e, allocations_release_locked(c, r, first, n));
    rc = check(c, e);
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

static int cu_va_release(void *ctx, uintptr_t va, size_t nbytes) {
    mp_cuda *c = ctx;
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    size_t i = 0;
    while (i < c->nranges && !(c->ranges[i].va == va && c->ranges[i].nbytes == nbytes)) i++;
    if (i == c->nranges) {
        rc = MP_EINVAL;  /* not a reservation of this upstream, or not the whole of one */
        goto out;
    }
    mp_cuda_range *r = &c->ranges[i];
    if (r->nmapped) {
        rc = MP_EBUSY;
        goto out;
    }
    CUresult e;
    CU_CALL(c, e, D.MemAddressFree(r->va, r->nbytes));
    rc = check(c, e);
    if (rc != MP_OK) goto out;
    free(r->handles);
    free(r->mapped);
    c->ranges[i] = c->ranges[--c->nranges];
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

/* ---- Lifetime. ---- */

static void cu_destroy(void *ctx) {
    mp_cuda *c = ctx;
    /* Whatever the pool left reserved goes too: at teardown a leak is worse than strictness. */
    CUcontext prev;
    if (c->nranges && ctx_enter(c, &prev) == CUDA_SUCCESS) {
        for (size_t i = 0; i < c->nranges; i++) {
            mp_cuda_range *r = &c->ranges[i];
            allocations_release_locked(c, r, 0, r->npages);
            D.MemAddressFree(r->va, r->nbytes);
        }
        ctx_leave(prev);
    }
    for (size_t i = 0; i < c->nranges; i++) {
        free(c->ranges[i].handles);
        free(c->ranges[i].mapped);
    }
    free(c->ranges);
    pthread_mutex_destroy(&c->vmm_lock);
    free(c->plain);   /* the pool freed every segment before: none is left */
    pthread_mutex_destroy(&c->plain_lock);
    /* Frees still queued on streams are fine: the driver releases the pool's memory once
     * they complete. */
    if (c->pool && __atomic_load_n(&c->owns_pool, __ATOMIC_ACQUIRE)) {
        CUresult r;
        CU_CALL(c, r, D.MemPoolDestroy(c->pool));
        (void)r;  /* nothing to report to at teardown */
    }
    D.DevicePrimaryCtxRelease(c->dev);
    free(c);
}

static void set_err(char *err, size_t errlen, const char *fmt, ...) {
    if (!err || errlen == 0) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, errlen, fmt, ap);
    va_end(ap);
}

void mp_cuda_error_string(int code, char *buf, size_t buflen) {
    if (!buf || buflen == 0) return;
    if (code == -1) {
        snprintf(buf, buflen, "the driver returned a segment not aligned to 512 bytes");
        return;
    }
    const char *name = NULL, *desc = NULL;
    if (!d_load()) {
        if (D.GetErrorName(code, &name) != CUDA_SUCCESS) name = NULL;
        if (D.GetErrorString(code, &desc) != CUDA_SUCCESS) desc = NULL;
    }
    if (name && desc)
        snprintf(buf, buflen, "%s: %s", name, desc);
    else
        snprintf(buf, buflen, "CUDA driver error %d", code);
}

static int describe(char *err, size_t errlen, const char *what, CUresult r) {
    char text[200];
    mp_cuda_error_string(r, text, sizeof text);
    set_err(err, errlen, "%s failed: %s", what, text);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? MP_ENOMEM : MP_EUPSTREAM;
}

int mp_cuda_available(void) {
    if (d_load()) return 0;
    int n = 0;
    if (D.Init(0) != CUDA_SUCCESS || D.DeviceGetCount(&n) != CUDA_SUCCESS) return 0;
    return n > 0;
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
int mp_cuda_relax_capture_mode(void) { return mp_cuda_available() ? relaxed_enter() : -1; }

void mp_cuda_restore_capture_mode(int mode) { relaxed_leave(mode); }

int mp_cuda_last_error(const mp_upstream *up) {
    return __atomic_load_n(&((mp_cuda *)up->ctx)->last_error, __ATOMIC_RELAXED);
}

void mp_cuda_own_pool(mp_upstream *up) {
    __atomic_store_n(&((mp_cuda *)up->ctx)->owns_pool, 1, __ATOMIC_RELEASE);
}

void mp_cuda_bind_errors(mp_upstream *up) {
    __atomic_store_n(&((mp_cuda *)up->ctx)->error_slot, &up->last_error, __ATOMIC_RELEASE);
}

int mp_cuda_upstream(mp_upstream *up, int device, uintptr_t mempool_handle, char *err,
                     size_t errlen) {
    const char *why = d_load();
    if (why) {
        set_err(err, errlen, "%s", why);
        return MP_EUNSUPPORTED;
    }
    if (!up) {
        set_err(err, errlen, "no upstream struct to fill");
        return MP_EINVAL;
    }
    CUresult r = D.Init(0);
    if (r != CUDA_SUCCESS) return describe(err, errlen, "cuInit", r);
    int count = 0;
    r = D.DeviceGetCount(&count);
    if (r != CUDA_SUCCESS) return describe(err, errlen, "cuDeviceGetCount", r);
    if (device < 0 || device >= count) {
        set_err(err, errlen, "device must be a device ordinal in [0, %d), got %d", count, device);
        return MP_EINVAL;
    }
    CUdevice dev;
    r = D.DeviceGet(&dev, device);
    if (r != CUDA_SUCCESS) return describe(err, errlen, "cuDeviceGet", r);
    int pools = 0, vmm = 0;
    r = D.DeviceGetAttribute(&pools, CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED, dev);
    if (r != CUDA_SUCCESS) return describe(err, errlen, "cuDeviceGetAttribute", r);
    if (!pools) {
        set_err(err, errlen, "device %d does not support stream-ordered memory pools", device);
        return MP_EUNSUPPORTED;
    }
    if (D.has_vmm &&
        D.DeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED,
                             dev) != CUDA_SUCCESS)
        vmm = 0;

    mp_cuda *c = calloc(1, sizeof *c);
    if (!c) {
        set_err(err, errlen, "out of host memory");
        return MP_ENOMEM;
    }
    c->dev = dev;
    c->ordinal = device;
    c->pool = (CUmemoryPool)mempool_handle;
    c->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    c->prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    c->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    c->prop.location.id = device;
    c->ndevices = count;
    c->access[0].location = c->prop.location;
    c->access[0].flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    c->naccess = 1;
    if (pthread_mutex_init(&c->vmm_lock, NULL) != 0) {
        free(c);
        set_err(err, errlen, "could not initialise a mutex");
        return MP_ENOMEM;
    }
    if (pthread_mutex_init(&c->plain_lock, NULL) != 0) {
        pthread_mutex_destroy(&c->vmm_lock);
        free(c);
        set_err(err, errlen, "could not initialise a mutex");
        return MP_ENOMEM;
    }
    r = D.DevicePrimaryCtxRetain(&c->ctx, dev);
    if (r != CUDA_SUCCESS) {
        pthread_mutex_destroy(&c->plain_lock);
        pthread_mutex_destroy(&c->vmm_lock);
        free(c);
        return describe(err, errlen, "cuDevicePrimaryCtxRetain", r);
    }
    if (vmm) {
        size_t g = 0;
        CUcontext prev;
        if (ctx_enter(c, &prev) == CUDA_SUCCESS) {
            if (D.MemGetAllocationGranularity(&g, &c->prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM) !=
                CUDA_SUCCESS)
                g = 0;
            ctx_leave(prev);
        }
        /* The core aligns blocks to 512 bytes inside pages; any real granularity is a
         * multiple of that, but refuse anything that is not rather than misalign. */
        c->granularity = (g && g % 512 == 0) ? g : 0;
        c->driver_granularity = c->granularity;
    }

    memset(up, 0, sizeof *up);
    up->ctx = c;
    up->name = "cuda-pool";
    up->last_error = 0;
    up->segment_alloc = cu_segment_alloc;
    up->segment_free = cu_segment_free;
    up->event_create = cu_event_create;
    up->event_record = cu_event_record;
    up->event_query = cu_event_query;
    up->stream_wait_event = cu_stream_wait_event;
    up->event_destroy = cu_event_destroy;
    up->stream_synchronize = cu_stream_synchronize;
    up->stream_query = cu_stream_query;
    up->device_synchronize = cu_device_synchronize;
    up->trim = cu_trim;
    if (D.has_capture) up->stream_capturing = cu_stream_capturing;
    if ((D.StreamGetCaptureInfo3 || D.StreamGetCaptureInfo2) &&
        (D.GraphNodeGetDependencies2 || D.GraphNodeGetDependencies1)) {
        up->capture_frontier = cu_capture_frontier;   /* Note [Capture reuse] */
        up->capture_follows = cu_capture_follows;
    }
    up->mem_info = cu_mem_info;
    up->granularity = c->granularity;
    if (c->granularity) {
        up->va_reserve = cu_va_reserve;
        up->map = cu_map;
        up->unmap = cu_unmap;
        up->va_release = cu_va_release;
    }
    up->destroy = cu_destroy;
    return MP_OK;
}

int mp_cuda_set_page_size(mp_upstream *up, size_t page, char *err, size_t errlen) {
    if (!mp_cuda_owns(up)) {
        set_err(err, errlen, "not an upstream made by mp_cuda_upstream");
        return MP_EINVAL;
    }
    mp_cuda *c = up->ctx;
    if (!c->driver_granularity) {
        set_err(err, errlen, "device %d has no virtual memory management, so no expandable "
                "segments and no page size", c->ordinal);
        return MP_EUNSUPPORTED;
    }
    /* A power of two times the granularity: reservations are aligned to the page (the
     * core finds page edges by address), and the driver aligns them to powers of two. */
    size_t times = page / c->driver_granularity;
    if (page == 0 || page % c->driver_granularity || (times & (times - 1))) {
        set_err(err, errlen, "a page must be the driver's allocation granularity on device %d "
                "(%zu bytes) times a power of two, got %zu", c->ordinal,
                c->driver_granularity, page);
        return MP_EINVAL;
    }
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    if (c->nranges) {
        set_err(err, errlen, "the page size cannot change once address space is reserved");
        rc = MP_EBUSY;
    } else {
        c->granularity = page;
        up->granularity = page;
    }
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

/* ---- Peer access (Note [Peer access]). ---- */

/* Apply `desc` to the first `limit` runs of mapped pages of every range, in order; *done
 * receives how many were applied. Caller holds vmm_lock and has the context current. */
static CUresult runs_set_access_locked(mp_cuda *c, const CUmemAccessDesc *desc, size_t limit,
                                       size_t *done) {
    const size_t g = c->granularity;
    size_t n = 0;
    CUresult e = CUDA_SUCCESS;
    for (size_t i = 0; i < c->nranges && e == CUDA_SUCCESS; i++) {
        mp_cuda_range *r = &c->ranges[i];
        size_t p = 0;
        while (p < r->npages && e == CUDA_SUCCESS) {
            if (!r->mapped[p]) {
                p++;
                continue;
            }
            size_t end = p;
            while (end < r->npages && r->mapped[end]) end++;
            if (n == limit) goto out;
            e = D.MemSetAccess(r->va + p * g, (end - p) * g, desc, 1);
            if (e == CUDA_SUCCESS) n++;
            p = end;
        }
    }
out:
    *done = n;
    return e;
}

/* The cudaMemPool the segments come from (the device's current one when none was given). */
static CUresult pool_of(mp_cuda *c, CUmemoryPool *pool) {
    *pool = c->pool;
    if (*pool) return CUDA_SUCCESS;
    return D.DeviceGetMemPool ? D.DeviceGetMemPool(pool, c->dev) : CUDA_ERROR_INVALID_VALUE;
}

int mp_cuda_enable_peer_access(mp_upstream *up, int peer, char *err, size_t errlen) {
    mp_cuda *c = up->ctx;
    if (peer < 0 || peer >= c->ndevices) {
        set_err(err, errlen, "peer_device must be a device ordinal in [0, %d), got %d",
                c->ndevices, peer);
        return MP_EINVAL;
    }
    if (peer == c->ordinal) {
        set_err(err, errlen, "peer_device %d is the pool's own device, which always has access",
                peer);
        return MP_EINVAL;
    }
    if (!D.DeviceCanAccessPeer || !D.MemPoolSetAccess || (c->granularity && !D.MemSetAccess)) {
        set_err(err, errlen, "the CUDA driver lacks cuDeviceCanAccessPeer or cuMemPoolSetAccess");
        return MP_EUNSUPPORTED;
    }
    CUdevice peer_dev;
    int can = 0;
    CUresult e = D.DeviceGet(&peer_dev, peer);
    if (e == CUDA_SUCCESS) e = D.DeviceCanAccessPeer(&can, peer_dev, c->dev);
    if (e != CUDA_SUCCESS) return describe(err, errlen, "cuDeviceCanAccessPeer", e);
    if (!can) {
        set_err(err, errlen, "device %d cannot access the memory of device %d "
                "(cuDeviceCanAccessPeer: no peer path between them)", peer, c->ordinal);
        return MP_EUNSUPPORTED;
    }
    int rc = MP_OK;
    pthread_mutex_lock(&c->vmm_lock);
    for (size_t i = 1; i < c->naccess; i++)
        if (c->access[i].location.id == peer) goto out;   /* enabled already */
    if (c->naccess == MP_CUDA_MAX_ACCESS) {
        set_err(err, errlen, "at most %d peer devices are supported", MP_CUDA_MAX_ACCESS - 1);
        rc = MP_EUNSUPPORTED;
        goto out;
    }
    CUmemAccessDesc grant = {{CU_MEM_LOCATION_TYPE_DEVICE, peer},
                             CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    CUmemAccessDesc revoke = {{CU_MEM_LOCATION_TYPE_DEVICE, peer}, CU_MEM_ACCESS_FLAGS_PROT_NONE};
    CUcontext prev;
    size_t granted = 0, undone = 0;
    const char *what = "cuCtxSetCurrent";
    e = ctx_enter(c, &prev);
    if (e == CUDA_SUCCESS) {
        what = "cuMemSetAccess (expandable segments)";
        e = runs_set_access_locked(c, &grant, SIZE_MAX, &granted);
        if (e == CUDA_SUCCESS) {
            CUmemoryPool pool;
            what = "cuMemPoolSetAccess";
            e = pool_of(c, &pool);
            if (e == CUDA_SUCCESS) e = D.MemPoolSetAccess(pool, &grant, 1);
        }
        if (e != CUDA_SUCCESS) runs_set_access_locked(c, &revoke, granted, &undone);
        ctx_leave(prev);
    }
    if (e != CUDA_SUCCESS) {
        rc = describe(err, errlen, what, e);
        goto out;
    }
    c->access[c->naccess++] = grant;
out:
    pthread_mutex_unlock(&c->vmm_lock);
    return rc;
}

size_t mp_cuda_peer_devices(const mp_upstream *up, int *out, size_t cap) {
    mp_cuda *c = up->ctx;
    int peers[MP_CUDA_MAX_ACCESS];
    pthread_mutex_lock(&c->vmm_lock);
    size_t n = c->naccess - 1;
    for (size_t i = 0; i < n; i++) peers[i] = c->access[i + 1].location.id;
    pthread_mutex_unlock(&c->vmm_lock);
    for (size_t i = 1; i < n; i++)   /* a handful of entries: insertion sort */
        for (size_t j = i; j > 0 && peers[j - 1] > peers[j]; j--) {
            int t = peers[j];
            peers[j] = peers[j - 1];
            peers[j - 1] = t;
        }
    for (size_t i = 0; i < n && i < cap; i++) out[i] = peers[i];
    return n;
}

int mp_cuda_access_mask(const mp_upstream *up, uintptr_t addr, size_t nbytes, uint64_t *mask,
                        char *err, size_t errlen) {
    mp_cuda *c = up->ctx;
    const int ndev = c->ndevices < 64 ? c->ndevices : 64;
    if (nbytes == 0) nbytes = 1;
    uint64_t m = 0;
    int rc = MP_OK;
    CUresult e = CUDA_SUCCESS;
    const char *what = "cuCtxSetCurrent";
    pthread_mutex_lock(&c->vmm_lock);
    mp_cuda_range *r = c->granularity ? range_find_locked(c, addr, nbytes) : NULL;
    if (r ? !D.MemGetAccess : !D.MemPoolGetAccess) {
        set_err(err, errlen, "the CUDA driver lacks %s",
                r ? "cuMemGetAccess" : "cuMemPoolGetAccess");
        rc = MP_EUNSUPPORTED;
        goto out;
    }
    CUcontext prev;
    e = ctx_enter(c, &prev);
    if (e != CUDA_SUCCESS) goto out;
    if (r) {
        const size_t g = c->granularity;
        what = "cuMemGetAccess";
        m = ~(uint64_t)0;
        const size_t last = (addr + nbytes - 1 - r->va) / g;
        for (size_t p = (addr - r->va) / g; m && e == CUDA_SUCCESS && p <= last; p++) {
            if (!r->mapped[p]) {
                m = 0;   /* an unmapped page: nobody reaches all of the range */
                break;
            }
            for (int d = 0; d < ndev && e == CUDA_SUCCESS; d++) {
                unsigned long long flags = 0;
                CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, d};
                e = D.MemGetAccess(&flags, &loc, r->va + p * g);
                if (e == CUDA_SUCCESS && flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                    m &= ~((uint64_t)1 << d);
            }
        }
        if (ndev < 64) m &= ((uint64_t)1 << ndev) - 1;
    } else {
        CUmemoryPool pool;
        what = "cuMemPoolGetAccess";
        e = pool_of(c, &pool);
        for (int d = 0; d < ndev && e == CUDA_SUCCESS; d++) {
            int flags = 0;
            CUmemLocation loc = {CU_MEM_LOCATION_TYPE_DEVICE, d};
            e = D.MemPoolGetAccess(&flags, pool, &loc);
            if (e == CUDA_SUCCESS && flags == CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
                m |= (uint64_t)1 << d;
        }
    }
    ctx_leave(prev);
out:
    pthread_mutex_unlock(&c->vmm_lock);
    if (rc == MP_OK && e != CUDA_SUCCESS) rc = describe(err, errlen, what, e);
    if (rc == MP_OK) *mask = m;
    return rc;
}

/* ---- Plain segments for private pools (Note [Torch allocator glue]). ----
 *
 * A CUDA graph's private pool gets its segments while the graph's stream captures, and a
 * stream-ordered allocation on a capturing stream would become a node of the graph: its
 * memory would exist only while the graph runs. Every segment of such a pool is therefore a
 * plain one, as a capture segment is (Note [Capture segments]): plain_alloc makes it, in the
 * thread's relaxed capture mode, and cu_segment_free gives it back with cuMemFree, which the
 * owner calls only once no capture is under way. */

static int cu_plain_segment_alloc(void *ctx, size_t nbytes, uintptr_t stream, uintptr_t *out) {
    mp_cuda *c = ctx;
    if (nbytes == 0 || !out) return MP_EINVAL;
    CUdeviceptr p = 0;
    int rc = plain_alloc(c, nbytes, &p);
    if (rc != MP_OK) return rc;
    if (p & 511) {   /* the contract's 512-byte alignment, as cu_segment_alloc checks */
        cu_segment_free(c, (uintptr_t)p, nbytes, stream);
        return fail(c, -1);
    }
    *out = (uintptr_t)p;
    return MP_OK;
}

int mp_cuda_owns(const mp_upstream *up) { return up && up->destroy == cu_destroy; }

int mp_cuda_plain_upstream(const mp_upstream *like, mp_upstream *out) {
    if (!mp_cuda_owns(like) || !out) return MP_EINVAL;
    if (!D.has_capture) return MP_EUNSUPPORTED;   /* no cuMemAlloc or capture modes */
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
