/* The CUDA driver's entry points, resolved once from libcuda.so.1 at run time (the extension
 * links against no CUDA library), and the driver's error messages.
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
 */
#include "mp_cuda_driver.h"
#include "mp_cuda_internal.h"   /* cu_set_err, cu_describe */

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

mp_cu_driver mp_cu;

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
    enum { REQUIRED, VMM, PEER, CAPTURE, SHARE, OPTIONAL };   /* what lacks when the symbol does */
    struct { void **slot; const char *name; int kind; } table[] = {
        {(void **)&mp_cu.Init, "cuInit", REQUIRED},
        {(void **)&mp_cu.DeviceGetCount, "cuDeviceGetCount", REQUIRED},
        {(void **)&mp_cu.DeviceGet, "cuDeviceGet", REQUIRED},
        {(void **)&mp_cu.DeviceGetAttribute, "cuDeviceGetAttribute", REQUIRED},
        {(void **)&mp_cu.DevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain", REQUIRED},
        {(void **)&mp_cu.DevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2", REQUIRED},
        {(void **)&mp_cu.CtxGetCurrent, "cuCtxGetCurrent", REQUIRED},
        {(void **)&mp_cu.CtxSetCurrent, "cuCtxSetCurrent", REQUIRED},
        {(void **)&mp_cu.GetErrorName, "cuGetErrorName", REQUIRED},
        {(void **)&mp_cu.GetErrorString, "cuGetErrorString", REQUIRED},
        {(void **)&mp_cu.MemAllocFromPoolAsync, "cuMemAllocFromPoolAsync", REQUIRED},
        {(void **)&mp_cu.MemAllocAsync, "cuMemAllocAsync", REQUIRED},
        {(void **)&mp_cu.MemFreeAsync, "cuMemFreeAsync", REQUIRED},
        {(void **)&mp_cu.MemPoolDestroy, "cuMemPoolDestroy", REQUIRED},
        {(void **)&mp_cu.CtxSynchronize, "cuCtxSynchronize", REQUIRED},
        {(void **)&mp_cu.EventCreate, "cuEventCreate", REQUIRED},
        {(void **)&mp_cu.EventRecord, "cuEventRecord", REQUIRED},
        {(void **)&mp_cu.EventQuery, "cuEventQuery", REQUIRED},
        {(void **)&mp_cu.EventDestroy, "cuEventDestroy_v2", REQUIRED},
        {(void **)&mp_cu.StreamWaitEvent, "cuStreamWaitEvent", REQUIRED},
        {(void **)&mp_cu.StreamSynchronize, "cuStreamSynchronize", REQUIRED},
        {(void **)&mp_cu.StreamQuery, "cuStreamQuery", REQUIRED},
        {(void **)&mp_cu.MemGetInfo, "cuMemGetInfo_v2", REQUIRED},
        {(void **)&mp_cu.MemGetAllocationGranularity, "cuMemGetAllocationGranularity", VMM},
        {(void **)&mp_cu.MemAddressReserve, "cuMemAddressReserve", VMM},
        {(void **)&mp_cu.MemAddressFree, "cuMemAddressFree", VMM},
        {(void **)&mp_cu.MemCreate, "cuMemCreate", VMM},
        {(void **)&mp_cu.MemRelease, "cuMemRelease", VMM},
        {(void **)&mp_cu.MemMap, "cuMemMap", VMM},
        {(void **)&mp_cu.MemUnmap, "cuMemUnmap", VMM},
        {(void **)&mp_cu.MemSetAccess, "cuMemSetAccess", VMM},
        {(void **)&mp_cu.DeviceCanAccessPeer, "cuDeviceCanAccessPeer", PEER},
        {(void **)&mp_cu.DeviceGetMemPool, "cuDeviceGetMemPool", PEER},
        {(void **)&mp_cu.MemPoolSetAccess, "cuMemPoolSetAccess", PEER},
        {(void **)&mp_cu.MemPoolGetAccess, "cuMemPoolGetAccess", PEER},
        {(void **)&mp_cu.MemGetAccess, "cuMemGetAccess", PEER},
        {(void **)&mp_cu.StreamIsCapturing, "cuStreamIsCapturing", CAPTURE},
        {(void **)&mp_cu.MemAlloc, "cuMemAlloc_v2", CAPTURE},
        {(void **)&mp_cu.MemFree, "cuMemFree_v2", CAPTURE},
        {(void **)&mp_cu.ThreadExchangeStreamCaptureMode, "cuThreadExchangeStreamCaptureMode",
         CAPTURE},
        {(void **)&mp_cu.MemPoolExportToShareableHandle, "cuMemPoolExportToShareableHandle",
         SHARE},
        {(void **)&mp_cu.MemPoolImportFromShareableHandle,
         "cuMemPoolImportFromShareableHandle", SHARE},
        {(void **)&mp_cu.MemPoolExportPointer, "cuMemPoolExportPointer", SHARE},
        {(void **)&mp_cu.MemPoolImportPointer, "cuMemPoolImportPointer", SHARE},
        {(void **)&mp_cu.MemExportToShareableHandle, "cuMemExportToShareableHandle", SHARE},
        {(void **)&mp_cu.MemImportFromShareableHandle, "cuMemImportFromShareableHandle", SHARE},
        {(void **)&mp_cu.MemPoolTrimTo, "cuMemPoolTrimTo", OPTIONAL},
        {(void **)&mp_cu.StreamGetCaptureInfo3, "cuStreamGetCaptureInfo_v3", OPTIONAL},
        {(void **)&mp_cu.StreamGetCaptureInfo2, "cuStreamGetCaptureInfo_v2", OPTIONAL},
        {(void **)&mp_cu.GraphNodeGetDependencies2, "cuGraphNodeGetDependencies_v2", OPTIONAL},
        {(void **)&mp_cu.GraphNodeGetDependencies1, "cuGraphNodeGetDependencies", OPTIONAL},
    };
    int has_vmm = 1, has_capture = 1, has_share = 1;
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
        if (table[i].kind == SHARE) has_share = 0;
    }
    mp_cu.has_vmm = has_vmm;
    mp_cu.has_capture = has_capture;
    /* Imported pointers are freed with cuMemFree and imported pools given access with
     * cuMemPoolSetAccess: sharing needs those too. */
    mp_cu.has_share = has_share && mp_cu.MemFree && mp_cu.MemPoolSetAccess;
}

const char *cu_load(void) {
    pthread_once(&d_once, d_resolve);
    return d_error[0] ? d_error : NULL;
}

void cu_set_err(char *err, size_t errlen, const char *fmt, ...) {
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
    if (!cu_load()) {
        if (mp_cu.GetErrorName(code, &name) != CUDA_SUCCESS) name = NULL;
        if (mp_cu.GetErrorString(code, &desc) != CUDA_SUCCESS) desc = NULL;
    }
    if (name && desc)
        snprintf(buf, buflen, "%s: %s", name, desc);
    else
        snprintf(buf, buflen, "CUDA driver error %d", code);
}

int cu_describe(char *err, size_t errlen, const char *what, CUresult r) {
    char text[200];
    mp_cuda_error_string(r, text, sizeof text);
    cu_set_err(err, errlen, "%s failed: %s", what, text);
    return r == CUDA_ERROR_OUT_OF_MEMORY ? MP_ENOMEM : MP_EUPSTREAM;
}

int mp_cuda_available(void) {
    if (cu_load()) return 0;
    int n = 0;
    if (mp_cu.Init(0) != CUDA_SUCCESS || mp_cu.DeviceGetCount(&n) != CUDA_SUCCESS) return 0;
    return n > 0;
}
