# A benchmark control, not part of the product: the Python faces of the compiled loops of
# mempool/_csrc/testing/mp_bench.c. No product path uses it.
#
# Compiled loops for the benchmarks (see bench/).
#
# Included into _core.pyx after _pool.pxi, whose Pool it takes. The loops run in C with the
# GIL released and time themselves; the Python wrappers only check arguments and turn the
# loops' 0 (failure) into an exception.
from libc.stdint cimport uint64_t, uintptr_t


cdef size_t _bench_count(object value, str name) except 0:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2 ** 64:
        raise ValueError(f"{name} must be an int in [1, 2**64), got {value!r}")
    return <size_t>value


cdef uintptr_t _bench_stream(object stream) except? 0:
    # None is the null stream here: the loops run on a stream the caller names. Any other
    # value is spelled as Pool.alloc accepts it (stream_handle, _common.pxi).
    return 0 if stream is None else <uintptr_t>stream_handle(stream)


cdef mp_pool *_bench_pool(Pool pool) except NULL:
    if pool is None:
        raise ValueError("pool must be an open mempool.Pool, got None")
    pool._ready()
    return pool._pool


def bench_core_roundtrips(Pool pool, nbytes, n, stream=None):
    """Time `n` mp_alloc + mp_free pairs of `nbytes` on `stream`, in C.

    Parameters
    ----------
    pool : Pool
        The pool to allocate from (any backend).
    nbytes : int
        Bytes per allocation, > 0.
    n : int
        Number of pairs, > 0.
    stream : int or object with ``.ptr``, optional
        The stream to allocate on (default: the null stream).

    Returns
    -------
    int
        Elapsed nanoseconds for all `n` pairs (CLOCK_MONOTONIC).

    Raises
    ------
    RuntimeError
        If an allocation or free failed; the loop stops there and frees what it holds.
    """
    cdef mp_pool *p = _bench_pool(pool)
    cdef size_t c_nbytes = _bench_count(nbytes, "nbytes")
    cdef size_t c_n = _bench_count(n, "n")
    cdef uintptr_t c_stream = _bench_stream(stream)
    cdef uint64_t ns
    pool._in_core += 1   # Note [Closing a pool]
    with nogil:
        ns = mp_bench_core_roundtrips(p, c_nbytes, c_n, c_stream)
    pool._in_core -= 1
    if ns == 0:
        raise RuntimeError(f"mp_bench_core_roundtrips failed: an allocation of {nbytes} bytes "
                           f"or its free returned an error (pool.alloc gives the reason)")
    return ns


def bench_core_mix(Pool pool, const uint64_t[::1] sizes not None, uint64_t[::1] ring not None,
                   stream=None):
    """Time one step per entry of `sizes`, holding ``len(ring)`` blocks live, in C.

    Step k allocates ``sizes[k]`` bytes, frees the block held in ``ring[k % len(ring)]`` (when
    non-zero) and stores the new block's address there. The ring persists between calls; the
    caller frees the addresses left in it.

    Parameters
    ----------
    pool : Pool
    sizes : buffer of uint64
        Bytes per step, each > 0.
    ring : writable buffer of uint64
        The live blocks' addresses (0 = empty slot), at least one slot.
    stream : int or object with ``.ptr``, optional

    Returns
    -------
    int
        Elapsed nanoseconds for all steps.
    """
    cdef mp_pool *p = _bench_pool(pool)
    cdef uintptr_t c_stream = _bench_stream(stream)
    cdef size_t n = sizes.shape[0]
    cdef size_t live = ring.shape[0]
    cdef uint64_t ns
    if n == 0:
        raise ValueError("sizes must hold at least one size, got an empty buffer")
    if live == 0:
        raise ValueError("ring must hold at least one slot, got an empty buffer")
    pool._in_core += 1   # Note [Closing a pool]
    with nogil:
        ns = mp_bench_core_mix(p, &sizes[0], n, &ring[0], live, c_stream)
    pool._in_core -= 1
    if ns == 0:
        raise RuntimeError("mp_bench_core_mix failed: an allocation or free returned an error "
                           "(pool.alloc gives the reason); the ring holds the live blocks")
    return ns


def bench_fn_roundtrips(alloc_fn, free_fn, nbytes, n, device=0, stream=None):
    """Time `n` pairs through PyTorch pluggable-allocator entry points, in C.

    Parameters
    ----------
    alloc_fn, free_fn : int
        Addresses of ``void* alloc(ssize_t size, int device, void* stream)`` and
        ``void free(void* ptr, ssize_t size, int device, void* stream)``.
    nbytes : int
        Bytes per allocation, > 0.
    n : int
        Number of pairs, > 0.
    device : int
        Passed through to both functions.
    stream : int or object with ``.ptr``, optional
        Passed through to both functions.

    Returns
    -------
    int
        Elapsed nanoseconds for all `n` pairs.
    """
    cdef uintptr_t a = _bench_count(alloc_fn, "alloc_fn")
    cdef uintptr_t f = _bench_count(free_fn, "free_fn")
    # Any other address would be called as a function: only the pairs this module exports.
    known = {(<uintptr_t>&mempool_torch_alloc, <uintptr_t>&mempool_torch_free),
             (<uintptr_t>&mp_bench_libc_alloc, <uintptr_t>&mp_bench_libc_free)}
    if (a, f) not in known:
        raise ValueError(f"alloc_fn, free_fn: ({a:#x}, {f:#x}) is not a pair of entry points of "
                         f"this module; accepted: mempool.torch.entry_points()'s alloc and "
                         f"free, or bench_libc_fnptrs()")
    cdef size_t c_nbytes = _bench_count(nbytes, "nbytes")
    cdef size_t c_n = _bench_count(n, "n")
    cdef uintptr_t c_stream = _bench_stream(stream)
    if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < 2 ** 31:
        raise ValueError(f"device must be an int in [0, 2**31), got {device!r}")
    cdef int c_device = device
    cdef uint64_t ns
    with nogil:
        ns = mp_bench_fn_roundtrips(a, f, c_nbytes, c_n, c_device, c_stream)
    if ns == 0:
        raise RuntimeError(f"mp_bench_fn_roundtrips failed: alloc_fn returned NULL for "
                           f"{nbytes} bytes")
    return ns


def bench_libc_fnptrs():
    """Addresses of libc malloc/free behind the pluggable-allocator signatures.

    Returns
    -------
    tuple of int
        ``(alloc_fn, free_fn)`` for :func:`bench_fn_roundtrips`.
    """
    return (<uintptr_t>&mp_bench_libc_alloc, <uintptr_t>&mp_bench_libc_free)


cdef class BareCall:
    """The floor of any call from Python into compiled code.

    ``call`` is a method of a cdef class that takes one argument and returns it: whatever a
    Python-level ``pool.alloc(n)`` costs beyond two of these is the allocator's own work.
    """

    def call(self, x):
        """Return `x` unchanged."""
        return x
