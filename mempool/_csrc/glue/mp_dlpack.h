/* DLPack ABI (dlpack.h v1.1, https://github.com/dmlc/dlpack) and mempool's exporter.
 *
 * The structs below follow dlpack.h field for field: they are the ABI consumers (PyTorch,
 * NumPy, CuPy, JAX) read, so their layout must not change. Only what mempool produces is
 * declared. Version 1.1 added enumeration values (the float8/6/4 type codes) and no layout
 * change, so a 1.0 consumer can read a 1.1 tensor whose fields it understands.
 *
 * The exporter (mp_dlpack.c) is pure C: the deleters it installs return the block to its pool
 * and may run on any thread, with or without the GIL. See docs/sharing.md,
 * "Note [DLPack ownership]".
 */
#ifndef MP_DLPACK_H
#define MP_DLPACK_H

#include <stddef.h>
#include <stdint.h>

#include "mp_core.h"

/* ---- dlpack.h ---------------------------------------------------------------------------- */

#define DLPACK_MAJOR_VERSION 1
#define DLPACK_MINOR_VERSION 1

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLOpenCL = 4,
    kDLVulkan = 7,
    kDLMetal = 8,
    kDLVPI = 9,
    kDLROCM = 10,
    kDLROCMHost = 11,
    kDLExtDev = 12,
    kDLCUDAManaged = 13,
    kDLOneAPI = 14,
    kDLWebGPU = 15,
    kDLHexagon = 16,
    kDLMAIA = 17,
} DLDeviceType;

typedef struct {
    DLDeviceType device_type;
    int32_t device_id;
} DLDevice;

typedef enum {
    kDLInt = 0U,
    kDLUInt = 1U,
    kDLFloat = 2U,
    kDLOpaqueHandle = 3U,
    kDLBfloat = 4U,
    kDLComplex = 5U,
    kDLBool = 6U,
    /* v1.1 */
    kDLFloat8_e3m4 = 7U,
    kDLFloat8_e4m3 = 8U,
    kDLFloat8_e4m3b11fnuz = 9U,
    kDLFloat8_e4m3fn = 10U,
    kDLFloat8_e4m3fnuz = 11U,
    kDLFloat8_e5m2 = 12U,
    kDLFloat8_e5m2fnuz = 13U,
    kDLFloat8_e8m0fnu = 14U,
    kDLFloat6_e2m3fn = 15U,
    kDLFloat6_e3m2fn = 16U,
    kDLFloat4_e2m1fn = 17U,
} DLDataTypeCode;

typedef struct {
    uint8_t code;    /* a DLDataTypeCode */
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;      /* in elements, not bytes */
    uint64_t byte_offset;
} DLTensor;

/* The legacy (pre-1.0) managed tensor, capsule name "dltensor". */
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DLPACK_FLAG_BITMASK_READ_ONLY (1UL << 0UL)
#define DLPACK_FLAG_BITMASK_IS_COPIED (1UL << 1UL)
#define DLPACK_FLAG_BITMASK_IS_SUBBYTE_TYPE_PADDED (1UL << 2UL)

/* The versioned managed tensor (DLPack >= 1.0), capsule name "dltensor_versioned". */
typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* ---- mempool's exporter ------------------------------------------------------------------ */

#define MP_DL_CAPSULE "dltensor"
#define MP_DL_CAPSULE_USED "used_dltensor"
#define MP_DL_CAPSULE_VERSIONED "dltensor_versioned"
#define MP_DL_CAPSULE_VERSIONED_USED "used_dltensor_versioned"

/* A block shared by its holders: the Buffer objects that view it and the managed tensors
 * exported from them. The last holder to let go frees the block (in stream order, on the
 * block's own stream; see mp_free) and drops the reference on the pool that keeps the pool
 * alive while any of its memory is in use. An empty buffer holds no block (ptr == 0). */
typedef struct mp_dl_block {
    mp_pool *pool;     /* one reference (mp_pool_retain), dropped with the last holder */
    uintptr_t ptr;     /* block start; 0: no block */
    size_t nbytes;     /* bytes the holders may address from ptr */
    int refs;          /* atomic */
} mp_dl_block;

/* Allocate nbytes (> 0) on `stream` and wrap the block, or wrap nothing when nbytes == 0.
 * One reference for the caller. Returns the mp_alloc code (MP_ENOMEM on a failed malloc of
 * the wrapper; the block is then freed again). */
int mp_dl_block_new(mp_pool *p, size_t nbytes, uintptr_t stream, mp_dl_block **out);
void mp_dl_block_retain(mp_dl_block *b);
void mp_dl_block_release(mp_dl_block *b);
/* Wrappers alive now, process-wide: Buffers and exported tensors not yet deleted. */
int64_t mp_dl_live_blocks(void);

/* What an export describes: a C-contiguous view of `b` starting byte_offset bytes in. */
typedef struct mp_dl_view {
    DLDevice device;
    DLDataType dtype;
    int32_t ndim;
    const int64_t *shape;        /* ndim entries */
    const int64_t *strides;      /* ndim entries, in elements */
    uint64_t byte_offset;
    uint64_t flags;              /* DLPACK_FLAG_BITMASK_*; versioned only */
    DLPackVersion version;       /* versioned only */
} mp_dl_view;

/* Build a managed tensor over `b`. The caller's reference on `b` moves into it (the deleter
 * drops it); on failure (MP_ENOMEM) nothing moves. versioned: DLManagedTensorVersioned,
 * else DLManagedTensor. *out is the managed tensor, for a capsule. */
int mp_dl_export(mp_dl_block *b, const mp_dl_view *view, int versioned, void **out);

/* The deleters mp_dl_export installs (exposed for tests and for consumers that call them). */
void mp_dl_deleter(DLManagedTensor *self);
void mp_dl_deleter_versioned(DLManagedTensorVersioned *self);

/* Make `consumer` wait for the work queued so far on `producer` (an event recorded on the
 * producer, waited on by the consumer: no host sync), then declare `consumer` a user of the
 * block at `ptr` so the pool does not reuse it before the consumer's work is done. */
int mp_dl_handoff(mp_pool *p, uintptr_t ptr, uintptr_t producer, uintptr_t consumer);

/* PyCapsule destructors: free a capsule's tensor only if no consumer took it (a consumer
 * renames the capsule to "used_..." and calls the deleter itself later). These two run with
 * the GIL, as every capsule destructor does. (struct _object is PyObject; declared so this
 * header does not need Python.h.) */
struct _object;
void mp_dl_capsule_destructor(struct _object *capsule);
void mp_dl_capsule_destructor_versioned(struct _object *capsule);

#endif
