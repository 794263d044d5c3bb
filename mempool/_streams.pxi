# CuPy's current stream, found cheaply.
#
# Note [Current stream]
#
# `stream=None` on a `cuda` pool means CuPy's current stream, and asking CuPy for it through its
# Python API (`cupy.cuda.get_current_stream(device).ptr`) costs as much as the pool's own work
# (docs/decisions.md). CuPy's C layer keeps the same stream as a plain handle per thread
# and device and exports the function that reads it (`cupy_backends.cuda.stream.get_stream_ptr`,
# signature `intptr_t (int)`) in the C API table of its Cython module (`__pyx_capi__`); CuPy's
# own memory pool reads it so. `_CurrentStream` (`mempool/_streams.pxi`) calls that function
# through the capsule's pointer, and uses its answer only to tell that the stream has not
# changed since the last lookup: then the handle found then is reused; when it has changed, the
# stream object is looked up through the Python API as before, and pinned (Note [Pinned
# streams]). The capsule is used only when its signature is the expected one and its answer
# agrees once with the Python API's; otherwise every lookup takes the Python path. Nothing of
# CuPy is needed at build time. CuPy 14.2 exports the function (seen); a CuPy without it takes
# the Python path. Not yet timed on a GPU.
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from libc.stdint cimport intptr_t

ctypedef intptr_t (*_stream_ptr_fn)(int) noexcept

cdef const char *_STREAM_PTR_SIGNATURE = b"intptr_t (int)"


cdef int _propagate() except -1:
    """Leave the error already set to the caller (Cython propagates on -1)."""
    return -1


cdef class _CurrentStream:
    """CuPy's current stream of a device, remembered while CuPy's C layer says it is the same.

    ``slow(device)`` returns the stream object (``cupy.cuda.get_current_stream``); ``capi``
    is the ``__pyx_capi__`` of ``cupy_backends.cuda.stream`` (or any mapping holding a
    ``get_stream_ptr`` capsule of signature ``intptr_t (int)``), None for none.
    """
    cdef object _slow
    cdef _stream_ptr_fn _fast
    cdef intptr_t _seen
    cdef uintptr_t _handle
    cdef bint _valid
    cdef readonly int slow_lookups

    def __init__(self, slow, capi=None, int device=0):
        self._slow = slow
        self._fast = NULL
        capsule = capi.get("get_stream_ptr") if capi is not None else None
        if capsule is not None and PyCapsule_IsValid(capsule, _STREAM_PTR_SIGNATURE):
            self._fast = <_stream_ptr_fn>PyCapsule_GetPointer(capsule, _STREAM_PTR_SIGNATURE)
            if not self._agrees(device):
                self._fast = NULL
        self.slow_lookups = 0

    cdef bint _agrees(self, int device):
        cdef intptr_t seen = self._fast(device)
        if PyErr_Occurred() != NULL:
            PyErr_Clear()
            return False
        try:
            return seen == self._slow(device).ptr
        except Exception:
            return False

    @property
    def fast(self):
        """Whether CuPy's C layer is read to tell an unchanged stream."""
        return self._fast != NULL

    cdef object find(self, int device, uintptr_t *handle):
        """Put the current stream's handle in ``handle[0]``. Returns the stream object when
        it had to be looked up (for the caller to pin), None when it is the one found last."""
        cdef intptr_t seen = 0
        if self._fast != NULL:
            seen = self._fast(device)
            if PyErr_Occurred() != NULL:
                _propagate()
            if self._valid and seen == self._seen:
                handle[0] = self._handle
                return None
        stream = self._slow(device)
        handle[0] = stream.ptr
        self.slow_lookups += 1
        if self._fast != NULL:
            self._seen = seen
            self._handle = handle[0]
            self._valid = True
        return stream

    def forget(self):
        """Look the stream up again on the next call (a stream was let go of)."""
        self._valid = False

    def lookup(self, int device=0):
        """``find`` from Python, for tests: ``(handle, stream object or None)``."""
        cdef uintptr_t handle = 0
        stream = self.find(device, &handle)
        return handle, stream


# Note [Pinned streams]
#
# The pool cannot tell a live stream handle from a destroyed one (asking the driver about a
# destroyed handle is itself the crash), and it does use handles long after the call that named
# them: the owner of a cached block gets an event recorded on it when another stream takes the
# block, and a cached segment is freed on its stream. Threads that make CuPy streams, allocate
# and free on them and return let CuPy destroy the streams with their objects, and the next
# thread's allocation may take one of their blocks: the event would go to a dead stream.
#
# So `Pool` keeps a reference to every stream *object* it is given (a CuPy stream, an object
# with `__cuda_stream__`, CuPy's current stream when `stream=None`), by handle, in
# `pinned_streams`: the object, and so its handle, lives as long as the pool may use it. The
# cost on the hot path is one identity compare with the stream pinned last. Handles 0, 1 and 2
# (the default streams) are never pinned, nor are raw ints, which the caller owns: for those,
# `forget_stream(handle)` before destroying the stream is the contract. `forget_stream`
# synchronizes the stream, hands its blocks and segments to the legacy stream, and only then
# drops the pinned object (dropping it first destroyed the stream before the synchronize: the
# second crash of those runs). An application that makes a stream per request keeps those
# streams until it calls `forget_stream`; that trade (a few stream objects against a crash) is
# deliberate.
