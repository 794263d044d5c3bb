"""The control plane of backend="cuda": cudaMemPool handles through CuPy's runtime bindings.

The data plane (allocate a segment, free it, events, virtual memory) is C code that calls the
CUDA driver without the GIL (mempool/_csrc/upstream/mp_cuda.c). What happens rarely and may
hold the GIL lives here: choosing or creating the ``cudaMemPool_t`` the segments come from, setting its
release threshold and reuse policies, reading its Reserved/Used attributes, trimming and
destroying it. Runtime and driver pool handles are the same values, so a handle from here is
what the C upstream is given.

Importing this module needs neither CuPy nor a GPU; every function but :func:`available`
raises ``RuntimeError`` when CuPy or the device is missing.
"""
import functools

__all__ = [
    "KEEP_ALL",
    "POOL_HANDLES",
    "allocation_unit",
    "attributes",
    "available",
    "can_access_peer",
    "configure",
    "current_stream_ptr",
    "destroy",
    "device_count",
    "driver_release_threshold",
    "reset_peaks",
    "resolve_pool_handle",
    "segment_rounding_for",
    "shareable_supported",
    "trim_to",
]

#: The release threshold that keeps every freed byte reserved (the attribute is a uint64).
KEEP_ALL = 2**64 - 1
#: The names `resolve_pool_handle` accepts besides an integer handle.
POOL_HANDLES = ("create", "default", "current")


def _runtime():
    """CuPy's runtime bindings, or a RuntimeError saying what to install."""
    try:
        from cupy.cuda import runtime
    except Exception as exc:  # ImportError, or a broken CUDA install raising at import
        raise RuntimeError(
            "backend='cuda' needs CuPy (pip install cupy-cuda12x or cupy-cuda13x); "
            f"importing it failed: {exc}") from exc
    return runtime


def _call(what, fn, *args):
    """fn(*args), with a CUDA failure turned into a RuntimeError that says what was done."""
    try:
        return fn(*args)
    except Exception as exc:
        raise RuntimeError(f"{what} failed: {exc}") from exc


def _check_int(name, value, low=0, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}, got {value}")
    return value


def _check_handle(handle):
    """A cudaMemPool_t is a non-null pointer; anything else would reach the driver as garbage."""
    return _check_int("handle", handle, low=1, high=2**64 - 1)


def available() -> bool:
    """Whether backend="cuda" can run here.

    True when CuPy imports, the CUDA runtime sees at least one device and, where the compiled
    core is built, the CUDA driver loads for the data plane too. Never raises.

    Returns
    -------
    bool
    """
    try:
        if _runtime().getDeviceCount() <= 0:
            return False
    except Exception:
        return False
    try:
        from mempool import _core
    except Exception:
        # A core that does not build or import is a build failure, not a missing device:
        # let the caller meet it where it uses the Pool.
        return True
    probe = getattr(_core, "_cuda_driver_available", None)
    try:
        return bool(probe()) if probe is not None else True
    except Exception:
        return False


def device_count():
    """Number of CUDA devices visible to this process.

    Returns
    -------
    int
    """
    rt = _runtime()
    return _call("counting CUDA devices (cudaGetDeviceCount)", rt.getDeviceCount)


def can_access_peer(device, peer_device):
    """Whether kernels on `device` can be given access to `peer_device`'s memory
    (``cudaDeviceCanAccessPeer``): a peer path between the two exists.

    Returns
    -------
    bool
    """
    _check_device(device)
    _check_device(peer_device)
    if device == peer_device:
        return False
    rt = _runtime()
    return bool(_call(f"asking whether device {device} can access device {peer_device} "
                      "(cudaDeviceCanAccessPeer)", rt.deviceCanAccessPeer, device, peer_device))


def _check_device(device):
    _check_int("device", device)
    count = device_count()
    if device >= count:
        raise ValueError(f"device must be a device ordinal in [0, {count}), got {device}")
    return device


# cudaDevAttrMemoryPoolSupportedHandleTypes, and its bit for cudaMemHandleTypePosixFileDescriptor
# (the values of CUDA's driver_types.h, stable since CUDA 11.2).
_ATTR_POOL_HANDLE_TYPES = 119
_POSIX_FD = 0x1


def shareable_supported(device):
    """Whether a cudaMemPool on `device` can be created to share its memory with other
    processes: the device's ``cudaDevAttrMemoryPoolSupportedHandleTypes`` has the POSIX
    file-descriptor bit (Linux, a driver and device with memory-pool IPC).

    Parameters
    ----------
    device : int
        Device ordinal.

    Returns
    -------
    bool
    """
    _check_device(device)
    rt = _runtime()
    types = _call(f"reading device {device}'s memory-pool handle types "
                  "(cudaDevAttrMemoryPoolSupportedHandleTypes)", rt.deviceGetAttribute,
                  _ATTR_POOL_HANDLE_TYPES, device)
    return bool(int(types) & _POSIX_FD)


def resolve_pool_handle(pool_handle, device, shareable=False):
    """The ``cudaMemPool_t`` a Pool on `device` takes its segments from.

    Parameters
    ----------
    pool_handle : {"create", "default", "current"} or int
        ``"create"``: a new pool of pinned device memory on `device`, owned by the caller;
        ``"default"``: the device's default pool (shared with CuPy's ``MemoryAsyncPool``
        and anything else using ``cudaMallocAsync`` on it); ``"current"``: the device's
        current pool (the default one unless someone called ``cudaDeviceSetMemPool``);
        an int: an existing ``cudaMemPool_t`` made elsewhere, for `device`.
    device : int
        Device ordinal.
    shareable : bool
        Create the pool so that its memory can be shared with other processes (the POSIX
        file-descriptor handle type): only with ``"create"``, where
        :func:`shareable_supported` says the device can.

    Returns
    -------
    handle : int
        The pool handle.
    owned : bool
        True when the caller must `destroy` it (only for ``"create"``).
    """
    if not isinstance(shareable, bool):
        raise TypeError(f"shareable must be a bool, got {type(shareable).__name__} "
                        f"{shareable!r}")
    if shareable and pool_handle != "create":
        raise ValueError(
            f"pool_handle={pool_handle!r} cannot share its memory with other processes: only "
            "a cudaMemPool the Pool creates can be made shareable; create the Pool with "
            "pool_handle='create' (the default) and ipc=True")
    if isinstance(pool_handle, str):
        if pool_handle not in POOL_HANDLES:
            raise ValueError(
                f"pool_handle must be one of {', '.join(map(repr, POOL_HANDLES))} or an int "
                f"cudaMemPool_t handle, got {pool_handle!r}")
    elif isinstance(pool_handle, bool) or not isinstance(pool_handle, int):
        raise TypeError(
            f"pool_handle must be one of {', '.join(map(repr, POOL_HANDLES))} or an int "
            f"cudaMemPool_t handle, got {type(pool_handle).__name__} {pool_handle!r}")
    else:
        if pool_handle <= 0 or pool_handle > 2**64 - 1:
            raise ValueError(
                f"pool_handle as an int must be a non-null cudaMemPool_t, got {pool_handle}")
        _check_device(device)
        return pool_handle, False
    rt = _runtime()
    _check_device(device)
    if pool_handle == "default":
        return _call(f"getting device {device}'s default memory pool "
                     "(cudaDeviceGetDefaultMemPool)", rt.deviceGetDefaultMemPool, device), False
    if pool_handle == "current":
        return _call(f"getting device {device}'s current memory pool (cudaDeviceGetMemPool)",
                     rt.deviceGetMemPool, device), False
    if shareable and not shareable_supported(device):
        raise ValueError(
            f"device {device} cannot create a cudaMemPool shared with other processes (its "
            "cudaDevAttrMemoryPoolSupportedHandleTypes lacks POSIX file descriptors); "
            "create the Pool with ipc=False")
    handle_type = _POSIX_FD if shareable else rt.cudaMemHandleTypeNone
    props = rt.MemPoolProps(rt.cudaMemAllocationTypePinned, handle_type,
                            rt.cudaMemLocationTypeDevice, device)
    what = "a shareable memory pool" if shareable else "a memory pool"
    return _call(f"creating {what} on device {device} (cudaMemPoolCreate)",
                 rt.memPoolCreate, props), True


def _bool_attrs(rt):
    return {
        "reuse_follow_event_dependencies": rt.cudaMemPoolReuseFollowEventDependencies,
        "reuse_allow_opportunistic": rt.cudaMemPoolReuseAllowOpportunistic,
        "reuse_allow_internal_dependencies": rt.cudaMemPoolReuseAllowInternalDependencies,
    }


# Note [The driver keeps nothing given back]
# The Pool is the cache. What it gives back (segments beyond need, over the limit or the GC
# threshold, empty_cache, trim) it means to give back, so with release_threshold None the
# cudaMemPool the Pool created keeps nothing freed: the driver returns it to the device at
# the next synchronization, CUDA's own default for a pool. A threshold given is set on the
# cudaMemPool too, as the option documents. A shared cudaMemPool ("default", "current", a
# handle) keeps its owner's threshold unless one is given: that is someone else's policy
# (set_release_threshold(None) then leaves the last one given). The threshold does not
# change the cudaMemPool's own high watermark, which includes the driver's overhead over the
# segments it hands out; only expandable segments (cuMemCreate, no cudaMemPool) avoid it,
# and Note [The cudaMemPool's unit] keeps it to nothing on the default path.
def driver_release_threshold(pool_handle, release_threshold):
    """The cudaMemPool release threshold a Pool sets for its ``release_threshold`` option
    (None: leave the cudaMemPool's own as it is); Note [The driver keeps nothing given
    back] says why.
    """
    if release_threshold is not None:
        return release_threshold
    return 0 if pool_handle == "create" else None


# Note [The cudaMemPool's unit]
# A cudaMemPool backs what it hands out with physical chunks of its own: any allocation up
# to the chunk holds one chunk, larger ones the next multiple, and a run of them the smallest
# multiple covering their total (bench/driver_granularity.py measures it). Fixed segments of
# other sizes share chunks with each other, and a chunk goes back only when every segment in
# it has: the pieces of chunks that freed segments leave are the driver's, out of the Pool's
# sight and count. So by default the Pool rounds its segments to the unit once it holds
# more than a few units, the small ones included (Note [Segment rounding], mp_core.c): each
# segment is whole chunks, the first of them large enough that what the Pool reserves is
# whole chunks, so each starts on a chunk boundary and what the Pool reserves is what the
# device holds for it. Small segments are rounded too, as one small segment among the large
# ones sets those after it off the boundaries. The tails of rounded segments serve later
# requests. A smaller pool keeps plain segments, which the cudaMemPool packs side by side
# into its chunks: whole units there would hold a part-used unit per kind of request. The
# unit is read from the driver, not assumed: one 1-byte allocation from a cudaMemPool made
# for the purpose, once per device and process.
_units = {}


def allocation_unit(device):
    """The device memory a cudaMemPool on `device` holds for its smallest allocation (bytes),
    measured once per device (Note [The cudaMemPool's unit]); None when the probe could not
    allocate (the device is full: then nothing is cached and the next Pool asks again).

    Nothing here synchronizes: the probe's free is stream-ordered, and the driver releases
    the destroyed pool and stream once it has run, so a Pool made while another stream
    captures a CUDA graph breaks nothing.
    """
    _check_device(device)
    if device in _units:
        return _units[device]
    rt = _runtime()
    handle, _ = resolve_pool_handle("create", device)
    previous = _call("reading the current device (cudaGetDevice)", rt.getDevice)
    stream = None
    unit = None
    try:
        _call(f"setting device {device} (cudaSetDevice)", rt.setDevice, device)
        stream = _call("creating a stream (cudaStreamCreateWithFlags)",
                       rt.streamCreateWithFlags, 1)   # cudaStreamNonBlocking
        try:
            ptr = rt.mallocFromPoolAsync(1, handle, stream)
        except Exception:
            return None
        unit = int(_call("reading the pool's reserved memory", rt.memPoolGetAttribute, handle,
                         rt.cudaMemPoolAttrReservedMemCurrent))
        _call("freeing the probe (cudaFreeAsync)", rt.freeAsync, ptr, stream)
    finally:
        if stream is not None:
            rt.streamDestroy(stream)
        rt.setDevice(previous)
        destroy(handle)
    _units[device] = unit
    return unit


def segment_rounding_for(unit):
    """The segment_rounding a Pool on a cudaMemPool takes when the option is None: the
    cudaMemPool's unit where the core can round to it (a multiple of 2 MiB above 2 MiB, up to
    1 GiB), else None (plain segments, as PyTorch's). The core rounds to it once the pool
    holds a few units (Note [Segment rounding])."""
    if not isinstance(unit, int) or isinstance(unit, bool):
        return None
    two_mib = 2 << 20
    if unit <= two_mib or unit % two_mib or unit > (1 << 30):
        return None
    return unit


def configure(handle, release_threshold=None, reuse_follow_event_dependencies=None,
              reuse_allow_opportunistic=None, reuse_allow_internal_dependencies=None):
    """Set a pool's release threshold and reuse policies; None leaves a setting as it is.

    Every argument is checked before anything is set.

    Parameters
    ----------
    handle : int
        A ``cudaMemPool_t``.
    release_threshold : int, optional
        Bytes of freed memory the driver keeps reserved at a synchronization
        (``cudaMemPoolAttrReleaseThreshold``); `KEEP_ALL` keeps everything.
    reuse_follow_event_dependencies, reuse_allow_opportunistic, reuse_allow_internal_dependencies : bool, optional
        The pool's ``cudaMemPoolReuse*`` policies.
    """
    _check_handle(handle)
    if release_threshold is not None:
        _check_int("release_threshold", release_threshold, high=KEEP_ALL)
    flags = {
        "reuse_follow_event_dependencies": reuse_follow_event_dependencies,
        "reuse_allow_opportunistic": reuse_allow_opportunistic,
        "reuse_allow_internal_dependencies": reuse_allow_internal_dependencies,
    }
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool or None, got {type(value).__name__} "
                            f"{value!r}")
    rt = _runtime()
    if release_threshold is not None:
        _call("setting cudaMemPoolAttrReleaseThreshold", rt.memPoolSetAttribute, handle,
              rt.cudaMemPoolAttrReleaseThreshold, release_threshold)
    for name, attr in _bool_attrs(rt).items():
        if flags[name] is not None:
            _call(f"setting the pool's {name}", rt.memPoolSetAttribute, handle, attr,
                  int(flags[name]))


def attributes(handle):
    """A pool's attributes, read from the driver.

    Parameters
    ----------
    handle : int
        A ``cudaMemPool_t``.

    Returns
    -------
    dict
        ``reserved_current``, ``reserved_high``, ``used_current``, ``used_high`` (bytes:
        backing memory the pool holds, and the part of it handed out, now and at the high
        watermark), ``release_threshold`` (bytes) and the three reuse policies (bool).
    """
    _check_handle(handle)
    rt = _runtime()
    sizes = {
        "reserved_current": rt.cudaMemPoolAttrReservedMemCurrent,
        "reserved_high": rt.cudaMemPoolAttrReservedMemHigh,
        "used_current": rt.cudaMemPoolAttrUsedMemCurrent,
        "used_high": rt.cudaMemPoolAttrUsedMemHigh,
        "release_threshold": rt.cudaMemPoolAttrReleaseThreshold,
    }
    out = {}
    for name, attr in sizes.items():
        out[name] = int(_call(f"reading the pool's {name}", rt.memPoolGetAttribute, handle,
                              attr))
    for name, attr in _bool_attrs(rt).items():
        out[name] = bool(_call(f"reading the pool's {name}", rt.memPoolGetAttribute, handle,
                               attr))
    return out


def reset_peaks(handle):
    """Reset the pool's reserved and used high watermarks to the current values.

    Parameters
    ----------
    handle : int
        A ``cudaMemPool_t``.
    """
    _check_handle(handle)
    rt = _runtime()
    # The driver accepts only 0 for the high watermarks and then restarts them from current.
    for attr in (rt.cudaMemPoolAttrReservedMemHigh, rt.cudaMemPoolAttrUsedMemHigh):
        _call("resetting the pool's high watermarks", rt.memPoolSetAttribute, handle, attr, 0)


def trim_to(handle, keep, sync_device=None):
    """Release the pool's unused backing memory down to `keep` bytes (``cudaMemPoolTrimTo``).

    Memory still handed out (segments the Pool holds) is never released, and neither is
    memory freed in stream order whose free the host has not yet seen complete: pass
    `sync_device` to synchronize that device first, so that every queued free counts.

    Parameters
    ----------
    handle : int
        A ``cudaMemPool_t``.
    keep : int
        Bytes of reserved memory to keep, at least.
    sync_device : int, optional
        Device ordinal to synchronize before trimming (the pool's device).
    """
    _check_handle(handle)
    _check_int("keep", keep, high=2**64 - 1)
    if sync_device is not None:
        _check_int("sync_device", sync_device)
    rt = _runtime()
    if sync_device is not None:
        previous = _call("reading the current device (cudaGetDevice)", rt.getDevice)
        try:
            _call(f"setting device {sync_device} (cudaSetDevice)", rt.setDevice, sync_device)
            _call(f"synchronizing device {sync_device} (cudaDeviceSynchronize)",
                  rt.deviceSynchronize)
        finally:
            rt.setDevice(previous)
    _call(f"trimming the memory pool to {keep} bytes (cudaMemPoolTrimTo)", rt.memPoolTrimTo,
          handle, keep)


def destroy(handle):
    """Destroy a pool made by ``resolve_pool_handle("create", ...)``.

    Memory still allocated from it is released by the driver once freed.

    Parameters
    ----------
    handle : int
        A ``cudaMemPool_t`` the caller owns.
    """
    _check_handle(handle)
    rt = _runtime()
    _call("destroying the memory pool (cudaMemPoolDestroy)", rt.memPoolDestroy, handle)


@functools.lru_cache(maxsize=None)
def _get_current_stream():
    try:
        import cupy
    except Exception as exc:
        raise RuntimeError(f"the current stream is CuPy's, and importing CuPy failed: {exc}") \
            from exc
    return cupy.cuda.get_current_stream


def current_stream_ptr(device=None):
    """The handle of CuPy's current stream (0 = the legacy default).

    Parameters
    ----------
    device : int, optional
        The device whose current stream to read (CuPy keeps one per device); default the
        current device.

    Returns
    -------
    int
    """
    if device is not None:
        _check_int("device", device)
    try:
        if device is None:
            return _get_current_stream()().ptr
        return _get_current_stream()(device).ptr
    except RuntimeError:
        raise
    except Exception as exc:
        raise RuntimeError(f"reading CuPy's current stream failed: {exc}") from exc
