"""Expandable segments through the driver's virtual memory (cuMemAddressReserve / cuMemCreate /
cuMemMap), what only the driver shows: released pages go back to the device, CuPy arrays over
many growth steps, busy streams, forgotten streams' ranges. Growing in place, data across page
boundaries and releasing pages under live neighbours are the upstream contract's
(tests/upstreams/test_contract.py)."""
import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.gpu_exclusive   # reads the device's free memory
def test_released_pages_go_back_to_the_device(cuda_pool, streams, cupy_device):
    cupy = cupy_device
    free_before, _ = cupy.cuda.runtime.memGetInfo()
    pool = cuda_pool(expandable_segments=True)
    s, _ = streams
    ptrs = [pool.alloc(n * MiB, stream=s) for n in (3, 5, 7, 11, 33, 9)]
    assert pool.stats()["segment.large_pool.current"] == 1
    free_grown, _ = cupy.cuda.runtime.memGetInfo()
    assert free_grown <= free_before - 68 * MiB, "the mapped pages are not device memory"
    for p in ptrs:
        pool.free(p, stream=s)
    pool.empty_cache()
    s.synchronize()
    assert pool.reserved_bytes() == 0
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after >= free_before - 64 * MiB, "unmapped pages were not given back"


def test_many_growth_steps_with_cupy_arrays(cuda_pool, cupy_device, held_cupy_arrays):
    """CuPy arrays on the pool (set_allocator) while the segment is mapped a page at a time."""
    cupy = cupy_device
    pool = cuda_pool(expandable_segments=True)
    with cupy.cuda.using_allocator(pool.malloc):
        arrays = [cupy.full(3 * MiB // 8 + i, i, dtype=cupy.int64) for i in range(80)]
        pool.check_invariants()
        for i, arr in enumerate(arrays):
            assert int((arr != i).sum()) == 0, f"array {i} was overwritten"
        total = cupy.concatenate(arrays).sum()  # one kernel reading every page
        assert int(total) == sum(i * (3 * MiB // 8 + i) for i in range(80))
        del arrays, arr, total
    cupy.cuda.get_current_stream().synchronize()
    pool.empty_cache()
    pool.check_invariants()
    assert pool.used_bytes() == 0, held_cupy_arrays()


def test_release_threshold_keeps_a_busy_streams_pages_and_never_syncs(cuda_pool, cupy_device):
    """Note [Threshold releases without a sync]: a host function holds the stream busy, so
    cuStreamQuery says it has work left; its pages stay until it drains."""
    import threading

    cupy = cupy_device
    pool = cuda_pool(expandable_segments=True, release_threshold=0)
    s = cupy.cuda.Stream(non_blocking=True)
    gate = threading.Event()
    try:
        s.launch_host_func(lambda _: gate.wait(30), None)   # s is busy until the gate opens
        ptr = pool.alloc(8 * MiB, stream=s)
        pool.free(ptr)
        assert pool.reserved_bytes() >= 8 * MiB            # its stream has work left
        assert s.done is False                             # and no sync waited for it
    finally:
        gate.set()
    s.synchronize()
    pool.set_release_threshold(0)                          # a check now finds s idle
    assert pool.reserved_bytes() == 0
    pool.check_invariants()


def test_forgotten_streams_give_their_ranges_back_to_the_driver(cuda_pool, cupy_device):
    """Note [Forgotten streams] on the driver: each stream's range (cuMemAddressReserve of the
    device's size) is unmapped and freed at forget_stream, before the stream is destroyed;
    a block kept past its stream's end stays usable on the legacy stream."""
    cupy = cupy_device
    pool = cuda_pool(expandable_segments=True, cross_stream_reuse=False)
    pool.free(pool.alloc(MiB, stream=0))
    base = pool.stats()
    kept = None
    for i in range(200):
        s = cupy.cuda.Stream(non_blocking=True)
        p = pool.alloc(MiB, stream=s.ptr)
        cupy.cuda.runtime.memsetAsync(p, i & 0xFF, MiB, s.ptr)
        if i == 100:
            kept = p
        else:
            pool.free(p)
        pool.forget_stream(s.ptr)
        del s
    st = pool.stats()
    assert st["num_streams"] == 1
    # The range that still holds `kept` stays (the legacy stream has its own: it goes once
    # nothing in it is mapped); every other stream's range went back.
    assert st["va_reserved_bytes.current"] == 2 * base["va_reserved_bytes.current"]
    host = cupy.empty(MiB, dtype=cupy.uint8)
    cupy.cuda.runtime.memcpy(host.data.ptr, kept, MiB, 3)   # device to device
    assert int(host[0]) == 100 and int(host[-1]) == 100
    pool.free(kept)
    pool.empty_cache()                      # nothing mapped in it now: the range goes
    assert pool.stats()["va_reserved_bytes.current"] == base["va_reserved_bytes.current"]
    pool.check_invariants()


def test_the_granularity_option_sets_the_page(cuda_pool, streams, kernels):
    """Pages of the driver's granularity (2 MiB on an H200) times a power of two, 8 MiB by
    default: one physical allocation each."""
    default = cuda_pool(expandable_segments=True)
    assert default.options["granularity"] == 8 * MiB
    two = cuda_pool(expandable_segments=True, granularity=2 * MiB)
    assert two.options["granularity"] == 2 * MiB
    with pytest.raises(ValueError, match="'granularity'.*power of two"):
        cuda_pool(expandable_segments=True, granularity=6 * MiB)
    page = 32 * MiB
    pool = cuda_pool(expandable_segments=True, granularity=page)
    s, _ = streams
    a = pool.alloc(MiB + 1, stream=s)
    b = pool.alloc(9 * page, stream=s)
    kernels.fill(b, 9 * page, 5, stream=s)
    assert kernels.count_bad(b, 9 * page, 5, s) == 0
    assert pool.reserved_bytes() % page == 0
    pool.free(a, stream=s)
    pool.free(b, stream=s)
    pool.empty_cache()
    pool.check_invariants()
    assert pool.reserved_bytes() == 0


@pytest.mark.gpu_exclusive   # reads the device's free memory
def test_a_growth_is_one_physical_allocation_released_whole(cuda_pool, cupy_device):
    """Note [Growth extents] on the driver: a growth of many pages is one cuMemCreate and one
    cuMemMap (the driver maps it whole), its bytes are usable end to end, a free page of an
    allocation that still holds a block stays mapped, and the whole allocation goes back to
    the device once free. max_map_size cuts a growth into allocations of that size."""
    cupy = cupy_device
    pool = cuda_pool(expandable_segments=True)
    page = pool.options["granularity"]
    a = pool.alloc(10 * page)                             # one map call, ten pages
    (seg,) = pool.layout()
    assert seg["maps"] == [(seg["address"], 10 * page)]
    assert pool.stats()["num_device_alloc"] == 1
    arr = cupy.ndarray((10 * page // 4,), cupy.int32,
                       cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(a, 10 * page, pool), 0))
    arr.fill(3)                                           # a kernel over every page
    assert int((arr != 3).sum()) == 0
    del arr
    cupy.cuda.Device(0).synchronize()
    # Free device memory while the ten pages are mapped, read after the kernel ran: loading
    # the kernel's module, and under compute-sanitizer its shadow memory, take device memory
    # too (22 MiB under memcheck on the H200), which a reading before the kernel would
    # blame on the pool.
    free_mapped, _ = cupy.cuda.runtime.memGetInfo()
    pool.free(a)
    b = pool.alloc(page)                                  # in a's allocation: it stays whole
    pool.empty_cache()
    assert pool.reserved_bytes() == 10 * page and pool.stats()["num_device_free"] == 0
    pool.free(b)
    pool.empty_cache()
    cupy.cuda.Device(0).synchronize()
    assert pool.reserved_bytes() == 0 and pool.stats()["num_device_free"] == 1
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after >= free_mapped + 8 * page, "the allocation was not given back"

    cut = cuda_pool(expandable_segments=True, max_map_size=4 * page)
    c = cut.alloc(10 * page)                              # 4 + 4 + 2 pages
    (seg,) = cut.layout()
    assert [n for _, n in seg["maps"]] == [4 * page, 4 * page, 2 * page]
    cut.free(c)
    cut.empty_cache()
    assert cut.reserved_bytes() == 0


def test_min_map_size_maps_a_growth_at_the_edge_in_one_allocation(cuda_pool, streams, kernels):
    """Note [Edge growth] on the driver: with min_map_size 64 MiB the first small request of
    a range maps 64 MiB as one physical allocation and the next requests take it without a
    growth; by default a growth maps only the page a request needs."""
    s, _ = streams
    pool = cuda_pool(expandable_segments=True, min_map_size=64 * MiB)
    assert pool.options["min_map_size"] == 64 * MiB
    ptrs = [pool.alloc(4 * MiB, stream=s) for _ in range(16)]
    (seg,) = pool.layout()
    assert [n for _, n in seg["maps"]] == [64 * MiB]
    assert pool.stats()["num_device_alloc"] == 1
    kernels.fill(ptrs[-1], 4 * MiB, 7, stream=s)
    assert kernels.count_bad(ptrs[-1], 4 * MiB, 7, s) == 0
    for p in ptrs:
        pool.free(p, stream=s)
    exact = cuda_pool(expandable_segments=True)
    assert exact.options["min_map_size"] is None
    q = exact.alloc(4 * MiB, stream=s)
    assert exact.reserved_bytes() == exact.options["granularity"]
    exact.free(q, stream=s)
    for p in (pool, exact):
        p.empty_cache()
        p.check_invariants()
        assert p.reserved_bytes() == 0
