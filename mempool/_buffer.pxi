# The DLPack bridge: mempool.Buffer, zero-copy hand-off of pool memory to anything that
# speaks DLPack (PyTorch, JAX, CuPy, NumPy), the CUDA Array Interface or the NumPy array
# interface. See docs/sharing.md, "Note [DLPack ownership]" and "Note [DLPack streams]".
#
# Ownership in one paragraph: a Buffer holds one reference on a shared C block
# (mp_dl_block, mp_dlpack.h); views of it hold more, and so does every managed tensor
# __dlpack__ exports: each export takes a reference of its own, which the consumer's call of
# the deleter (C, any thread, no GIL) drops. The last reference, whoever holds it, frees the
# block back to its pool. Each reference also keeps the C pool alive, so the Pool object may
# go first. A Buffer may be exported any number of times, as NumPy, CuPy and PyTorch arrays
# may.
#
# Uses _common.pxi; Pool.empty (_pool.pxi) allocates the block and wraps it (_buffer_wrap).
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memcpy


DEF _DL_MAX_NDIM = 64            # NumPy's limit; the export builds its arrays on the stack

# DLPack type codes by NumPy kind; the extended float types (ml_dtypes, as JAX and PyTorch
# name them) by name, with the DLPack minor version that defined their code.
_DL_KIND_CODES = {"b": 6, "i": 0, "u": 1, "f": 2, "c": 5}
_DL_NAMED_CODES = {
    "bfloat16": (4, 0),
    "float8_e3m4": (7, 1), "float8_e4m3": (8, 1), "float8_e4m3b11fnuz": (9, 1),
    "float8_e4m3fn": (10, 1), "float8_e4m3fnuz": (11, 1), "float8_e5m2": (12, 1),
    "float8_e5m2fnuz": (13, 1), "float8_e8m0fnu": (14, 1),
}
_DL_ACCEPTED = ("bool, int8-int64, uint8-uint64, float16/32/64, complex64/128, and the "
                "ml_dtypes types bfloat16 and float8_*")
# The item sizes of those by NumPy kind: NumPy's longdouble and clongdouble (float128 and
# complex256 on x86-64) have a DLPack kind but no type consumers read, and complex256's 256
# bits do not fit DLPack's 8-bit `bits` field.
_DL_KIND_SIZES = {"b": (1,), "i": (1, 2, 4, 8), "u": (1, 2, 4, 8), "f": (2, 4, 8),
                  "c": (8, 16)}


def _dl_dtype(dtype):
    """(numpy.dtype, DLPack code, minor version) for a dtype argument, or a clear error."""
    import numpy
    try:
        dt = numpy.dtype(dtype)
    except (TypeError, ValueError):
        # NumPy's own reason can be a bare "object of type 'NoneType' has no len()": say
        # what is accepted instead.
        raise TypeError(f"dtype: {dtype!r:.80} is not a NumPy dtype; accepted: {_DL_ACCEPTED} "
                        "(a name such as 'float32', a numpy.dtype or a NumPy scalar "
                        "type)") from None
    if dt.name in _DL_NAMED_CODES:
        code, minor = _DL_NAMED_CODES[dt.name]
        return dt, code, minor
    if (dt.kind not in _DL_KIND_CODES or dt.fields is not None or dt.subdtype is not None
            or dt.itemsize not in _DL_KIND_SIZES[dt.kind]):
        raise ValueError(f"dtype: {dt} has no DLPack equivalent; accepted: {_DL_ACCEPTED}")
    if not dt.isnative:
        raise ValueError(f"dtype: {dt.str} is not in native byte order; DLPack describes "
                         f"native-order data only (use {dt.newbyteorder('=').str})")
    return dt, _DL_KIND_CODES[dt.kind], 0


def _dl_shape(shape):
    """A shape argument (int or sequence of ints) as a tuple of non-negative ints that
    DLPack's int64 shape and strides can hold."""
    import operator
    try:
        dims = (operator.index(shape),)
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise TypeError(f"shape: expected an int or a tuple of ints, got {shape!r}") from None
    if any(d < 0 for d in dims):
        raise ValueError(f"shape: dimensions must be >= 0, got {dims}")
    if len(dims) > _DL_MAX_NDIM:
        raise ValueError(f"shape: at most {_DL_MAX_NDIM} dimensions, got {len(dims)}")
    # Every stride is a product of dimensions: with the non-zero ones below 2**63 together,
    # each dimension and stride fits DLPack's int64 even when a zero makes the buffer empty.
    extent = 1
    for d in dims:
        extent *= d or 1
    if extent >= 2 ** 63:
        raise ValueError(f"shape: {dims} is too large: its non-zero dimensions multiply to "
                         f"{extent}, and DLPack's int64 shape and strides hold less than 2**63")
    return dims


def _dl_error(rc):
    names = {1: "out of memory", 2: "the pool's limit refuses it", 3: "invalid argument",
             8: "upstream error", 9: "unsupported by the upstream"}
    return names.get(rc, f"error code {rc}")


cdef class Buffer:
    """Pool memory with a shape and a dtype, handed to other libraries without a copy.

    Made by :meth:`Pool.empty`. A Buffer speaks DLPack (``__dlpack__``,
    ``__dlpack_device__``), the CUDA Array Interface (``__cuda_array_interface__``, on a
    ``cuda`` pool) and the NumPy array interface (``__array_interface__``, on a ``host``
    pool), so ``torch.from_dlpack(buf)``, ``jax.dlpack.from_dlpack(buf)``,
    ``cupy.from_dlpack(buf)`` and ``numpy.from_dlpack(buf)`` all view the pool's memory.

    Ownership: the Buffer holds its block while it lives, and every ``__dlpack__`` export
    takes a hold of its own for the consumer, dropped when the consumer is done (its deleter
    runs on any thread without the GIL). The block goes back to the pool when the last hold
    goes, in whatever order. A Buffer may be exported any number of times, to one framework
    or several, as NumPy, CuPy and PyTorch arrays may. The array interfaces do not transfer
    anything: the consumer keeps the Buffer alive.

    Streams: on CUDA the data is assumed written in stream order on :attr:`stream`. A DLPack
    consumer that passes its stream gets it ordered after that stream (an event wait, no host
    sync), and its stream is recorded as a user of the block so the pool does not reuse the
    memory before the consumer's work is done; each export records its own consumer. ``stream=-1`` asks for no synchronisation and
    records nothing. Consumers of ``__cuda_array_interface__`` on another stream should call
    :meth:`record_stream` themselves.

    A ``sim`` pool's memory is simulated: its Buffers report a CUDA device but refuse to be
    exported (``BufferError``), since their addresses cannot be dereferenced.
    """

    cdef mp_dl_block *_block       # our reference; NULL only if never initialised
    cdef Py_ssize_t _exports       # __dlpack__ exports made (each holds its own reference)
    cdef uintptr_t _base           # the block's start (0: an empty buffer)
    cdef size_t _block_nbytes
    cdef DLDataType _dl_dtype
    cdef uint32_t _dl_minor
    cdef readonly tuple shape
    cdef readonly object dtype
    cdef readonly Py_ssize_t offset
    cdef readonly bint readonly
    cdef readonly str backend
    cdef readonly int device_id
    cdef readonly uintptr_t stream
    cdef bint _closed              # close() ran: the block is let go

    def __init__(self, *args, **kwargs):
        raise TypeError("mempool.Buffer is made by Pool.empty(shape, dtype, stream)")

    def __dealloc__(self):
        if self._block is not NULL:
            mp_dl_block_release(self._block)
            self._block = NULL

    # ---- description ---------------------------------------------------------------------

    @property
    def ptr(self):
        """Address of the first element (the block's start plus :attr:`offset`)."""
        self._ready()
        return self._base + self.offset if self._base else 0

    @property
    def ndim(self):
        self._ready()
        return len(self.shape)

    @property
    def size(self):
        """Number of elements."""
        self._ready()
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def itemsize(self):
        self._ready()
        return self.dtype.itemsize

    @property
    def nbytes(self):
        return self.size * self.dtype.itemsize

    @property
    def strides(self):
        """Strides in bytes (C order)."""
        self._ready()
        out = []
        step = self.dtype.itemsize
        for d in reversed(self.shape):
            out.append(step)
            step *= d
        return tuple(reversed(out))

    @property
    def exported(self):
        """True once ``__dlpack__`` has handed the memory to a consumer (the Buffer stays
        usable and may be exported again)."""
        return self._exports > 0

    def __repr__(self):
        if self._block is NULL:
            return f"<mempool.Buffer {'closed' if self._closed else 'uninitialised'}>"
        state = " exported" if self._exports else ""
        return (f"<mempool.Buffer shape={self.shape} dtype={self.dtype} nbytes={self.nbytes} "
                f"backend={self.backend} device={self.device_id} ptr={self.ptr:#x} "
                f"stream={self.stream:#x}{state}>")

    def close(self):
        """Let go of this Buffer's hold on its memory now (views and DLPack exports keep
        theirs); every later use of it raises. For a Buffer from :meth:`Pool.import_`, the
        last hold to go unmaps the other process's memory and tells its producer."""
        if self._block is not NULL:
            mp_dl_block_release(self._block)
            self._block = NULL
            self._base = 0
            self._closed = True

    def __enter__(self):
        self._ready()
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    cdef int _ready(self) except -1:
        """Refuse a Buffer not made by Pool.empty or view (Buffer.__new__): it holds no
        block."""
        if self._block is NULL:
            if self._closed:
                raise ValueError("this Buffer is closed (Buffer.close let its memory go): "
                                 "use a Buffer that is still open")
            raise _not_initialised(self)
        return 0

    # ---- views and streams ---------------------------------------------------------------

    def view(self, shape=None, dtype=None, *, offset=0, readonly=None):
        """A new Buffer over part of this one's memory; both hold the block.

        Parameters
        ----------
        shape : int or tuple of int, optional
            Shape of the view. Default: this Buffer's shape when dtype and offset are
            unchanged, else as many elements as fit after `offset`.
        dtype : dtype-like, optional
            Element type (default: this Buffer's).
        offset : int
            Start of the view in bytes from this Buffer's first element; a multiple of the
            view's itemsize.
        readonly : bool, optional
            Mark the view read-only (exported with DLPack's read-only flag). Default: this
            Buffer's setting; a view of a read-only Buffer cannot be writable.

        Returns
        -------
        Buffer
        """
        self._ready()
        if dtype is None:
            dt, code, minor = self.dtype, self._dl_dtype.code, self._dl_minor
        else:
            dt, code, minor = _dl_dtype(dtype)
        import operator
        try:
            offset = operator.index(offset)
        except TypeError:
            raise TypeError(f"offset: expected an int number of bytes, got {offset!r}") from None
        start = self.offset + offset
        if offset < 0 or start > <Py_ssize_t>self._block_nbytes:
            raise ValueError(f"offset: {offset} is outside this Buffer's memory "
                             f"[0, {<Py_ssize_t>self._block_nbytes - self.offset}]")
        if start % dt.itemsize:
            raise ValueError(f"offset: {offset} leaves the view's elements misaligned for "
                             f"{dt} ({dt.itemsize}-byte items)")
        if shape is None:
            if dtype is None and offset == 0:
                dims = self.shape
            else:
                dims = ((<Py_ssize_t>self._block_nbytes - start) // dt.itemsize,)
        else:
            dims = _dl_shape(shape)
        nbytes = dt.itemsize
        for d in dims:
            nbytes *= d
        if start + nbytes > <Py_ssize_t>self._block_nbytes:
            raise ValueError(f"shape: a {dims} view of {dt} needs {nbytes} bytes from offset "
                             f"{offset}, beyond this Buffer's memory")
        if readonly is None:
            readonly = self.readonly
        elif not readonly and self.readonly:
            raise ValueError("readonly: a view of a read-only Buffer cannot be writable")
        mp_dl_block_retain(self._block)
        return _buffer_wrap(self._block, dt, code, minor, dims, start, bool(readonly),
                            self.backend, self.device_id, self.stream)

    def record_stream(self, stream):
        """Declare that `stream` uses this memory too: the pool waits for the work queued
        on it before reusing the block (for consumers of the CUDA Array Interface)."""
        self._ready()
        cdef uintptr_t handle = stream_handle(stream)
        cdef int rc = MP_OK
        if self._base:
            with nogil:
                rc = mp_record_stream(self._block.pool, self._base, handle)
        if rc != MP_OK:
            raise RuntimeError(f"record_stream: {_dl_error(rc)}")

    # ---- DLPack --------------------------------------------------------------------------

    def __dlpack_device__(self):
        """(device type, device id): (kDLCPU=1, 0) on a host pool, (kDLCUDA=2, id) on cuda.

        A sim pool's Buffer raises ``BufferError`` here already: consumers (PyTorch's
        ``from_dlpack``) ask for the device first and would otherwise fail on their own
        terms (a CPU-only PyTorch: "Torch not compiled with CUDA enabled") before reaching
        ``__dlpack__``'s refusal.
        """
        self._ready()
        if self.backend == "host":
            return (1, 0)
        if self.backend == "sim":
            raise BufferError("a sim pool's memory is simulated: its addresses cannot be "
                              "handed to another framework (use a host pool on CPU, a cuda "
                              "pool on a GPU)")
        return (2, self.device_id)

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        """Export as a DLPack capsule (the array API's ``__dlpack__``).

        Parameters
        ----------
        stream : int, optional
            The consumer's stream (CUDA only): None or 1 the legacy default stream, 2 the
            per-thread default stream, any other value a ``cudaStream_t``; -1: do not
            synchronise. The consumer's stream is made to wait for :attr:`stream` and is
            recorded as a user of the block. On a host pool only None (or -1) is accepted.
        max_version : tuple of int, optional
            The newest DLPack version the consumer reads. ``(1, x)`` or newer gives a
            versioned capsule ("dltensor_versioned", with the read-only flag); None or
            older, the legacy "dltensor" capsule, which cannot carry a read-only Buffer.
            A pair of ints: a tuple of any other length is refused (``TypeError``).
        dl_device : tuple, optional
            Must be this Buffer's own device (mempool exports in place).
        copy : bool, optional
            False/None: zero-copy (the capsule holds the Buffer's block too). True: a copy in
            a new block of the same pool (host pools only).

        Raises
        ------
        BufferError
            A simulated pool, another device, a copy that cannot be made, a read-only
            Buffer to a legacy consumer, or a failed stream hand-off.
        """
        # Every check comes before any side effect: PyTorch retries with fewer keywords
        # after a TypeError, and a refused export must leave the Buffer untouched.
        self._ready()
        cdef bint versioned = _dl_wants_versioned(max_version)
        if dl_device is not None:
            wanted = _dl_int_pair(dl_device, "dl_device", "(device_type, device_id)")
            if wanted != self.__dlpack_device__():
                raise BufferError(f"dl_device: this Buffer lives on {self.__dlpack_device__()} "
                                  f"and mempool exports in place; {wanted} would need a copy "
                                  f"across devices")
        if copy is not None and copy is not True and copy is not False:
            raise TypeError(f"copy: expected None, True or False, got {copy!r}")
        if self.backend == "sim":
            raise BufferError("a sim pool's memory is simulated: its addresses cannot be "
                              "dereferenced, so it cannot be exported; use a host pool for "
                              "CPU consumers or a cuda pool for GPU ones")
        if copy is True and self.backend != "host":
            raise BufferError("copy=True: mempool exports device memory in place and does "
                              "not copy it; copy in the consumer (e.g. torch.from_dlpack(buf)"
                              ".clone())")
        sync, consumer = _dl_consumer_stream(stream, self.backend)
        if self.readonly and not versioned:
            raise BufferError("this Buffer is read-only and the legacy DLPack capsule cannot "
                              "say so; the consumer must pass max_version >= (1, 0)")
        return self._export(versioned, sync, consumer, copy is True)

    cdef object _export(self, bint versioned, bint sync, uintptr_t consumer, bint copy):
        cdef int rc = MP_OK
        cdef mp_dl_block *block = self._block
        cdef mp_pool *pool = self._block.pool
        cdef uintptr_t base = self._base
        cdef uintptr_t producer = self.stream
        cdef size_t nbytes
        cdef Py_ssize_t offset = self.offset
        cdef uint64_t flags = 0
        if copy:
            # Host memory only (checked by the caller): a plain memcpy into a new block, whose
            # one reference moves into the managed tensor.
            nbytes = self.nbytes
            with nogil:
                rc = mp_dl_block_new(pool, nbytes, producer, &block)
                if rc == MP_OK and nbytes:
                    memcpy(<void *>block.ptr, <void *>(base + offset), nbytes)
            if rc != MP_OK:
                raise BufferError(f"copy=True: could not allocate {nbytes} bytes for the "
                                  f"copy: {_dl_error(rc)}")
            offset = 0
            flags |= DLPACK_FLAG_BITMASK_IS_COPIED
        elif sync and base:
            # Each export orders its own consumer after the producer and records it on the
            # block, so the block waits for every consumer's work before it is reused.
            with nogil:
                rc = mp_dl_handoff(pool, base, producer, consumer)
            if rc != MP_OK:
                raise BufferError(f"__dlpack__: could not order the consumer's stream "
                                  f"{consumer:#x} after the producer's {producer:#x}: "
                                  f"{_dl_error(rc)}")
        if self.readonly:
            flags |= DLPACK_FLAG_BITMASK_READ_ONLY

        cdef int64_t shape[_DL_MAX_NDIM]
        cdef int64_t strides[_DL_MAX_NDIM]
        cdef int i, ndim = len(self.shape)
        cdef int64_t step = 1
        for i in range(ndim - 1, -1, -1):
            shape[i] = self.shape[i]
            strides[i] = step
            step *= shape[i]
        cdef mp_dl_view v
        v.device.device_type = kDLCPU if self.backend == "host" else kDLCUDA
        v.device.device_id = 0 if self.backend == "host" else self.device_id
        v.dtype = self._dl_dtype
        v.ndim = ndim
        v.shape = shape
        v.strides = strides
        v.byte_offset = offset
        v.flags = flags
        v.version.major = 1
        v.version.minor = self._dl_minor
        cdef void *managed = NULL
        if not copy:
            mp_dl_block_retain(block)   # the capsule's own reference; the Buffer keeps its own
        rc = mp_dl_export(block, &v, versioned, &managed)
        if rc != MP_OK:
            mp_dl_block_release(block)
            raise MemoryError("__dlpack__: no host memory for the managed tensor")
        if not copy:
            self._exports += 1
        try:
            if versioned:
                return PyCapsule_New(managed, b"dltensor_versioned",
                                     mp_dl_capsule_destructor_versioned)
            return PyCapsule_New(managed, b"dltensor", mp_dl_capsule_destructor)
        except BaseException:
            if versioned:
                mp_dl_deleter_versioned(<DLManagedTensorVersioned *>managed)
            else:
                mp_dl_deleter(<DLManagedTensor *>managed)
            raise

    # ---- array interfaces ----------------------------------------------------------------

    @property
    def __cuda_array_interface__(self):
        """The CUDA Array Interface, version 3 (cuda pools only).

        ``stream`` is the producer's stream (1 for the legacy default stream), which the
        consumer synchronises with before use. The consumer must keep the Buffer alive, and
        should :meth:`record_stream` the streams it uses the memory on.
        """
        self._ready()
        if self.backend != "cuda":
            raise AttributeError(f"__cuda_array_interface__: a {self.backend} pool's memory "
                                 f"is not CUDA device memory")
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.ptr, bool(self.readonly)),
            "strides": None,
            "stream": self.stream if self.stream else 1,
            "version": 3,
        }

    @property
    def __array_interface__(self):
        """The NumPy array interface, version 3 (host pools only). The consumer keeps the
        Buffer alive (NumPy holds it as the array's base)."""
        self._ready()
        if self.backend != "host":
            raise AttributeError(f"__array_interface__: a {self.backend} pool's memory is "
                                 f"not host memory")
        return {
            "shape": self.shape,
            "typestr": self.dtype.str,
            "descr": self.dtype.descr,
            "data": (self.ptr, bool(self.readonly)),
            "strides": None,
            "version": 3,
        }


cdef tuple _dl_int_pair(object value, str name, str shape):
    """A pair of ints from a DLPack keyword: a tuple (or list) of exactly two ints. Anything
    else, a short tuple above all, is a TypeError naming the keyword."""
    import operator
    if isinstance(value, (tuple, list)) and len(value) == 2:
        try:
            return (operator.index(value[0]), operator.index(value[1]))
        except TypeError:
            pass
    raise TypeError(f"{name}: expected a {shape} pair of ints, got {value!r}")


cdef bint _dl_wants_versioned(max_version) except -1:
    if max_version is None:
        return False
    return _dl_int_pair(max_version, "max_version", "(major, minor)")[0] >= 1


def _dl_consumer_stream(stream, backend):
    """(synchronise?, consumer stream handle) for __dlpack__'s `stream` (the array API's
    values: None/1 legacy default, 2 per-thread default, -1 no sync, else a handle)."""
    if stream is not None and (isinstance(stream, bool) or not isinstance(stream, int)):
        raise TypeError(f"stream: DLPack passes the consumer's stream as an int, got "
                        f"{stream!r}")
    if stream is not None and stream >= 2 ** 64:
        raise BufferError(f"stream: {stream} is not a stream handle (handles are below 2**64)")
    if backend == "host":
        if stream is None or stream == -1:
            return False, 0
        raise BufferError(f"stream: host memory has no streams; only None is accepted, got "
                          f"{stream}")
    if stream is None or stream == 1:
        return True, 0           # the legacy default stream; handle 0 in the CUDA API
    if stream == -1:
        return False, 0
    if stream == 0 or stream < -1:
        raise BufferError(f"stream: {stream} is not a valid DLPack stream (0 is ambiguous "
                          f"and disallowed; use 1 for the legacy default stream, 2 for the "
                          f"per-thread one, -1 for no synchronisation, or a stream handle)")
    return True, stream


cdef Buffer _buffer_wrap(mp_dl_block *block, dt, int code, int minor, tuple dims,
                         Py_ssize_t offset, bint readonly, str backend, int device_id,
                         uintptr_t stream):
    """A Buffer taking over one reference on `block`."""
    cdef Buffer buf = Buffer.__new__(Buffer)
    buf._block = block
    buf._base = block.ptr
    buf._block_nbytes = block.nbytes
    buf._dl_dtype.code = code
    buf._dl_dtype.bits = dt.itemsize * 8
    buf._dl_dtype.lanes = 1
    buf._dl_minor = minor
    buf.shape = dims
    buf.dtype = dt
    buf.offset = offset
    buf.readonly = readonly
    buf.backend = backend
    buf.device_id = device_id
    buf.stream = stream
    return buf


cdef tuple _buffer_request(object shape, object dtype):
    """Pool.empty's arguments checked: ``(dims, numpy dtype, DLPack code, minor, nbytes)``."""
    dims = _dl_shape(shape)
    dt, code, minor = _dl_dtype(dtype)
    nbytes = dt.itemsize
    for d in dims:
        nbytes *= d
    if nbytes > MP_MAX_ALLOC:
        raise ValueError(f"shape: {dims} of {dt} is {nbytes} bytes, more than any pool serves")
    return dims, dt, code, minor, nbytes


def _export_simulated(Buffer buf not None, stream=None, max_version=None):
    """Export a sim pool's Buffer as __dlpack__ would (for tests of the capsule and of the
    stream hand-off on the simulated device; the capsule's addresses are fake)."""
    buf._ready()
    if buf.backend != "sim":
        raise ValueError("_export_simulated: for sim pools; use __dlpack__")
    versioned = _dl_wants_versioned(max_version)
    sync, consumer = _dl_consumer_stream(stream, "sim")
    if buf.readonly and not versioned:
        raise BufferError("read-only Buffer to a legacy capsule")
    return buf._export(versioned, sync, consumer, False)


def _dl_live_blocks():
    """Blocks held by Buffers or DLPack consumers, process-wide (a leak check)."""
    return mp_dl_live_blocks()
