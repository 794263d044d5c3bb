/* The CUDA driver as the CUDA upstream sees it: the few types and constants it uses, declared
 * by hand (values as in cuda.h) so that the extension builds without CUDA's headers or
 * libraries, and the table of entry points resolved from libcuda.so.1 (mp_cuda_driver.c).
 * Private to the CUDA upstream's files.
 */
#ifndef MP_CUDA_DRIVER_H
#define MP_CUDA_DRIVER_H

#include <stddef.h>

/* Shared between the CUDA upstream's files only: not exported from the extension. */
#define MP_CUDA_PRIVATE __attribute__((visibility("hidden")))

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
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 0x1
#define CU_DEVICE_ATTRIBUTE_MEMPOOL_SUPPORTED_HANDLE_TYPES 119
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

typedef struct {   /* CUmemPoolPtrExportData: opaque */
    unsigned char reserved[64];
} CUmemPoolPtrExportData;

_Static_assert(sizeof(CUmemAllocationProp) == 32, "CUmemAllocationProp layout");
_Static_assert(sizeof(CUmemAccessDesc) == 12, "CUmemAccessDesc layout");

/* ---- The driver table, resolved once per process (mp_cuda_driver.c). ---- */

typedef struct {
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
    /* Sharing with other processes (mp_cuda_share.c): optional (without them nothing is
     * shared or opened). cuMemFree (above) frees imported pointers. */
    CUresult (*MemPoolExportToShareableHandle)(void *, CUmemoryPool, int, unsigned long long);
    CUresult (*MemPoolImportFromShareableHandle)(CUmemoryPool *, void *, int,
                                                 unsigned long long);
    CUresult (*MemPoolExportPointer)(CUmemPoolPtrExportData *, CUdeviceptr);
    CUresult (*MemPoolImportPointer)(CUdeviceptr *, CUmemoryPool, CUmemPoolPtrExportData *);
    CUresult (*MemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int,
                                           unsigned long long);
    CUresult (*MemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
    int has_vmm;
    int has_capture;
    int has_share;   /* every sharing entry point, cuMemFree and cuMemPoolSetAccess resolved */
} mp_cu_driver;

extern MP_CUDA_PRIVATE mp_cu_driver mp_cu;

/* Resolve the table once: NULL when it is complete, else why not (the library or a required
 * entry point is missing). */
MP_CUDA_PRIVATE const char *cu_load(void);

#endif
