# Sharing blocks with other processes (docs/sharing.md, "Other processes"; Note [Sharing
# across processes] in core/mp_share.c, Note [The consumers' ledger] in
# core/mp_share_ledger.c, Note [Imported blocks] in core/mp_share_import.c): the handle a
# producer sends (SharedHandle), a pool's exports (_Sharing: its ledger and the blocks it
# pins), and the work of Pool.export, Pool.import_ and Pool.collect_shared. Takes the C pool
# and the _Sharing, never a Pool.
#
# Uses argument checks (_common), Buffer and _buffer_wrap (_buffer), _pointer_error
# (_pool_errors).
import struct as _struct

from libc.stdint cimport uint32_t, uint64_t, uintptr_t

# The handle's own header before the region's bytes: magic, version, ledger name length;
# then the name, then slot, generation, ticket, offset, nbytes and the region's length.
_SH_MAGIC = b"MPSX"
_SH_VERSION = 1
_SH_HEAD = _struct.Struct("<4sBB")
_SH_FIELDS = _struct.Struct("<IQQQQI")
# An upstream's name in a region header -> the backend of the pools that open it.
_UPSTREAM_BACKENDS = {"sim": "sim", "host": "host", "cuda-pool": "cuda", "cuda-vmm": "cuda"}


def _region_fields(bytes region):
    """(backend, region bytes) of a region handle, or ValueError: what every import checks
    before anything is attached or mapped (the core reads the region's header,
    mp_share_region)."""
    cdef char name[MP_SHARE_NAME_MAX + 1]
    cdef uint64_t nbytes = 0
    cdef const unsigned char *buf = region
    cdef int rc = mp_share_region(buf, len(region), name, sizeof(name), &nbytes)
    if rc == MP_EUNSUPPORTED:
        raise ValueError("handle: the region's description was made by another version of "
                         "mempool; producer and consumer must run the same version")
    if rc != MP_OK:
        raise ValueError("handle: the region's description is not one mempool made "
                         "(bad magic, length or sizes)")
    upstream = name.decode("ascii", "replace")
    backend = _UPSTREAM_BACKENDS.get(upstream)
    if backend is None:
        raise ValueError(f"handle: unknown upstream {upstream!r} in the region's description; "
                         f"accepted: {', '.join(_UPSTREAM_BACKENDS)}")
    return backend, nbytes


class SharedHandle:
    """A block of a :class:`Pool` made for another process: :meth:`Pool.export` makes it,
    :meth:`Pool.import_` (in any process, on a pool of the same backend) maps it.

    Picklable (send it through ``multiprocessing``); ``bytes(handle)`` is its wire form and
    :meth:`from_bytes` rebuilds it. It names the memory (a segment, or a run of pages),
    where the block starts in it (:attr:`offset`), its size (:attr:`nbytes`) and the
    producer's ledger slot that keeps the block from reuse while consumers hold it (see
    docs/sharing.md, "Other processes").
    """

    __slots__ = ("backend", "region", "offset", "nbytes", "ledger", "slot", "generation",
                 "ticket")

    def __init__(self, *args, **kwargs):
        raise TypeError("mempool.SharedHandle is made by Pool.export(), or rebuilt from its "
                        "bytes with SharedHandle.from_bytes(data)")

    @classmethod
    def from_bytes(cls, data):
        """The handle whose ``bytes()`` are `data`; ValueError for bytes no handle has."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"SharedHandle.from_bytes: 'data' must be bytes, got "
                            f"{type(data).__name__}")
        data = bytes(data)
        if len(data) > MP_SHARE_HANDLE_MAX + 512:
            raise ValueError(f"SharedHandle.from_bytes: {len(data)} bytes, more than any "
                             f"handle has ({MP_SHARE_HANDLE_MAX + 512} at most)")
        if len(data) < _SH_HEAD.size:
            raise ValueError(f"SharedHandle.from_bytes: {len(data)} bytes, too short for a "
                             f"handle")
        magic, version, namelen = _SH_HEAD.unpack_from(data)
        at = _SH_HEAD.size + namelen
        if magic != _SH_MAGIC or version != _SH_VERSION or namelen >= MP_LEDGER_NAME_MAX \
                or len(data) < at + _SH_FIELDS.size:
            raise ValueError("SharedHandle.from_bytes: not the bytes of a mempool "
                             "SharedHandle (bad magic, version or length)")
        try:
            ledger = data[_SH_HEAD.size:at].decode("ascii")
        except UnicodeDecodeError:
            raise ValueError("SharedHandle.from_bytes: the ledger name is not ASCII") from None
        slot, gen, ticket, offset, nbytes, rlen = _SH_FIELDS.unpack_from(data, at)
        region = data[at + _SH_FIELDS.size:]
        if len(region) != rlen or rlen > MP_SHARE_HANDLE_MAX:
            raise ValueError(f"SharedHandle.from_bytes: the region's description should be "
                             f"{rlen} bytes, {len(region)} follow")
        backend, region_nbytes = _region_fields(region)
        if nbytes == 0 or offset + nbytes > region_nbytes:
            raise ValueError(f"SharedHandle.from_bytes: {nbytes} bytes at offset {offset} "
                             f"do not lie in the region's {region_nbytes} bytes")
        h = object.__new__(cls)
        for name, value in (("backend", backend), ("region", region), ("offset", offset),
                            ("nbytes", nbytes), ("ledger", ledger), ("slot", slot),
                            ("generation", gen), ("ticket", ticket)):
            object.__setattr__(h, name, value)
        return h

    def __bytes__(self):
        name = self.ledger.encode("ascii")
        return (_SH_HEAD.pack(_SH_MAGIC, _SH_VERSION, len(name)) + name
                + _SH_FIELDS.pack(self.slot, self.generation, self.ticket, self.offset,
                                  self.nbytes, len(self.region)) + self.region)

    def __reduce__(self):
        return (SharedHandle.from_bytes, (bytes(self),))

    def __setattr__(self, name, value):
        raise AttributeError("a SharedHandle is immutable")

    def __eq__(self, other):
        return isinstance(other, SharedHandle) and bytes(self) == bytes(other)

    def __hash__(self):
        return hash(bytes(self))

    def __repr__(self):
        return (f"<mempool.SharedHandle backend={self.backend} nbytes={self.nbytes} "
                f"offset={self.offset} slot={self.slot}>")


cdef class _Sharing:
    """A producer pool's exports: its ledger (made at the first export) and the blocks it
    pins, by address: [slot, generation, Buffers held, the producer's free (stream,
    has_stream) or False]."""
    cdef mp_ledger *ledger
    cdef readonly str name
    cdef readonly dict pins

    def __cinit__(self):
        self.ledger = NULL
        self.pins = {}

    def __dealloc__(self):
        if self.ledger != NULL:
            mp_ledger_destroy(self.ledger)
            self.ledger = NULL

    cdef int open_ledger(self) except -1:
        cdef char name[64]
        if self.ledger != NULL:
            return 0
        rc = mp_ledger_create(&self.ledger, name)
        if rc != MP_OK:
            self.ledger = NULL
            raise RuntimeError(f"export: could not make the consumers' ledger in shared "
                               f"memory (shm_open under /dev/shm, error {rc})")
        self.name = name.decode("ascii")
        return 0

    cdef int close(self) except -1:
        """The pool closes: no consumer can join from now on (the ledger is unlinked)."""
        self.pins.clear()
        if self.ledger != NULL:
            mp_ledger_destroy(self.ledger)
            self.ledger = NULL
        return 0


cdef bytes _share_region(mp_pool *pool, uintptr_t ptr, size_t *offset):
    """mp_share's bytes for the live block at ptr, with room retried once."""
    cdef size_t cap = 4096, length = 0
    cdef int rc
    cdef bytearray buf
    cdef unsigned char *at
    for _ in range(2):
        buf = bytearray(cap)
        at = <unsigned char *><char *>buf
        mp_pool_retain(pool)   # Note [Closing a pool]: another thread may close meanwhile
        with nogil:
            rc = mp_share(pool, ptr, at, cap, &length, offset)
        mp_pool_release(pool)
        if rc == MP_EINVAL and length > cap:
            cap = length
            continue
        break
    if rc in (MP_ENOTFOUND, MP_EINTERIOR, MP_EDOUBLEFREE):
        raise _pointer_error(rc, "export", ptr)
    if rc == MP_EUNSUPPORTED:
        raise RuntimeError("export: this pool's upstream cannot share its memory with other "
                           "processes")
    if rc != MP_OK:
        raise RuntimeError(f"export: the upstream could not describe the block at {ptr:#x} "
                           f"(error {rc})")
    return bytes(buf[:length])


cdef object _share_export(mp_pool *pool, str backend, _Sharing sharing, object target):
    """Pool.export: the block of `target` (a Buffer of this pool or an address it handed
    out) waited for, described, pinned, and one hold in flight added for the handle."""
    cdef Buffer buf = None
    cdef uintptr_t ptr, stream = 0
    cdef size_t nbytes = 0, view_offset = 0, offset = 0
    cdef uint32_t slot
    cdef uint64_t gen, ticket
    cdef int rc
    if isinstance(target, Buffer):
        buf = <Buffer>target
        buf._ready()
        if buf._block.pool != pool or buf._base == 0:
            raise ValueError("export: 'buffer_or_ptr' is a Buffer of another pool (or an "
                             "empty one); accepted: a Buffer this pool made, or an address "
                             "it handed out")
        ptr = buf._base
        view_offset = buf.offset
        nbytes = buf.nbytes
    elif isinstance(target, int) and not isinstance(target, bool):
        ptr = _as_pointer(target)
    else:
        raise TypeError(f"export: 'buffer_or_ptr' must be a mempool.Buffer or an int "
                        f"address, got {type(target).__name__}")
    region = _share_region(pool, ptr, &offset)   # refuses what is no live block's start
    cdef size_t block_nbytes = 0
    if mp_block_info(pool, ptr, &block_nbytes, NULL, &stream) != MP_OK:
        raise _pointer_error(MP_ENOTFOUND, "export", ptr)
    if buf is None:
        nbytes = block_nbytes
    if nbytes == 0:
        raise ValueError("export: 'buffer_or_ptr' has no bytes to share")
    # The consumer must see what was written: the block's stream is waited for first.
    mp_pool_retain(pool)   # Note [Closing a pool]: another thread may close meanwhile
    with nogil:
        rc = mp_share_sync(pool, ptr)
    mp_pool_release(pool)
    if rc != MP_OK:
        raise RuntimeError(f"export: waiting for the block's stream failed (error {rc})")
    sharing.open_ledger()
    _share_collect(pool, sharing)
    pin = sharing.pins.get(ptr)
    if pin is not None and pin[3]:
        raise _pointer_error(MP_EDOUBLEFREE, "export", ptr)   # freed here, kept for others
    if pin is None:
        rc = mp_ledger_take(sharing.ledger, &slot, &gen)
        if rc != MP_OK:
            raise RuntimeError(f"export: every slot of the ledger holds a block still "
                               f"shared ({len(sharing.pins)} blocks); release some first")
        pin = [slot, gen, [], False]
        sharing.pins[ptr] = pin
    slot, gen = pin[0], pin[1]
    if mp_ledger_send(sharing.ledger, slot, gen, &ticket) != MP_OK:
        raise RuntimeError("export: the block is shared with as many processes as its "
                           "ledger slot holds; release some first")
    if buf is not None:
        pin[2].append(buf)
    h = object.__new__(SharedHandle)
    for name, value in (("backend", backend), ("region", region),
                        ("offset", offset + view_offset), ("nbytes", nbytes),
                        ("ledger", sharing.name), ("slot", slot), ("generation", gen),
                        ("ticket", ticket)):
        object.__setattr__(h, name, value)
    return h


cdef bint _share_pinned_free(_Sharing sharing, uintptr_t ptr, uintptr_t stream,
                             int has_stream) except -1:
    """Pool.free of an exported block (on `stream` when has_stream): kept live until its
    consumers let go, then freed as asked (True); False when not exported."""
    pin = sharing.pins.get(ptr)
    if pin is None:
        return False
    if pin[3]:
        raise _pointer_error(MP_EDOUBLEFREE, "free", ptr)
    pin[3] = (stream, has_stream)
    return True


cdef Py_ssize_t _share_collect(mp_pool *pool, _Sharing sharing) except -1:
    """Pool.collect_shared: blocks whose consumers all let go (or are gone) are unpinned;
    returns how many went back to the pool."""
    cdef size_t holds = 0
    cdef int retired = 0
    cdef uintptr_t ptr
    if sharing is None or sharing.ledger == NULL:
        return 0
    given = 0
    for key, pin in list(sharing.pins.items()):
        ptr = key
        if mp_ledger_collect(sharing.ledger, pin[0], pin[1], 1, &holds, &retired) != MP_OK:
            retired = 1
        if not retired:
            continue
        del sharing.pins[key]
        held = pin[2]
        pin[2] = []
        del held   # the Buffers this pool held go; the block with the last holder
        if pin[3]:
            mp_free(pool, ptr, pin[3][0], pin[3][1])
        if mp_block_info(pool, ptr, NULL, NULL, NULL) != MP_OK:
            given += 1
    return given


cdef object _share_import(mp_pool *pool, str backend, int device_id, object handle):
    """Pool.import_: a Buffer over the memory `handle` names, this process a holder in the
    producer's ledger until the Buffer (and every view and DLPack export of it) goes."""
    if not isinstance(handle, SharedHandle):
        raise TypeError(f"import_: 'handle' must be a mempool.SharedHandle (rebuild one from "
                        f"bytes with SharedHandle.from_bytes), got {type(handle).__name__}")
    if handle.backend != backend:
        raise ValueError(f"import_: 'handle' comes from a {handle.backend!r} pool and this "
                         f"pool is {backend!r}: a handle opens only on a pool of its backend")
    cdef bytes region = handle.region
    cdef bytes name = handle.ledger.encode("ascii")
    cdef mp_ledger *ledger = NULL
    cdef uint32_t slot = handle.slot
    cdef uint64_t gen = handle.generation, ticket = handle.ticket
    cdef uintptr_t base = 0
    cdef size_t nbytes = 0
    cdef mp_pool *ipool = NULL
    cdef mp_dl_block *block = NULL
    cdef int rc = mp_ledger_attach(name, &ledger)
    if rc == MP_ENOTFOUND:
        raise ValueError(f"import_: the producer is gone: the process that exported "
                         f"'handle' (ledger {handle.ledger!r}) was killed before its pool "
                         f"closed, and its memory with it")
    if rc == MP_EUNSUPPORTED:
        raise ValueError(f"import_: the producer's ledger {handle.ledger!r} was made by "
                         f"another version of mempool; producer and consumer must run the "
                         f"same version")
    if rc != MP_OK:
        raise ValueError(f"import_: the producer's ledger {handle.ledger!r} is gone (its pool "
                         f"closed or its process exited) or is not a ledger")
    if backend != "sim" and mp_ledger_foreign(ledger):
        # Its descriptors are taken by the producer's pid, which names another process here.
        mp_ledger_detach(ledger)
        raise RuntimeError(f"import_: the producer of 'handle' runs in another pid namespace "
                           f"(another container): a {backend!r} handle's memory is taken from "
                           f"the producer by its pid, which names another process here; run "
                           f"producer and consumer in one pid namespace (docker: --pid=host or "
                           f"--pid=container:NAME)")
    rc = mp_ledger_join(ledger, slot, gen, ticket)
    if rc != MP_OK:
        mp_ledger_detach(ledger)
        if rc == MP_EBUSY:
            raise RuntimeError("import_: the block is held by as many processes as its "
                               "ledger slot holds")
        raise ValueError("import_: 'handle' is stale: the producer gave its block back "
                         "(every consumer had released it)")
    cdef const unsigned char *at = <const unsigned char *><char *>region
    cdef size_t length = len(region)
    mp_pool_retain(pool)   # Note [Closing a pool]: another thread may close meanwhile
    with nogil:
        rc = mp_share_open(pool, at, length, &base, &nbytes)
    if rc == MP_OK:
        rc = mp_share_import_pool(pool, base, nbytes, ledger, slot, gen, &ipool)
        if rc != MP_OK:
            mp_share_close(pool, base)
    mp_pool_release(pool)   # the import pool holds its own reference
    if rc != MP_OK:
        mp_ledger_leave(ledger, slot, gen)
        mp_ledger_detach(ledger)
        if rc == MP_EINVAL:
            raise ValueError("import_: 'handle' does not describe memory this pool can map "
                             "(bytes not made by export, or its memory is gone)")
        if rc == MP_EUNSUPPORTED:
            raise RuntimeError(
                "import_: the producer's memory cannot be taken into this process: "
                "pidfd_getfd was refused (it needs Linux 5.6 or later and ptrace permission "
                "over the producer: see /proc/sys/kernel/yama/ptrace_scope: 0, or 1 with this "
                "process an ancestor of the producer or allowed by its prctl(PR_SET_PTRACER)), "
                "and the producer's descriptor server did not answer (it answers processes of "
                "its own user and network namespace)")
        raise RuntimeError(f"import_: opening the handle failed (error {rc})")
    # The Buffer's block: the import pool's one allocation, at the region's start.
    rc = mp_dl_block_new(ipool, nbytes, 0, &block)
    mp_pool_release(ipool)   # the block holds its own reference; its last release cleans up
    if rc != MP_OK or block.ptr != base:
        if rc == MP_OK:
            mp_dl_block_release(block)
        raise MemoryError(f"import_: could not wrap the opened region (error {rc})")
    dt, code, minor = _dl_dtype("uint8")
    return _buffer_wrap(block, dt, code, minor, (handle.nbytes,), handle.offset, False,
                        backend, device_id, 0)
