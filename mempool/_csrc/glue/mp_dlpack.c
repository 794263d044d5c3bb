/* The DLPack exporter: shared blocks, managed tensors and their deleters, stream hand-off.
 *
 * Everything here but the two capsule destructors runs without the GIL: a consumer may call
 * a deleter from any thread (PyTorch frees tensors on its autograd threads, JAX on its own),
 * so a deleter touches only C state: the block, the pool (through mp_free, which takes the
 * pool's own lock) and the pool's reference count. See docs/sharing.md,
 * "Note [DLPack ownership]".
 */
#include <Python.h>

#include <stdlib.h>
#include <string.h>

#include "mp_assert.h"
#include "mp_dlpack.h"

/* ---- shared blocks ------------------------------------------------------------------------ */

static int64_t live_blocks;   /* atomic; wrappers alive, process-wide (mp_dl_live_blocks) */

int64_t mp_dl_live_blocks(void) { return __atomic_load_n(&live_blocks, __ATOMIC_RELAXED); }

int mp_dl_block_new(mp_pool *p, size_t nbytes, uintptr_t stream, mp_dl_block **out) {
    mp_dl_block *b = (mp_dl_block *)malloc(sizeof *b);
    if (!b) return MP_ENOMEM;
    uintptr_t ptr = 0;
    if (nbytes > 0) {
        int rc = mp_alloc(p, nbytes, stream, &ptr);
        if (rc != MP_OK) {
            free(b);
            return rc;
        }
    }
    mp_pool_retain(p);
    b->pool = p;
    b->ptr = ptr;
    b->nbytes = nbytes;
    b->refs = 1;
    __atomic_add_fetch(&live_blocks, 1, __ATOMIC_RELAXED);
    *out = b;
    return MP_OK;
}

void mp_dl_block_retain(mp_dl_block *b) {
    int before = __atomic_fetch_add(&b->refs, 1, __ATOMIC_RELAXED);
    mp_check(before > 0);   /* a retain needs a reference already held */
}

void mp_dl_block_release(mp_dl_block *b) {
    /* acq_rel: every holder's accesses happen before the free by the last one. */
    int left = __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL);
    mp_check(left >= 0);    /* one release too many: the block is already freed */
    if (left != 0) return;
    if (b->ptr) {
        /* The block's own stream: streams a consumer declared (mp_dl_handoff) are waited
         * for by the core before the block is reused. */
        int rc = mp_free(b->pool, b->ptr, 0, 0);
        mp_assert(rc == MP_OK);   /* the holders kept the block live until now */
        (void)rc;
    }
    mp_pool_release(b->pool);
    free(b);
    __atomic_sub_fetch(&live_blocks, 1, __ATOMIC_RELAXED);
}

/* ---- managed tensors ---------------------------------------------------------------------- */

/* One allocation per export: the managed tensor (either layout), its block, and the shape
 * and strides arrays the DLTensor points into. `magic` is MP_DL_MAGIC while the tensor is
 * alive and is cleared by its deleter: a consumer calling a deleter twice meets a clear
 * abort instead of a second release of the block (mp_check, always on). */
#define MP_DL_MAGIC 0x6d70646cu   /* "mpdl" */

typedef struct mp_dl_managed {
    union {
        DLManagedTensor legacy;
        DLManagedTensorVersioned versioned;
    } t;
    mp_dl_block *block;
    unsigned magic;
    int64_t dims[];   /* shape[ndim] then strides[ndim] */
} mp_dl_managed;

static void fill_tensor(DLTensor *t, mp_dl_managed *m, const mp_dl_view *v) {
    int64_t *shape = m->dims;
    int64_t *strides = m->dims + v->ndim;
    for (int32_t i = 0; i < v->ndim; i++) {
        shape[i] = v->shape[i];
        strides[i] = v->strides[i];
    }
    /* An empty buffer holds no block: its data is NULL, as DLPack asks for a tensor with
     * no elements. */
    t->data = (void *)m->block->ptr;
    t->device = v->device;
    t->ndim = v->ndim;
    t->dtype = v->dtype;
    t->shape = shape;
    t->strides = strides;
    t->byte_offset = m->block->ptr ? v->byte_offset : 0;
}

int mp_dl_export(mp_dl_block *b, const mp_dl_view *v, int versioned, void **out) {
    if (v->ndim < 0) return MP_EINVAL;
    size_t ndims = (size_t)v->ndim * 2;
    /* At least one slot so shape/strides are valid pointers for a 0-d tensor too. */
    mp_dl_managed *m = (mp_dl_managed *)calloc(1, sizeof *m + (ndims ? ndims : 1) * sizeof(int64_t));
    if (!m) return MP_ENOMEM;
    mp_assert(b && b->refs > 0);
    /* Expensive (a lookup under the pool lock): the block a tensor describes is live. */
    mp_assert_expensive(!b->ptr || mp_block_info(b->pool, b->ptr, NULL, NULL, NULL) == MP_OK);
    m->block = b;
    m->magic = MP_DL_MAGIC;
    if (versioned) {
        DLManagedTensorVersioned *t = &m->t.versioned;
        t->version = v->version;
        t->manager_ctx = m;
        t->deleter = mp_dl_deleter_versioned;
        t->flags = v->flags;
        fill_tensor(&t->dl_tensor, m, v);
        *out = t;
    } else {
        DLManagedTensor *t = &m->t.legacy;
        t->manager_ctx = m;
        t->deleter = mp_dl_deleter;
        fill_tensor(&t->dl_tensor, m, v);
        *out = t;
    }
    return MP_OK;
}

/* The managed tensor is the first member of its mp_dl_managed, so a deleter finds its
 * allocation from `self` alone: reading self->manager_ctx first would read the freed
 * tensor's header, which malloc reuses, when a consumer calls a deleter twice. */
static void managed_free(mp_dl_managed *m) {
    mp_check(m->magic == MP_DL_MAGIC);   /* a deleter called twice, or on a stranger */
    /* volatile: a plain store just before free() is a dead store the compiler drops. */
    *(volatile unsigned *)&m->magic = 0;
    mp_dl_block *b = m->block;
    mp_assert(b && b->refs > 0);
    free(m);
    mp_dl_block_release(b);
}

void mp_dl_deleter(DLManagedTensor *self) {
    if (!self) return;
    mp_dl_managed *m = (mp_dl_managed *)(void *)self;
    managed_free(m);
}

void mp_dl_deleter_versioned(DLManagedTensorVersioned *self) {
    if (!self) return;
    mp_dl_managed *m = (mp_dl_managed *)(void *)self;
    managed_free(m);
}

/* ---- stream hand-off ---------------------------------------------------------------------- */

int mp_dl_handoff(mp_pool *p, uintptr_t ptr, uintptr_t producer, uintptr_t consumer) {
    mp_assert(p);
    mp_assert_expensive(!ptr || mp_block_info(p, ptr, NULL, NULL, NULL) == MP_OK);
    if (producer == consumer) return MP_OK;
    mp_upstream *up = mp_pool_upstream(p);
    uintptr_t event = 0;
    int rc = up->event_create(up->ctx, &event);
    if (rc != MP_OK) return rc;
    rc = up->event_record(up->ctx, event, producer);
    if (rc == MP_OK) rc = up->stream_wait_event(up->ctx, consumer, event);
    /* A wait already enqueued does not need the event to outlive it (cudaEventDestroy
     * releases it once complete), so it goes back at once. */
    int rc_destroy = up->event_destroy(up->ctx, event);
    if (rc == MP_OK) rc = rc_destroy;
    if (rc == MP_OK && ptr) rc = mp_record_stream(p, ptr, consumer);
    return rc;
}

/* ---- capsule destructors (with the GIL) --------------------------------------------------- */

void mp_dl_capsule_destructor(PyObject *capsule) {
    /* Only an unconsumed capsule still owns its tensor. PyCapsule_IsValid sets no error. */
    if (PyCapsule_IsValid(capsule, MP_DL_CAPSULE)) {
        DLManagedTensor *t = (DLManagedTensor *)PyCapsule_GetPointer(capsule, MP_DL_CAPSULE);
        if (t && t->deleter) t->deleter(t);
    }
}

void mp_dl_capsule_destructor_versioned(PyObject *capsule) {
    if (PyCapsule_IsValid(capsule, MP_DL_CAPSULE_VERSIONED)) {
        DLManagedTensorVersioned *t = (DLManagedTensorVersioned *)PyCapsule_GetPointer(
            capsule, MP_DL_CAPSULE_VERSIONED);
        if (t && t->deleter) t->deleter(t);
    }
}
