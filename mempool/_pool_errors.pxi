# The messages of a Pool's refused calls: a closed pool, a pool inherited across fork, a bad
# pointer, an out-of-memory refusal explained from the core's record, and close()'s refusal
# while blocks are live. Each takes the C pool (or nothing), never the Pool, and returns the
# exception for the caller to raise.
#
# Uses the core's codes and records (_cdefs.pxd) only.
from libc.stdint cimport uintptr_t

import os as _os

from mempool._units import format_bytes as _fmt
from mempool._errors import OutOfMemoryError, PoolClosedError

#: Core codes, for tests of the messages built from them.
_MP_EINVAL = MP_EINVAL


cdef object _closed_error(str backend, int device_id):
    """The error of a call on a closed Pool (Note [Closing a pool])."""
    return PoolClosedError(f"this Pool (backend {backend!r}, device {device_id}) is "
                           f"closed: it serves no call; make a new Pool (mempool.default_pool() "
                           f"makes a fresh default pool)")


cdef object _forked_error(mp_pool *pool):
    # Note [Pools across fork] (mp_fork.c): a child may only drop what it inherited.
    return RuntimeError(f"this pool was created in process {mp_pool_inherited(pool)}; "
                        f"a forked child (process {_os.getpid()}) must create its own pool")


def _pointer_error(int rc, str op, uintptr_t p):
    """The exception for core code `rc` from a call on pointer `p` (not alloc's codes)."""
    if rc == MP_EINTERIOR:
        return ValueError(f"{op}: {p:#x} points inside a live block of this pool, not at its "
                          f"start")
    if rc == MP_EDOUBLEFREE:
        return ValueError(f"{op}: {p:#x} is not live: it lies in free memory of this pool "
                          f"(already freed?)")
    if rc == MP_ENOMEM:
        return MemoryError(f"{op}: out of host memory for the pool's bookkeeping")
    if rc == MP_EINVAL:
        return ValueError(f"{op}: too many streams recorded for {p:#x}: at most "
                          f"{MP_MAX_RECORDED_STREAMS} streams besides its own may be "
                          f"recorded on one block")
    return ValueError(f"{op}: {p:#x} is not a live pointer of this pool "
                      f"(never allocated here, or freed and its segment released)")


cdef object _oom_error(mp_pool *pool, int rc, size_t nbytes, uintptr_t stream, str backend,
                       int device_id):
    """The error of an allocation the core refused with `rc`: an OutOfMemoryError that
    explains it, with the core's record of the refusal as its `record` when the device or
    the limit refused."""
    # One snapshot, taken under the pool's lock where the fallback chain gave up (mp_oom):
    # what is cached then is what no release could return (free blocks inside segments
    # that hold live ones), so "cached but no block big enough" means fragmentation.
    cdef mp_oom rec
    if rc == MP_EFORKED:
        return _forked_error(pool)
    if mp_oom_take(&rec) != MP_OK or rec.pool != pool or rec.nbytes != nbytes:
        mp_oom_snapshot(pool, rc, nbytes, stream, &rec)   # refused before the pool
    rec.code = rc   # what the caller was told, should a record disagree
    # Note [One OOM explainer] (core/mp_oom.c): the PyTorch glue explains its refusals
    # with the same rules and words.
    cdef char text[1024]
    backend_bytes = backend.encode()
    mp_oom_message(pool, &rec, backend_bytes, device_id, MP_OOM_WORDS_POOL, text,
                   sizeof(text))
    message = text.decode()
    if rc not in (MP_ENOMEM, MP_ELIMIT):
        return OutOfMemoryError(message)
    reserved, used, cached = rec.reserved_bytes, rec.used_bytes, rec.cached_bytes
    largest = rec.largest_free_block
    error = OutOfMemoryError(message)
    error.record = dict(nbytes=rec.nbytes, rounded=rec.rounded, reserved_bytes=reserved,
                        used_bytes=used, pending_bytes=rec.pending_bytes, cached_bytes=cached,
                        largest_free_block=largest, num_ooms=rec.num_ooms)
    return error


cdef object _live_blocks_refusal(mp_pool *pool):
    """close()'s message when `pool` has live blocks (None when it has none): their count,
    their bytes and the first few addresses."""
    if mp_used_bytes(pool) == 0:
        return None
    cdef mp_layout lay
    if mp_layout_take(pool, &lay) != MP_OK:
        raise MemoryError("close: out of host memory")
    cdef size_t i, count = 0, nbytes = 0
    first = []
    try:
        for i in range(lay.nblocks):
            if lay.blocks[i].state == MP_BLOCK_ALLOCATED:
                count += 1
                nbytes += lay.blocks[i].nbytes
                first.append(lay.blocks[i].ptr)
    finally:
        mp_layout_free(&lay)
    if count == 0:
        return None
    first.sort()
    shown = ", ".join(f"{ptr:#x}" for ptr in first[:4]) + (", ..." if count > 4 else "")
    return (f"close: the pool has {count} live block(s) of {_fmt(nbytes, exact=True)} "
            f"({shown}); free them first, or close(force=True) to give them up")


cdef object _close_refusal(mp_pool *pool, int device_id, int in_core, bint force):
    """The error close() raises instead of closing (None when it may close): calls under way
    in other threads (Note [Closing a pool]), the pool being PyTorch's allocator, or live
    blocks unless `force`."""
    if in_core:
        return RuntimeError(f"close: {in_core} call(s) on this pool are under way in other "
                            f"threads; close it once they have returned")
    if 0 <= device_id < MP_TORCH_MAX_DEVICES and mp_torch_registered(device_id) == pool:
        return RuntimeError(f"close: the pool is PyTorch's allocator on device {device_id} "
                            f"(mempool.torch); unregister it first "
                            f"(mempool.torch.unregister({device_id}))")
    if not force:
        refusal = _live_blocks_refusal(pool)
        if refusal is not None:
            return RuntimeError(refusal)
    return None
