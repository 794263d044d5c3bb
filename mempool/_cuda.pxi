# The CUDA upstream's C entry points (mempool/_csrc/mp_cuda.h), for the Pool of backend="cuda".
#
# Only the glue: which cudaMemPool to use and its attributes are mempool/_cuda.py's concern.
# The declarations are in _cdefs.pxd; this part uses no other.
from libc.stdint cimport uintptr_t


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


cdef int _set_cuda_shareable(void *up, bint on) except -1:
    """Say whether the upstream's memory will be shared with other processes (the Pool's
    `ipc` option), before any segment (Note [Sharing CUDA memory]); RuntimeError with the
    reason when the driver cannot."""
    if mp_cuda_set_shareable(up, on) != 0:
        raise RuntimeError(f"option 'ipc': {_cuda_share_message()}")
    return 0


def _cuda_share_message():
    """Why this thread's latest share or open on a cuda pool failed ('' when it did not)."""
    cdef char buf[512]
    buf[0] = 0
    mp_cuda_share_message(buf, sizeof(buf))
    return buf.decode("utf-8", "replace")


cdef str _cuda_error_text(int code):
    """The driver's name and description of a CUresult, for error messages."""
    cdef char buf[256]
    mp_cuda_error_string(code, buf, sizeof(buf))
    return buf.decode("utf-8", "replace")


def _cuda_driver_available():
    """True when the CUDA driver loads, initialises and sees a device (never raises)."""
    return bool(mp_cuda_available())
