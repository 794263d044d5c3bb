"""Expandable segments through the driver's virtual memory (cuMemAddressReserve / cuMemCreate /
cuMemMap): a segment grows page by page (2 MiB on an H200) and kernels read and write across
the page boundaries; releasing free pages leaves the live neighbours' data alone."""
import pytest

import mempool
from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

KiB, MiB = 1 << 10, 1 << 20
PAGE = 2 * MiB  # the H200's minimum granularity; only used to tell whether a block straddles


def _straddles(ptr, nbytes):
    return ptr // PAGE != (ptr + nbytes - 1) // PAGE


def _check_all(kernels, blocks, stream):
    for ptr, nbytes, seed in blocks:
        assert kernels.count_bad(ptr, nbytes, seed, stream) == 0, \
            f"block {ptr:#x} (+{nbytes}) lost its data"


def test_large_blocks_across_pages_of_one_grown_segment(cuda_pool, streams, kernels,
                                                        cupy_device):
    cupy = cupy_device
    free_before, _ = cupy.cuda.runtime.memGetInfo()
    pool = cuda_pool(expandable_segments=True)
    s, _ = streams
    sizes = [3 * MiB, 5 * MiB + 512, 7 * MiB - 4, 2 * MiB, 11 * MiB + 4 * KiB, 33 * MiB,
             MiB + 512, 9 * MiB]
    blocks = []
    for i, nbytes in enumerate(sizes):
        ptr = pool.alloc(nbytes, stream=s)
        kernels.fill(ptr, nbytes, seed=10 + i, stream=s)
        blocks.append((ptr, nbytes, 10 + i))
    pool.check_invariants()
    assert pool.stats()["segment.large_pool.current"] == 1, "the segment did not grow in place"
    assert any(_straddles(p, n) for p, n, _ in blocks)
    _check_all(kernels, blocks, s)

    # Free every other block and give their pages back: the neighbours sharing pages with
    # them must stay mapped and intact.
    for ptr, _, _ in blocks[1::2]:
        pool.free(ptr, stream=s)
    pool.empty_cache()
    s.synchronize()
    pool.check_invariants()
    kept = blocks[0::2]
    _check_all(kernels, kept, s)

    # Grow again, into released pages.
    for i, nbytes in enumerate(sizes[1::2]):
        ptr = pool.alloc(nbytes, stream=s)
        kernels.fill(ptr, nbytes, seed=50 + i, stream=s)
        kept.append((ptr, nbytes, 50 + i))
    _check_all(kernels, kept, s)
    pool.check_invariants()
    for ptr, _, _ in kept:
        pool.free(ptr, stream=s)
    pool.empty_cache()
    s.synchronize()
    pool.check_invariants()
    assert pool.reserved_bytes() == 0
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after >= free_before - 64 * MiB, "unmapped pages were not given back"


def test_small_blocks_grow_a_small_segment(cuda_pool, streams, kernels):
    pool = cuda_pool(expandable_segments=True)
    s, _ = streams
    blocks = []
    for i in range(48):  # ~9.6 MiB of 200 KiB blocks: several pages of one small segment
        nbytes = 200 * KiB + 4 * i
        ptr = pool.alloc(nbytes, stream=s)
        kernels.fill(ptr, nbytes, seed=i, stream=s)
        blocks.append((ptr, nbytes, i))
    assert pool.stats()["segment.small_pool.current"] == 1
    assert any(_straddles(p, n) for p, n, _ in blocks)
    _check_all(kernels, blocks, s)
    for ptr, _, _ in blocks:
        pool.free(ptr, stream=s)
    pool.check_invariants()


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


def test_expandable_limit_refuses_and_recovers(cuda_pool, streams, kernels):
    pool = cuda_pool(expandable_segments=True, limit=64 * MiB)
    s, _ = streams
    a = pool.alloc(40 * MiB, stream=s)
    with pytest.raises(mempool.OutOfMemoryError):
        pool.alloc(40 * MiB, stream=s)
    pool.check_invariants()
    kernels.fill(a, 40 * MiB, 9, stream=s)
    assert kernels.count_bad(a, 40 * MiB, 9, s) == 0
    pool.free(a, stream=s)
    b = pool.alloc(60 * MiB, stream=s)
    kernels.fill(b, 60 * MiB, 10, stream=s)
    assert kernels.count_bad(b, 60 * MiB, 10, s) == 0
    pool.free(b, stream=s)
    pool.check_invariants()


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
