# The CUDA upstream's C entry points (mempool/_csrc/mp_cuda.h), for the Pool of backend="cuda".
#
# Only the glue: which cudaMemPool to use and its attributes are mempool/_cuda.py's concern.
# The mp_upstream struct is passed as void * so that this file needs no declaration of it and
# works with whichever .pxd declares the struct (C converts the pointer back implicitly).
from libc.stdint cimport uintptr_t

cdef extern from "mp_cuda.h" nogil:
    int mp_cuda_upstream(void *up, int device, uintptr_t mempool_handle, char *err,
                         size_t errlen)
    int mp_cuda_available()
    int mp_cuda_last_error(const void *up)
    void mp_cuda_bind_errors(void *up)
    void mp_cuda_own_pool(void *up)
    void mp_cuda_error_string(int code, char *buf, size_t buflen)
    int mp_cuda_set_page_size(void *up, size_t page, char *err, size_t errlen)


cdef int _make_cuda_upstream(void *up, int device, uintptr_t handle) except -1:
    """Fill the mp_upstream at `up` for device `device`, taking segments from the
    cudaMemPool_t `handle` (0 = the device's current pool).

    Raises RuntimeError with the driver's reason when the driver is missing, the device
    does not exist or does not support memory pools. After the pool has copied the struct,
    call mp_cuda_bind_errors(mp_pool_upstream(pool)) so that its last_error is kept; for a
    pool made by _cuda.resolve_pool_handle("create"), mp_cuda_own_pool(up) makes the
    upstream's destroy destroy it.
    """
    cdef char err[512]
    cdef int rc
    err[0] = 0
    with nogil:
        rc = mp_cuda_upstream(up, device, handle, err, sizeof(err))
    if rc != 0:
        raise RuntimeError(
            f"backend='cuda' could not start on device {device}: "
            f"{err.decode('utf-8', 'replace')}")
    return 0


cdef int _set_cuda_page_size(void *up, size_t page) except -1:
    """Make the pages of expandable segments `page` bytes (the `granularity` option on
    backend='cuda'); ValueError with the driver's granularity when it is not a multiple."""
    cdef char err[512]
    err[0] = 0
    if mp_cuda_set_page_size(up, page, err, sizeof(err)) != 0:
        raise ValueError(f"option 'granularity' ({page}): {err.decode('utf-8', 'replace')}")
    return 0


cdef str _cuda_error_text(int code):
    """The driver's name and description of a CUresult, for error messages."""
    cdef char buf[256]
    mp_cuda_error_string(code, buf, sizeof(buf))
    return buf.decode("utf-8", "replace")


def _cuda_driver_available():
    """True when the CUDA driver loads, initialises and sees a device (never raises)."""
    return bool(mp_cuda_available())
