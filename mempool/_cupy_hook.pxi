# CuPy's allocator hook, Pool.malloc's work: a block of the pool as a cupy.cuda.MemoryPointer
# on CuPy's current stream, owned by an _Allocation that frees it when CuPy's memory object
# dies. Kept out of the Pool's part, and after it, because the owner holds a Pool; the one
# name a part before this one takes from it is _cupy_malloc, which Pool.malloc calls (_core.pyx).
#
# Uses argument checks (_common), the Pool (_pool).
from libc.stdint cimport uintptr_t

cdef object _MemoryPointer = None     # cupy.cuda.MemoryPointer, looked up once
cdef object _UnownedMemory = None


@cython.no_gc_clear   # the block must be freed even when a collected cycle holds it
cdef class _Allocation:
    """Owner of a block handed to CuPy: frees it when CuPy's memory object dies.

    It keeps the Pool object alive with a plain reference (no atomic C refcount on this
    path: the hook runs at every cupy.empty), and the Pool keeps the C pool."""
    cdef Pool _owner
    cdef uintptr_t ptr

    def __dealloc__(self):
        # A force-closed pool has let its C pool go, and the block with it (Note [Closing
        # a pool]): there is nothing left to free.
        if self._owner is not None and self._owner._pool != NULL:
            sharing = self._owner._sharing   # exported: freed once its consumers let go
            if sharing is None or not _share_pinned_free(sharing, self.ptr, 0, 0):
                mp_free(self._owner._pool, self.ptr, 0, 0)


cdef object _cupy_malloc(Pool pool, object nbytes):
    global _MemoryPointer, _UnownedMemory
    pool._ready()
    if _MemoryPointer is None:
        import cupy.cuda
        _MemoryPointer, _UnownedMemory = cupy.cuda.MemoryPointer, cupy.cuda.UnownedMemory
    cdef size_t n = _as_nbytes(nbytes, "nbytes")
    if n == 0:
        # As CuPy's own pools: an empty allocation is a null pointer, freeing nothing.
        return _MemoryPointer(_UnownedMemory(0, 0, None, pool.device_id), 0)
    cdef uintptr_t s = 0
    pool._stream_of(None, &s)
    cdef uintptr_t ptr = 0
    pool._in_core += 1   # Note [Closing a pool]
    mp_py_mark(1)
    cdef int rc = mp_alloc(pool._pool, n, s, &ptr)
    mp_py_mark(0)
    pool._in_core -= 1
    if rc != MP_OK:
        raise pool._alloc_error(rc, n, s)
    cdef _Allocation owner = _Allocation.__new__(_Allocation)
    owner._owner = pool
    owner.ptr = ptr
    return _MemoryPointer(_UnownedMemory(ptr, n, owner, pool.device_id), 0)
