# What every other part uses: the checks that turn Python arguments into C values (sizes,
# addresses, stream handles), the backend kinds, and the error of an object never initialised.
# Depends on nothing but _cdefs.pxd.
from cpython.exc cimport PyErr_Clear, PyErr_Occurred
from libc.stdint cimport uintptr_t

cdef enum _Backend:
    _SIM = 0
    _HOST = 1
    _CUDA = 2

_BACKENDS = {"sim": _SIM, "host": _HOST, "cuda": _CUDA}


def _not_initialised(object obj):
    """The error of a method called on an object whose __init__ never ran (made with
    __new__, or a subclass whose __init__ does not call the base's)."""
    name = type(obj).__name__
    return RuntimeError(f"this {name} was never initialised: its __init__ did not run (made "
                        f"with {name}.__new__, or a subclass whose __init__ does not call "
                        f"super().__init__(...)); make one with the class's constructor")


cdef object _index(object value, str expected):
    """value.__index__() as an int, or a TypeError saying what `expected` and what was given
    when __index__ refuses (a NumPy array of several elements has one that raises NumPy's
    own message, naming no argument) or returns something else."""
    try:
        out = value.__index__()
    except TypeError as exc:
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}, whose __index__ "
                        f"refused: {exc}") from exc
    if type(out) is not int:   # an int subclass (bool) is refused, as __index__ must give int
        raise TypeError(f"{expected}, got {type(value).__name__} {value!r}, whose __index__ "
                        f"returned {type(out).__name__}, not int")
    return out


cdef size_t _size_slow(object value, str name) except? 0:
    """The checks behind _as_nbytes, off its fast path: types, then the range."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{name} must be an integer number of bytes, got "
                        f"{type(value).__name__} {value!r}")
    value = _index(value, f"{name} must be an integer number of bytes")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    if value >= 2 ** 64:
        raise ValueError(f"{name}={value} is out of range: sizes must be below 2**64")
    return PyLong_AsSize_t(value)


cdef inline bint _exact_int_in_range(object value, size_t *out) noexcept:
    """The fast path of _as_nbytes and _as_pointer: True with *out set for an exact int in
    [0, 2**64); False otherwise, with no exception left set (the slow paths say what is
    wrong)."""
    if type(value) is not int:
        return False
    out[0] = _PyLong_AsSize_t_unchecked(value)   # (size_t)-1 and OverflowError when out of range
    if out[0] != <size_t>-1 or PyErr_Occurred() == NULL:
        return True
    PyErr_Clear()
    return False


cdef inline size_t _as_nbytes(object nbytes, str name) except? 0:
    """A size argument: a non-negative integer below 2**64 (bool and float refused)."""
    cdef size_t n
    if _exact_int_in_range(nbytes, &n):
        return n
    return _size_slow(nbytes, name)


cdef size_t _pointer_slow(object ptr) except? 0:
    if isinstance(ptr, bool) or not hasattr(ptr, "__index__"):
        raise TypeError(f"ptr must be an integer address, got {type(ptr).__name__} {ptr!r}")
    ptr = _index(ptr, "ptr must be an integer address")
    if ptr < 0 or ptr >= 2 ** 64:
        raise ValueError(f"ptr must be an address in [0, 2**64), got {ptr}")
    return PyLong_AsSize_t(ptr)


cdef inline uintptr_t _as_pointer(object ptr) except? 0:
    cdef size_t p
    if _exact_int_in_range(ptr, &p):
        return p
    return _pointer_slow(ptr)


def stream_handle(stream):
    """The raw handle of a stream object.

    Accepts an int (a raw ``cudaStream_t``; 0 is the legacy default stream, 1
    ``cudaStreamLegacy``, 2 ``cudaStreamPerThread``), an object with ``__cuda_stream__``
    (the CUDA stream protocol), a CuPy stream (``.ptr``) or a PyTorch stream
    (``.cuda_stream``).
    """
    if type(stream) is int:
        if stream < 0 or stream >= 2 ** 64:
            raise ValueError(f"stream must be a handle in [0, 2**64), got {stream}")
        return stream
    if isinstance(stream, bool):
        raise TypeError("stream must be a stream handle or stream object, got bool")
    if hasattr(stream, "__dlpack__"):
        # An array, not a stream: a mempool.Buffer has a .ptr, as CuPy's streams do, and
        # taken for a stream it was pinned by the pool, holding its memory until forget_stream.
        raise TypeError(f"stream must be a stream handle or stream object, got a "
                        f"{type(stream).__name__}, an array (it has __dlpack__, as a "
                        f"mempool.Buffer has; its .ptr is an address, not a stream)")
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        value = proto() if callable(proto) else proto
        if not (isinstance(value, tuple) and len(value) == 2):
            raise TypeError(f"stream.__cuda_stream__() must return (version, handle), got {value!r}")
        return _stream_int(value[1], "stream.__cuda_stream__()'s handle")
    for attr in ("ptr", "cuda_stream"):
        value = getattr(stream, attr, None)
        if value is not None and not callable(value):
            return _stream_int(value, f"stream.{attr}")
    if hasattr(stream, "__index__"):
        return _stream_int(stream, "stream")
    raise TypeError(f"stream must be an int handle, a CuPy or PyTorch stream, or an object "
                    f"with __cuda_stream__; got {type(stream).__name__}")


cdef object _stream_int(object value, str what):
    """A handle found inside a stream object: an int in [0, 2**64), else a clear error (a
    float or a string is refused, not truncated or parsed)."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int stream handle, got {type(value).__name__} "
                        f"{value!r}")
    handle = _index(value, f"{what} must be an int stream handle")
    if handle < 0 or handle >= 2 ** 64:
        raise ValueError(f"{what} must be a handle in [0, 2**64), got {handle}")
    return handle
