"""The cudaMemPool behind backend="cuda": which pool, its release threshold and reuse
policies, trimming, sharing the default pool with CuPy, and the control plane's errors."""
import gc

import pytest

import mempool
from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _attrs(pool):
    """The Pool's cudaMemPool attributes, as its stats() report them."""
    prefix = "cuda_pool."
    return {k[len(prefix):]: v for k, v in pool.stats().items() if k.startswith(prefix)}


def test_segments_are_the_pools_used_memory(cuda_pool, streams):
    pool = cuda_pool(pool_handle="create")
    s, _ = streams
    assert _attrs(pool)["used_current"] == 0
    ptrs = [pool.alloc(n, stream=s) for n in (1000, 300_000, 3 * MiB, 64 * MiB)]
    # The driver's pool hands out exactly the segments the Pool reserved.
    assert _attrs(pool)["used_current"] == pool.reserved_bytes()
    for p in ptrs:
        pool.free(p, stream=s)
    pool.empty_cache()
    s.synchronize()
    assert _attrs(pool)["used_current"] == 0


def test_release_threshold_zero_gives_memory_back_at_sync(cuda_pool, streams):
    pool = cuda_pool(pool_handle="create", release_threshold=0)
    s, _ = streams
    assert _attrs(pool)["release_threshold"] == 0
    ptr = pool.alloc(64 * MiB, stream=s)
    attrs = _attrs(pool)
    assert attrs["used_current"] >= 64 * MiB and attrs["reserved_current"] >= 64 * MiB
    pool.free(ptr, stream=s)  # nothing may stay cached: the segment goes back at once
    s.synchronize()           # and the driver releases it at the sync
    attrs = _attrs(pool)
    assert pool.reserved_bytes() == 0
    assert attrs["used_current"] == 0
    assert attrs["reserved_current"] == 0
    assert attrs["reserved_high"] >= 64 * MiB


def test_release_threshold_keeps_memory_until_emptied(cuda_pool, streams):
    keep = 256 * MiB
    pool = cuda_pool(pool_handle="create", release_threshold=keep)
    s, _ = streams
    assert _attrs(pool)["release_threshold"] == keep  # the driver honours it too
    ptr = pool.alloc(64 * MiB, stream=s)
    pool.free(ptr, stream=s)
    s.synchronize()
    assert pool.cached_bytes() >= 64 * MiB  # under the threshold: the Pool keeps it
    assert _attrs(pool)["reserved_current"] >= 64 * MiB
    pool.empty_cache()  # gives the segments back and trims the cudaMemPool
    s.synchronize()
    assert pool.reserved_bytes() == 0
    attrs = _attrs(pool)
    assert attrs["used_current"] == 0
    assert attrs["reserved_current"] == 0, "empty_cache left the memory in the cudaMemPool"


def test_empty_cache_waits_for_the_device_only_after_freeing_a_segment(cuda_pool, streams):
    """Note [Giving back to the device]: empty_cache gives the cudaMemPool's memory back at
    once (no sync of the caller's is needed), with one device sync counted as PyTorch counts
    its own; a call that freed nothing since the last one waits for nothing."""
    keep = 256 * MiB
    pool = cuda_pool(pool_handle="create", release_threshold=keep)
    s, _ = streams
    pool.free(pool.alloc(64 * MiB, stream=s), stream=s)
    syncs = pool.stats()["num_sync_all_streams"]
    pool.empty_cache()
    assert _attrs(pool)["reserved_current"] == 0, "the cudaMemPool kept what the pool freed"
    assert pool.stats()["num_sync_all_streams"] == syncs + 1
    pool.empty_cache()       # nothing freed since: no sync
    pool.trim(0)
    assert pool.stats()["num_sync_all_streams"] == syncs + 1
    pool.free(pool.alloc(64 * MiB, stream=s), stream=s)
    pool.trim(0)             # trim gives back as empty_cache does
    assert _attrs(pool)["reserved_current"] == 0
    assert pool.stats()["num_sync_all_streams"] == syncs + 2


def test_a_created_cudamempool_keeps_nothing_the_pool_gives_back(cuda_pool, streams):
    """Note [The driver keeps nothing given back]: the cudaMemPool a Pool creates has a
    release threshold of 0, and after the Pool gives a segment back (cuMemFreeAsync, no
    trim) the device holds what the Pool reserves once a sync has passed."""
    s, _ = streams
    pool = cuda_pool()
    assert _attrs(pool)["release_threshold"] == 0
    ptr = pool.alloc(64 * MiB, stream=s)
    pool.free(ptr, stream=s)
    pool.set_limit(100 * MiB)
    ptr = pool.alloc(96 * MiB, stream=s)   # gives the idle 64 MiB back, then grows
    assert pool.stats()["num_device_free"] == 1
    s.synchronize()
    assert _attrs(pool)["reserved_current"] == pool.reserved_bytes() == 96 * MiB
    pool.free(ptr, stream=s)


def test_a_shared_cudamempool_keeps_its_owners_threshold(cupy_device):
    h, owned = _cuda.resolve_pool_handle("create", 0)
    try:
        _cuda.configure(h, release_threshold=_cuda.KEEP_ALL)
        pool = mempool.Pool(backend="cuda", device=0, pool_handle=h)
        kept = _attrs(pool)["release_threshold"]
        given = mempool.Pool(backend="cuda", device=0, pool_handle=h,
                             release_threshold=123 * MiB)
        set_by_option = _attrs(given)["release_threshold"]
        del pool, given
        gc.collect()
        assert kept == _cuda.KEEP_ALL
        assert set_by_option == 123 * MiB
    finally:
        _cuda.destroy(h)


def test_trim_to_releases_only_unused_memory(cupy_device, streams, kernels):
    """On a bare cudaMemPool that keeps everything, trim releases what nobody holds, and with
    sync_device also what was freed in stream order but not yet seen complete."""
    cupy = cupy_device
    rt = cupy.cuda.runtime
    h, owned = _cuda.resolve_pool_handle("create", 0)
    assert owned
    try:
        _cuda.configure(h, release_threshold=_cuda.KEEP_ALL)
        s, _ = streams
        held = rt.mallocFromPoolAsync(32 * MiB, h, s.ptr)
        freed = rt.mallocFromPoolAsync(64 * MiB, h, s.ptr)
        rt.freeAsync(freed, s.ptr)
        s.synchronize()
        before = _cuda.attributes(h)["reserved_current"]
        assert before >= 96 * MiB  # KEEP_ALL kept the freed 64 MiB
        _cuda.trim_to(h, 0)
        attrs = _cuda.attributes(h)
        assert 32 * MiB <= attrs["reserved_current"] < before
        assert attrs["used_current"] >= 32 * MiB
        # A free still queued behind a busy stream: sync_device waits for it first.
        kernels.spin_copy(held, held, 4, 50, s)
        rt.freeAsync(held, s.ptr)
        _cuda.trim_to(h, 0, sync_device=0)
        assert _cuda.attributes(h)["reserved_current"] == 0
    finally:
        _cuda.destroy(h)


def test_reuse_policies_reach_the_cuda_pool(cuda_pool):
    names = ("reuse_follow_event_dependencies", "reuse_allow_opportunistic",
             "reuse_allow_internal_dependencies")
    off = cuda_pool(pool_handle="create", **{n: False for n in names})
    on = cuda_pool(pool_handle="create", **{n: True for n in names})
    off_attrs, on_attrs = _attrs(off), _attrs(on)
    for n in names:
        assert off_attrs[n] is False, n
        assert on_attrs[n] is True, n


def test_default_pool_is_shared_with_cupy_memory_async_pool(streams, kernels, cupy_device):
    cupy = cupy_device
    default = cupy.cuda.runtime.deviceGetDefaultMemPool(0)
    pool = mempool.Pool(backend="cuda", device=0, pool_handle="default")
    assert _attrs(pool) == _cuda.attributes(default)
    cupy_async = cupy.cuda.MemoryAsyncPool(pool_handles="default")
    s, _ = streams
    base = _cuda.attributes(default)["used_current"]
    with s:
        theirs = cupy_async.malloc(32 * MiB)
    ours = pool.alloc(32 * MiB, stream=s)
    assert _cuda.attributes(default)["used_current"] >= base + 64 * MiB  # one pool, both users
    assert _attrs(pool) == _cuda.attributes(default)
    kernels.fill(theirs.ptr, 32 * MiB, 1, stream=s)
    kernels.fill(ours, 32 * MiB, 2, stream=s)
    assert kernels.count_bad(theirs.ptr, 32 * MiB, 1, s) == 0
    assert kernels.count_bad(ours, 32 * MiB, 2, s) == 0
    pool.free(ours, stream=s)
    pool.empty_cache()
    pool.check_invariants()
    with s:
        del theirs
    s.synchronize()
    # Dropping the Pool leaves the shared pool alive for CuPy.
    del pool
    gc.collect()
    with s:
        again = cupy_async.malloc(MiB)
        assert _cuda.attributes(default)["used_current"] >= MiB
        del again
    s.synchronize()


def test_current_pool(cuda_pool, cupy_device):
    current = cupy_device.cuda.runtime.deviceGetMemPool(0)
    pool = cuda_pool(pool_handle="current")
    base = _cuda.attributes(current)["used_current"]
    ptr = pool.alloc(MiB, stream=0)
    assert _cuda.attributes(current)["used_current"] >= base + MiB
    assert _attrs(pool) == _cuda.attributes(current)
    pool.free(ptr, stream=0)


def test_external_handle_is_not_destroyed_with_the_pool(cupy_device):
    h, owned = _cuda.resolve_pool_handle("create", 0)
    try:
        pool = mempool.Pool(backend="cuda", device=0, pool_handle=h)
        ptr = pool.alloc(4 * MiB, stream=0)
        assert _cuda.attributes(h)["used_current"] >= 4 * MiB
        assert _attrs(pool) == _cuda.attributes(h)
        pool.free(ptr, stream=0)
        pool.empty_cache()
        pool.check_invariants()
        cupy_device.cuda.Stream.null.synchronize()
        del pool
        gc.collect()
        assert _cuda.attributes(h)["used_current"] == 0  # still a live pool
    finally:
        _cuda.destroy(h)


def test_pool_rejects_a_bad_pool_handle(cupy_device):
    with pytest.raises(ValueError, match="pool_handle"):
        mempool.Pool(backend="cuda", pool_handle="bogus")


def test_control_plane_round_trip(cupy_device):
    h, owned = _cuda.resolve_pool_handle("create", 0)
    assert owned and h
    try:
        attrs = _cuda.attributes(h)
        assert {"reserved_current", "reserved_high", "used_current", "used_high"} <= set(attrs)
        assert attrs["reserved_current"] == attrs["used_current"] == 0
        _cuda.configure(h, release_threshold=123 * MiB, reuse_allow_opportunistic=False)
        attrs = _cuda.attributes(h)
        assert attrs["release_threshold"] == 123 * MiB
        assert attrs["reuse_allow_opportunistic"] is False
        assert attrs["reuse_follow_event_dependencies"] is True  # untouched
        # Bad input is refused before anything changes.
        with pytest.raises(TypeError, match="reuse_allow_internal_dependencies"):
            _cuda.configure(h, release_threshold=0, reuse_allow_internal_dependencies="yes")
        assert _cuda.attributes(h)["release_threshold"] == 123 * MiB
        with pytest.raises(ValueError, match="release_threshold"):
            _cuda.configure(h, release_threshold=-1)
        _cuda.reset_peaks(h)
        assert _cuda.attributes(h)["reserved_high"] == 0
        _cuda.trim_to(h, 0)
    finally:
        _cuda.destroy(h)


def test_control_plane_names_the_bad_argument(cupy_device):
    count = _cuda.device_count()
    with pytest.raises(ValueError, match="device"):
        _cuda.resolve_pool_handle("create", count)
    with pytest.raises(ValueError, match="pool_handle"):
        _cuda.resolve_pool_handle("shared", 0)
    with pytest.raises(TypeError, match="pool_handle"):
        _cuda.resolve_pool_handle(None, 0)
    with pytest.raises(ValueError, match="handle"):
        _cuda.attributes(0)


def test_current_stream_ptr_follows_cupy(streams, cupy_device):
    cupy = cupy_device
    s, _ = streams
    assert _cuda.current_stream_ptr() == cupy.cuda.get_current_stream().ptr
    with s:
        assert _cuda.current_stream_ptr() == s.ptr
    with cupy.cuda.Stream.ptds:
        assert _cuda.current_stream_ptr() == 2


def test_rounded_segments_are_what_the_cudamempool_hands_out(cuda_pool, streams):
    """Note [Segment rounding] on the device: a small pool's first segments are plain ones,
    which the cudaMemPool packs into one chunk; past three units a 12 MiB request grows one
    32 MiB segment, which is what the cudaMemPool hands out, and a second request is served
    from its tail without another upstream call."""
    s, _ = streams
    pool = cuda_pool(pool_handle="create", segment_rounding="32MiB")
    small = pool.alloc(12 * MiB, stream=s)         # a large request: 12 MiB, rounded to 2 MiB
    assert pool.reserved_bytes() == 12 * MiB        # a plain segment, as PyTorch's
    assert _attrs(pool)["reserved_current"] == 32 * MiB   # one chunk of the driver's
    pool.free(small, stream=s)
    pool.empty_cache()
    first = pool.alloc(3 * 32 * MiB, stream=s)      # past the small start
    a = pool.alloc(12 * MiB, stream=s)
    b = pool.alloc(12 * MiB, stream=s)
    assert b == a + 12 * MiB
    assert pool.reserved_bytes() == 4 * 32 * MiB
    assert _attrs(pool)["used_current"] == 4 * 32 * MiB
    for p in (a, b, first):
        pool.free(p, stream=s)


def test_a_default_pool_reserves_what_the_device_holds_for_it(cuda_pool, streams):
    """Note [The cudaMemPool's unit]: by default, once the pool is past its small start,
    every segment is whole units of the cudaMemPool's chunk, measured from the driver, the
    small ones one unit, so the device
    holds no more for them than the pool reserves (a plain 20 MiB segment would hold a
    whole chunk, and a 2 MiB small one would set the large ones after it off the chunk
    boundaries)."""
    s, _ = streams
    unit = _cuda.allocation_unit(0)
    assert unit > 2 * MiB and unit % (2 * MiB) == 0, unit
    pool = cuda_pool(pool_handle="create")
    assert pool.options["segment_rounding"] == unit
    # Past the small start (three units of plain segments) every segment is whole units.
    ptrs = [pool.alloc(3 * unit, stream=s)]
    ptrs += [pool.alloc(n, stream=s) for n in (512, 5 * MiB, 12 * MiB, unit + MiB, 4096)]
    layout = pool.layout()
    assert all(seg["total_size"] % unit == 0 for seg in layout), layout
    assert [seg["total_size"] for seg in layout if seg["is_small"]] == [unit]
    attrs = _attrs(pool)
    assert attrs["reserved_current"] == attrs["used_current"] == pool.reserved_bytes()
    for p in ptrs:
        pool.free(p, stream=s)
    expandable = cuda_pool(expandable_segments=True)
    assert expandable.options["segment_rounding"] is None
    plain = cuda_pool(segment_rounding="2MiB")
    plain.free(plain.alloc(12 * MiB, stream=s), stream=s)
    assert plain.reserved_bytes() == 12 * MiB


def test_the_driver_holds_a_free_queued_behind_work_and_a_new_segment_at_once(
        cupy_device, streams, kernels):
    """The premise of Note [Released before a growth], on a bare cudaMemPool that gives
    memory back at every sync (threshold 0): a free queued behind work still running is the
    driver's, and a larger allocation made meanwhile on the same stream gets new memory.
    (Passed on an H100 with a 200 ms kernel, an earlier run (bench/results/ in git history).)"""
    rt = cupy_device.cuda.runtime
    h, _ = _cuda.resolve_pool_handle("create", 0)
    try:
        _cuda.configure(h, release_threshold=0)
        s, _ = streams
        held = rt.mallocFromPoolAsync(32 * MiB, h, s.ptr)
        freed = rt.mallocFromPoolAsync(64 * MiB, h, s.ptr)
        kernels.spin_copy(held, held, 4, 1000, s)   # s busy for a second: past every call below
        rt.freeAsync(freed, s.ptr)
        big = rt.mallocFromPoolAsync(160 * MiB, h, s.ptr)
        attrs = _cuda.attributes(h)
        assert attrs["reserved_high"] >= (32 + 64 + 160) * MiB, attrs
        rt.freeAsync(big, s.ptr)
        rt.freeAsync(held, s.ptr)
        s.synchronize()
    finally:
        _cuda.destroy(h)


@pytest.mark.parametrize("busy", [True, False], ids=["busy stream", "idle stream"])
def test_a_growth_that_releases_leaves_the_device_holding_what_the_pool_counts(
        cuda_pool, streams, kernels, cupy_device, busy):
    """Note [Released before a growth]: idle segments released for a growth while their stream
    still runs work are freed and that stream synchronized before the new segment is made,
    so the cudaMemPool's high mark stays the Pool's own peak (without the sync the device held
    the released 160 MiB and the new segment at once, as the test above shows). An idle
    stream is only asked: its frees have run, and the driver reuses their memory. (The busy
    case passed on an H100 at a193f42, which synchronized either way; the idle case is new.)"""
    s, _ = streams
    pool = cuda_pool(pool_handle="create", segment_rounding="32MiB")
    ptrs = [pool.alloc(n * MiB, stream=s) for n in (64, 96, 128)]
    for p in ptrs:
        pool.free(p, stream=s)
    assert pool.reserved_bytes() == 288 * MiB
    if busy:
        flag = cupy_device.zeros(1, dtype=cupy_device.uint32)   # memory outside the pool
        kernels.spin_copy(flag.data.ptr, flag.data.ptr, 4, 1000, s)  # s busy for a second
    else:
        s.synchronize()
    syncs = pool.stats()["num_stream_syncs"]
    big = pool.alloc(160 * MiB, stream=s)                # 64 + 96 released, oldest first
    stats = pool.stats()
    assert stats["num_device_free"] == 2 and pool.reserved_bytes() == 288 * MiB
    assert stats["num_stream_syncs"] == syncs + (1 if busy else 0)
    assert stats["reserved_bytes.all.peak"] == 288 * MiB
    attrs = _attrs(pool)
    assert attrs["reserved_high"] == 288 * MiB, attrs
    assert attrs["reserved_current"] == attrs["used_current"] == 288 * MiB
    pool.free(big, stream=s)
