# Test controls, not part of the product (no product path uses them): the Python faces of
# the pool's capture counter (docs/architecture.md, Note [Graph capture]), for tests and for
# code that captures on one thread while others allocate, and of a limit shared between
# pools (Note [Shared limit]). Native glue (PyTorch's) calls mp_capture_begin/mp_capture_end
# and mp_share_limit itself.


def _capture_begin(Pool pool not None):
    """Tell ``pool`` that a CUDA graph capture is about to start (counted; see
    :func:`_capture_end`): until then it releases nothing, makes no stream sync, event query
    or cross-stream reuse, and defers frees with recorded streams."""
    pool._ready()
    if mp_capture_begin(pool._pool) != MP_OK:
        raise ValueError("_capture_begin: too many captures under way")


def _capture_end(Pool pool not None):
    """Tell ``pool`` that a capture it was told of has ended; when none is left, deferred
    frees and releases happen now. ``ValueError`` when none was begun."""
    pool._ready()
    # Deferred frees make their events now, and releases free segments: the GIL goes
    # meanwhile (Note [Blocking upstream calls], Note [Events outside the lock]).
    pool._in_core += 1   # Note [Closing a pool]
    mp_py_mark(1)
    cdef int rc = mp_capture_end(pool._pool)
    mp_py_mark(0)
    pool._in_core -= 1
    if rc != MP_OK:
        raise ValueError("_capture_end: no capture was begun on this pool")


def _capture_known(Pool pool not None):
    """Whether ``pool`` knows of a CUDA graph capture under way: it was told of one
    (:func:`_capture_begin`) or one of the streams it uses captures. A capture on a stream
    it never used is not known (Note [Graph capture])."""
    pool._ready()
    return bool(mp_capture_known(pool._pool))


def _share_limit(Pool member not None, Pool owner not None):
    """For tests of Note [Shared limit] (mp_release.c): make `member` count its reserved
    bytes against `owner`'s limit too, as the torch glue does with the private pools of a
    device (the pool of a CUDA graph or a MemPool, which needs CUDA). Raises ValueError
    where the core refuses (see mp_share_limit in mp_core.h)."""
    member._ready()
    owner._ready()
    cdef int rc = mp_share_limit(member._pool, owner._pool)
    if rc == MP_EBUSY:
        raise ValueError("member: it holds memory already; share a limit before the first "
                         "segment")
    if rc != MP_OK:
        raise ValueError("member: the same pool as owner, a member already, or a pool "
                         "whose limit others share; owner: not a member itself")
