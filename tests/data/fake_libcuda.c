/* A stand-in for the CUDA driver (libcuda.so.1), for testing the bookkeeping of
 * mempool/_csrc/upstream/mp_cuda.c on a machine with no GPU: the entry points the upstream resolves,
 * over four fake devices of which 0, 1 and 3 are peers of each other and 2 reaches no one.
 * Virtual memory is modelled page by page (which device may access each mapped page, as
 * cuMemSetAccess leaves it), and so is each memory pool's access (cuMemPoolSetAccess). No
 * memory is ever touched.
 *
 * Sharing with other processes is modelled too (below): exported pools and allocations are
 * memfds holding what they name, so that a process that took one (pidfd_getfd) can check it.
 *
 * Built by tests/upstreams/test_cuda_fake_driver.py as libcuda.so.1; the fake_* functions are its
 * controls and probes. FAKE_NO_VMM=1 in the environment turns virtual memory off;
 * FAKE_NO_SHARE_PAGES=1 makes cuMemCreate refuse exportable allocations. */
#define _GNU_SOURCE
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, INVALID_DEVICE = 101, NOT_MAPPED = 211,
       NOT_SUPPORTED = 801, UNKNOWN = 999 };

#define NDEV 4
#define GRAN ((size_t)2 << 20)
#define MAX_PAGES 4096
#define MAX_HANDLES 4096
#define MAX_POOLS 16

typedef struct { int type, id; } Loc;
typedef struct { Loc location; int flags; } AccessDesc;
typedef struct {
    int type, requestedHandleTypes;
    Loc location;
    void *win32;
    unsigned char flags[8];
} AllocProp;

/* A mapping of a handle covers its pages whole: `start`/`len` of the mapping each page is
 * part of, since the driver unmaps only whole mappings. */
static struct { CUdeviceptr addr, start; size_t len; unsigned mask; int owner, used; }
    pages[MAX_PAGES];
static struct { size_t size; int owner, used, types, imported; } handles[MAX_HANDLES];
static int create_calls, map_calls;
static struct { int owner, types, imported, destroyed; unsigned mask; } pools[MAX_POOLS];
static int npools;
static CUdeviceptr next_va = 0x7f0000000000ull, next_seg = 0x600000000000ull;
static uintptr_t next_event = 1;
static __thread void *current;
static int set_access_calls, pool_set_access_calls;
static int fail_set_access_after = -1, fail_pool_access = 0;

static int can_access(int dev, int peer) { return dev != peer && dev != 2 && peer != 2; }

static int page_index(CUdeviceptr addr) {
    for (int i = 0; i < MAX_PAGES; i++)
        if (pages[i].used && pages[i].addr == addr) return i;
    return -1;
}

/* ---- controls and probes ---- */

/* A new pool owned by `device`, accessible from it alone; returns its handle. */
uintptr_t fake_make_pool(int device) {
    pools[npools].owner = device;
    pools[npools].mask = 1u << device;
    return 0x5000 + (uintptr_t)npools++;
}
/* The same, created with the POSIX file-descriptor handle type (exportable). */
uintptr_t fake_make_shareable_pool(int device) {
    pools[npools].types = 1;
    return fake_make_pool(device);
}
/* Devices that may access the mapped page at addr (bit d), or -1 when it is not mapped. */
int fake_page_access(CUdeviceptr addr) {
    int i = page_index(addr);
    return i < 0 ? -1 : (int)pages[i].mask;
}
int fake_pool_access(uintptr_t pool) { return (int)pools[pool - 0x5000].mask; }
int fake_mapped_pages(void) {
    int n = 0;
    for (int i = 0; i < MAX_PAGES; i++) n += pages[i].used;
    return n;
}
int fake_set_access_calls(void) { return set_access_calls; }
int fake_create_calls(void) { return create_calls; }
int fake_map_calls(void) { return map_calls; }
/* Physical allocations alive (created and not released). */
int fake_live_handles(void) {
    int n = 0;
    for (int i = 0; i < MAX_HANDLES; i++) n += handles[i].used;
    return n;
}
int fake_pool_set_access_calls(void) { return pool_set_access_calls; }
/* The cuMemSetAccess call after the next n succeeds fails (with CUDA_ERROR_UNKNOWN). */
void fake_fail_set_access_after(int n) { fail_set_access_after = n; }
/* The next cuMemPoolSetAccess fails (with CUDA_ERROR_UNKNOWN). */
void fake_fail_pool_access(void) { fail_pool_access = 1; }

/* ---- the driver ---- */

CUresult cuInit(unsigned flags) { (void)flags; return OK; }
CUresult cuDeviceGetCount(int *n) { *n = NDEV; return OK; }
CUresult cuDeviceGet(int *dev, int ordinal) {
    if (ordinal < 0 || ordinal >= NDEV) return INVALID_DEVICE;
    *dev = ordinal;
    return OK;
}
CUresult cuDeviceGetAttribute(int *v, int attr, int dev) {
    (void)dev;
    const char *novmm = getenv("FAKE_NO_VMM");
    *v = attr == 115 ? 1 : attr == 102 ? !(novmm && novmm[0] == '1') : 0;
    return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, int dev) {
    *ctx = (void *)(uintptr_t)(0x100 + 16 * dev);
    return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(int dev) { (void)dev; return OK; }
CUresult cuCtxGetCurrent(void **ctx) { *ctx = current; return OK; }
CUresult cuCtxSetCurrent(void *ctx) { current = ctx; return OK; }
CUresult cuGetErrorName(CUresult r, const char **s) {
    *s = r == INVALID_VALUE ? "CUDA_ERROR_INVALID_VALUE" : r == NOT_SUPPORTED
         ? "CUDA_ERROR_NOT_SUPPORTED" : r == INVALID_DEVICE
         ? "CUDA_ERROR_INVALID_DEVICE" : r == UNKNOWN ? "CUDA_ERROR_UNKNOWN" : "CUDA_ERROR_OTHER";
    return OK;
}
CUresult cuGetErrorString(CUresult r, const char **s) {
    (void)r;
    *s = "fake driver error";
    return OK;
}
static uintptr_t capturing_stream;   /* graph capture, below: the stream capturing, or 0 */
static int capture_counts[10];
static __thread int capture_mode;   /* the thread's capture mode: 0 global .. 2 relaxed */

/* Segments of pools (cuMemAllocFromPoolAsync) and pointers imported from other processes'
 * pools, for the sharing calls below. */
#define MAX_SEGS 4096
static struct { CUdeviceptr addr; size_t size; int pool, live, imported; unsigned seq; }
    segs[MAX_SEGS];
static int nsegs;
static unsigned next_seq = 1;

static int seg_index(CUdeviceptr p) {
    for (int i = nsegs - 1; i >= 0; i--)
        if (segs[i].live && segs[i].addr == p) return i;
    return -1;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr *p, size_t n, void *pool, void *stream) {
    capture_counts[3]++;
    if (capturing_stream && (uintptr_t)stream == capturing_stream) capture_counts[2]++;
    *p = next_seg;
    next_seg += (n + GRAN - 1) / GRAN * GRAN;
    if (nsegs < MAX_SEGS)
        segs[nsegs++] = (typeof(segs[0])){*p, n, pool ? (int)((uintptr_t)pool - 0x5000) : -1, 1,
                                          0, next_seq++};
    return OK;
}
CUresult cuMemAllocAsync(CUdeviceptr *p, size_t n, void *stream) {
    return cuMemAllocFromPoolAsync(p, n, NULL, stream);
}
static int share_counts[10];

CUresult cuMemFreeAsync(CUdeviceptr p, void *stream) {
    (void)stream;
    capture_counts[5]++;
    int i = seg_index(p);
    if (i >= 0) {
        if (segs[i].imported) share_counts[6]++;
        segs[i].live = 0;
    }
    return OK;
}
CUresult cuMemPoolDestroy(void *pool) {
    size_t i = (uintptr_t)pool - 0x5000;
    if (i >= (size_t)npools || pools[i].destroyed) return INVALID_VALUE;
    pools[i].destroyed = 1;
    share_counts[7] += pools[i].imported;
    return OK;
}
CUresult cuEventCreate(void **e, unsigned flags) {
    (void)flags;
    *e = (void *)next_event++;
    return OK;
}
CUresult cuEventRecord(void *e, void *s) { (void)e; (void)s; return OK; }
CUresult cuEventQuery(void *e) { (void)e; return OK; }
CUresult cuEventDestroy_v2(void *e) { (void)e; return OK; }
CUresult cuStreamWaitEvent(void *s, void *e, unsigned f) { (void)s; (void)e; (void)f; return OK; }
CUresult cuStreamSynchronize(void *s) { (void)s; return OK; }
CUresult cuStreamQuery(void *s) { (void)s; return OK; }
CUresult cuCtxSynchronize(void) { return OK; }
CUresult cuMemGetInfo_v2(size_t *free_bytes, size_t *total) {
    *free_bytes = *total = (size_t)80 << 30;
    return OK;
}

CUresult cuMemGetAllocationGranularity(size_t *g, const AllocProp *prop, int option) {
    (void)prop; (void)option;
    *g = GRAN;
    return OK;
}
CUresult cuMemAddressReserve(CUdeviceptr *p, size_t n, size_t align, CUdeviceptr addr,
                             unsigned long long flags) {
    (void)addr; (void)flags;
    if (n % GRAN || (align & (align - 1))) return INVALID_VALUE;
    capture_counts[9] += capture_mode == 2;
    if (align > 1) next_va = (next_va + align - 1) / align * align;
    *p = next_va;
    next_va += n + GRAN;   /* a gap: reservations are never adjacent */
    return OK;
}
CUresult cuMemAddressFree(CUdeviceptr p, size_t n) { (void)p; (void)n; return OK; }
CUresult cuMemCreate(unsigned long long *h, size_t n, const AllocProp *prop,
                     unsigned long long flags) {
    (void)flags;
    if (n == 0 || n % GRAN) return INVALID_VALUE;
    const char *noshare = getenv("FAKE_NO_SHARE_PAGES");
    if (prop->requestedHandleTypes && noshare && noshare[0] == '1') return NOT_SUPPORTED;
    create_calls++;
    for (int i = 1; i < MAX_HANDLES; i++)
        if (!handles[i].used) {
            handles[i].used = 1;
            handles[i].size = n;
            handles[i].owner = prop->location.id;
            handles[i].types = prop->requestedHandleTypes;
            handles[i].imported = 0;
            *h = (unsigned long long)i;
            return OK;
        }
    return OUT_OF_MEMORY;
}
CUresult cuMemRelease(unsigned long long h) {
    if (h == 0 || h >= MAX_HANDLES || !handles[h].used) return INVALID_VALUE;
    handles[h].used = 0;
    return OK;
}
CUresult cuMemMap(CUdeviceptr p, size_t n, size_t offset, unsigned long long h,
                  unsigned long long flags) {
    (void)flags;
    if (h == 0 || h >= MAX_HANDLES || !handles[h].used) return INVALID_VALUE;
    if (n == 0 || n % GRAN || p % GRAN || offset % GRAN || offset + n > handles[h].size)
        return INVALID_VALUE;
    /* As the driver (an H200, CUDA 13): a physical allocation is mapped whole; an offset into
     * it, or part of it, is not supported. */
    if (offset != 0 || n != handles[h].size) return NOT_SUPPORTED;
    map_calls++;
    for (CUdeviceptr a = p; a < p + n; a += GRAN)
        if (page_index(a) >= 0) return INVALID_VALUE;
    capture_counts[8] += capture_mode == 2;
    size_t want = n / GRAN, found = 0;
    for (int i = 0; i < MAX_PAGES && found < want; i++) found += !pages[i].used;
    if (found < want) return OUT_OF_MEMORY;
    CUdeviceptr a = p;
    for (int i = 0; i < MAX_PAGES && a < p + n; i++)
        if (!pages[i].used) {
            pages[i].used = 1;
            pages[i].addr = a;
            pages[i].start = p;
            pages[i].len = n;
            pages[i].owner = handles[h].owner;
            pages[i].mask = 0;   /* as the driver: nobody has access until cuMemSetAccess */
            a += GRAN;
        }
    return OK;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t n) {
    /* As the driver: only whole mappings, so [p, p + n) must start and end at their edges. */
    for (CUdeviceptr a = p; a < p + n; a += GRAN) {
        int i = page_index(a);
        if (i < 0 || pages[i].start < p || pages[i].start + pages[i].len > p + n)
            return INVALID_VALUE;
    }
    for (CUdeviceptr a = p; a < p + n; a += GRAN) pages[page_index(a)].used = 0;
    return OK;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const AccessDesc *desc, size_t count) {
    if (fail_set_access_after == 0) {
        fail_set_access_after = -1;
        return UNKNOWN;
    }
    if (fail_set_access_after > 0) fail_set_access_after--;
    if (n == 0 || n % GRAN) return INVALID_VALUE;
    for (CUdeviceptr a = p; a < p + n; a += GRAN) {
        int i = page_index(a);
        if (i < 0) return INVALID_VALUE;   /* the range must be fully mapped */
        for (size_t k = 0; k < count; k++) {
            int d = desc[k].location.id;
            if (desc[k].location.type != 1 || d < 0 || d >= NDEV) return INVALID_DEVICE;
            if (d != pages[i].owner && !can_access(d, pages[i].owner)) return INVALID_DEVICE;
        }
    }
    set_access_calls++;
    for (CUdeviceptr a = p; a < p + n; a += GRAN) {
        int i = page_index(a);
        for (size_t k = 0; k < count; k++) {
            unsigned bit = 1u << desc[k].location.id;
            pages[i].mask = desc[k].flags == 3 ? pages[i].mask | bit : pages[i].mask & ~bit;
        }
    }
    return OK;
}
CUresult cuMemGetAccess(unsigned long long *flags, const Loc *loc, CUdeviceptr p) {
    int i = page_index(p / GRAN * GRAN);
    if (i < 0) return NOT_MAPPED;
    *flags = pages[i].mask >> loc->id & 1 ? 3 : 0;
    return OK;
}

CUresult cuDeviceCanAccessPeer(int *can, int dev, int peer) {
    if (dev < 0 || dev >= NDEV || peer < 0 || peer >= NDEV) return INVALID_DEVICE;
    *can = can_access(dev, peer);
    return OK;
}
CUresult cuDeviceGetMemPool(void **pool, int dev) {
    (void)pool; (void)dev;
    return INVALID_VALUE;   /* the tests always pass a pool */
}
CUresult cuMemPoolSetAccess(void *pool, const AccessDesc *desc, size_t count) {
    size_t i = (uintptr_t)pool - 0x5000;
    if (i >= (size_t)npools) return INVALID_VALUE;
    if (fail_pool_access) {
        fail_pool_access = 0;
        return UNKNOWN;
    }
    for (size_t k = 0; k < count; k++) {
        int d = desc[k].location.id;
        if (pools[i].imported && d >= 0 && d < NDEV && (d == pools[i].owner ||
                                                        can_access(d, pools[i].owner)))
            continue;   /* an importer grants its own device, the pool's included */
        if (d < 0 || d >= NDEV || d == pools[i].owner || !can_access(d, pools[i].owner))
            return INVALID_DEVICE;
    }
    pool_set_access_calls++;
    for (size_t k = 0; k < count; k++) {
        unsigned bit = 1u << desc[k].location.id;
        pools[i].mask = desc[k].flags == 3 ? pools[i].mask | bit : pools[i].mask & ~bit;
    }
    return OK;
}
CUresult cuMemPoolGetAccess(int *flags, void *pool, Loc *loc) {
    size_t i = (uintptr_t)pool - 0x5000;
    if (i >= (size_t)npools || loc->id < 0 || loc->id >= NDEV) return INVALID_VALUE;
    *flags = pools[i].mask >> loc->id & 1 ? 3 : 0;
    return OK;
}

/* ---- graph capture (Note [Capture segments] in mp_cuda.c) ---- */

/* Make `stream` capture (0: end the capture). */
void fake_begin_capture(uintptr_t stream) { capturing_stream = stream; }
/* Counts: 0 cuMemAlloc, 1 of those in relaxed mode, 2 cuMemAllocFromPoolAsync on the
 * capturing stream, 3 cuMemAllocFromPoolAsync, 4 cuMemFree, 5 cuMemFreeAsync, 6 cuMemFree
 * while a capture runs, 8 cuMemMap and 9 cuMemAddressReserve in relaxed mode; 7: the calling
 * thread's capture mode now. */
int fake_capture_count(int what) { return what == 7 ? capture_mode : capture_counts[what]; }

CUresult cuStreamIsCapturing(void *stream, int *status) {
    /* The legacy stream cannot be asked while another stream captures. */
    if (!stream && capturing_stream) return 906;   /* CUDA_ERROR_STREAM_CAPTURE_IMPLICIT */
    *status = capturing_stream && (uintptr_t)stream == capturing_stream;
    return OK;
}
CUresult cuThreadExchangeStreamCaptureMode(int *mode) {
    int old = capture_mode;
    capture_mode = *mode;
    *mode = old;
    return OK;
}
CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
    capture_counts[0]++;
    capture_counts[1] += capture_mode == 2;
    *p = next_seg;
    next_seg += (n + GRAN - 1) / GRAN * GRAN;
    return OK;
}
CUresult cuMemFree_v2(CUdeviceptr p) {
    int i = seg_index(p);
    if (i >= 0 && segs[i].imported) {
        share_counts[6]++;
        segs[i].live = 0;
    }
    capture_counts[4]++;
    capture_counts[6] += capturing_stream != 0;
    return OK;
}

/* ---- the capture's graph (Note [Capture reuse] in core/mp_stream.c) ----
 * Nodes with their dependencies, and the frontier of the capturing stream, which
 * cuStreamGetCaptureInfo reports. Both queries answer as the driver's may: the count alone
 * without an array, and CUDA_ERROR_LOSSY_QUERY for an array without edge data (the driver
 * does so when an edge carries data, after cuStreamUpdateCaptureDependencies_v2 say). */
typedef struct fake_node {
    struct fake_node *parents[64];
    size_t nparents;
} fake_node;
static fake_node fake_nodes[256];
static size_t fake_nnodes;
static fake_node *fake_frontier[64];
static size_t fake_nfrontier;
static int graph_calls[2];   /* 0 cuStreamGetCaptureInfo, 1 cuGraphNodeGetDependencies */

void *fake_node_new(void) { return &fake_nodes[fake_nnodes++]; }
void fake_node_depends(void *node, void *parent) {
    fake_node *f = node;
    f->parents[f->nparents++] = parent;
}
/* Add `node` to the capturing stream's frontier; NULL empties it. */
void fake_frontier_add(void *node) {
    if (!node) fake_nfrontier = 0;
    else fake_frontier[fake_nfrontier++] = node;
}
int fake_graph_calls(int what) { return graph_calls[what]; }

CUresult cuStreamGetCaptureInfo_v3(void *stream, int *status, unsigned long long *id,
                                   void **graph, void *const **deps, const void **edges,
                                   size_t *n) {
    graph_calls[0]++;
    if (!stream && capturing_stream) return 906;
    if (deps && !edges) return 920;   /* CUDA_ERROR_LOSSY_QUERY */
    *status = capturing_stream && (uintptr_t)stream == capturing_stream;
    if (*status) {
        if (id) *id = 0x1234;
        if (graph) *graph = (void *)0x4321;
        if (deps) *deps = (void *const *)fake_frontier;
        if (edges) *edges = NULL;
        if (n) *n = fake_nfrontier;
    }
    return OK;
}

CUresult cuGraphNodeGetDependencies_v2(void *node, void **deps, void *edges, size_t *n) {
    graph_calls[1]++;
    fake_node *f = node;
    if (!deps) {
        *n = f->nparents;
        return OK;
    }
    if (!edges) return 920;   /* CUDA_ERROR_LOSSY_QUERY */
    size_t k = *n < f->nparents ? *n : f->nparents;
    for (size_t i = 0; i < k; i++) deps[i] = f->parents[i];
    for (size_t i = k; i < *n; i++) deps[i] = NULL;
    memset(edges, 0, *n * 8);
    *n = k;
    return OK;
}

/* ---- sharing with other processes (Note [Sharing CUDA memory] in mp_cuda_share.c) ----
 * An exported pool or allocation is a memfd holding a record of it; export data of a pointer
 * is a record too. Importing reads the record back: a descriptor the fake did not make is
 * refused. Imports get fresh addresses (no memory is ever touched). */
typedef struct { char magic[4]; int pid, index, owner; unsigned long long size, seq; } record;

static int export_fd(const char *magic, int index, int owner, size_t size, unsigned seq) {
    int fd = memfd_create("fake-cuda-export", MFD_CLOEXEC);
    if (fd < 0) return -1;
    record r = {{0}, getpid(), index, owner, size, seq};
    memcpy(r.magic, magic, 4);
    if (write(fd, &r, sizeof r) != (ssize_t)sizeof r) {
        close(fd);
        return -1;
    }
    return fd;
}

static int read_record(int fd, const char *magic, record *r) {
    return pread(fd, r, sizeof *r, 0) == (ssize_t)sizeof *r && !memcmp(r->magic, magic, 4);
}

/* 0 pool exports, 1 pointer exports, 2 pool imports, 3 pointer imports, 4 allocation
 * exports, 5 allocation imports, 6 imported pointers freed, 7 imported pools destroyed. */
int fake_share_count(int what) { return share_counts[what]; }
/* Imported pointers not freed yet. */
int fake_live_imported_pointers(void) {
    int n = 0;
    for (int i = 0; i < nsegs; i++) n += segs[i].live && segs[i].imported;
    return n;
}
/* Imported pools not destroyed yet. */
int fake_live_imported_pools(void) {
    int n = 0;
    for (int i = 0; i < npools; i++) n += pools[i].imported && !pools[i].destroyed;
    return n;
}

CUresult cuMemPoolExportToShareableHandle(void *out, void *pool, int type,
                                          unsigned long long flags) {
    size_t i = (uintptr_t)pool - 0x5000;
    if (i >= (size_t)npools || flags || type != 1 || !(pools[i].types & 1) || pools[i].imported)
        return INVALID_VALUE;
    int fd = export_fd("POOL", (int)i, pools[i].owner, 0, 0);
    if (fd < 0) return UNKNOWN;
    *(int *)out = fd;
    share_counts[0]++;
    return OK;
}
CUresult cuMemPoolImportFromShareableHandle(void **out, void *handle, int type,
                                            unsigned long long flags) {
    record r;
    if (flags || type != 1 || !read_record((int)(uintptr_t)handle, "POOL", &r) ||
        npools == MAX_POOLS)
        return INVALID_VALUE;
    pools[npools].owner = r.owner;
    pools[npools].imported = 1;
    pools[npools].mask = 0;   /* as the driver: the importer grants its own access */
    *out = (void *)(0x5000 + (uintptr_t)npools++);
    share_counts[2]++;
    return OK;
}
CUresult cuMemPoolExportPointer(unsigned char *data, CUdeviceptr p) {
    int i = seg_index(p);
    if (i < 0 || segs[i].imported || segs[i].pool < 0 || !(pools[segs[i].pool].types & 1))
        return INVALID_VALUE;
    record r = {"SEGM", getpid(), segs[i].pool, 0, segs[i].size, segs[i].seq};
    memset(data, 0, 64);
    memcpy(data, &r, sizeof r);
    share_counts[1]++;
    return OK;
}
CUresult cuMemPoolImportPointer(CUdeviceptr *out, void *pool, const unsigned char *data) {
    size_t k = (uintptr_t)pool - 0x5000;
    record r;
    memcpy(&r, data, sizeof r);
    if (k >= (size_t)npools || !pools[k].imported || pools[k].destroyed ||
        memcmp(r.magic, "SEGM", 4) || nsegs == MAX_SEGS)
        return INVALID_VALUE;
    *out = next_seg;
    next_seg += (r.size + GRAN - 1) / GRAN * GRAN;
    segs[nsegs++] = (typeof(segs[0])){*out, r.size, (int)k, 1, 1, next_seq++};
    share_counts[3]++;
    return OK;
}
CUresult cuMemExportToShareableHandle(void *out, unsigned long long h, int type,
                                      unsigned long long flags) {
    if (h == 0 || h >= MAX_HANDLES || !handles[h].used || flags || type != 1 ||
        !(handles[h].types & 1))
        return INVALID_VALUE;
    int fd = export_fd("HNDL", (int)h, handles[h].owner, handles[h].size, 0);
    if (fd < 0) return UNKNOWN;
    *(int *)out = fd;
    share_counts[4]++;
    return OK;
}
CUresult cuMemImportFromShareableHandle(unsigned long long *out, void *handle, int type) {
    record r;
    if (type != 1 || !read_record((int)(uintptr_t)handle, "HNDL", &r)) return INVALID_VALUE;
    for (int i = 1; i < MAX_HANDLES; i++)
        if (!handles[i].used) {
            handles[i].used = 1;
            handles[i].size = r.size;
            handles[i].owner = r.owner;
            handles[i].types = 1;
            handles[i].imported = 1;
            *out = (unsigned long long)i;
            share_counts[5]++;
            return OK;
        }
    return OUT_OF_MEMORY;
}
