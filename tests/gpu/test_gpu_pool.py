"""Pool(backend="cuda") on a real device, what only a GPU shows: the stream forms CuPy and the
driver accept, threads with no current context, CuPy's current stream. Sizes, alignment,
data integrity and the stats are the upstream contract's (tests/upstreams/test_contract.py)."""
import gc
import random
import threading

import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

KiB, MiB = 1 << 10, 1 << 20
SIZES = [4, 511, 512, 513, 4 * KiB, 100 * KiB, MiB - 1, MiB, MiB + 1, 3 * MiB, 10 * MiB - 4,
         10 * MiB, 10 * MiB + 4, 64 * MiB, 257 * MiB]


def _stream_forms(cupy, s):
    """(what the pool is given, the CuPy stream that orders the same work)."""
    return {
        "cupy-stream": (s, s),
        "int": (s.ptr, s),
        "null-0": (0, cupy.cuda.Stream.null),
        "legacy-1": (1, cupy.cuda.Stream.null),
        "per-thread-2": (2, cupy.cuda.Stream.ptds),
    }


@pytest.mark.parametrize("form", ["cupy-stream", "int", "null-0", "legacy-1", "per-thread-2"])
def test_stream_forms(cuda_pool, streams, kernels, cupy_device, form):
    pool = cuda_pool()
    given, cupy_stream = _stream_forms(cupy_device, streams[0])[form]
    ptrs = []
    for i, nbytes in enumerate([4 * KiB, 2 * MiB, 24 * MiB]):
        ptr = pool.alloc(nbytes, stream=given)
        kernels.fill(ptr, nbytes, seed=100 + i, stream=cupy_stream)
        ptrs.append((ptr, nbytes, 100 + i))
    for ptr, nbytes, seed in ptrs:
        assert kernels.count_bad(ptr, nbytes, seed, cupy_stream) == 0
        pool.free(ptr, stream=given)
    pool.check_invariants()
    # Freed on that stream, a block serves the next request there at once.
    again = pool.alloc(2 * MiB, stream=given)
    kernels.fill(again, 2 * MiB, seed=7, stream=cupy_stream)
    assert kernels.count_bad(again, 2 * MiB, 7, cupy_stream) == 0
    pool.free(again, stream=given)
    cupy_stream.synchronize()
    pool.empty_cache()
    pool.check_invariants()


def test_threads_without_a_current_context(cuda_pool, kernels, cupy_device):
    """Fresh threads have no CUDA context current: the upstream must make the device's
    primary context current itself, and the pool must stay consistent under contention."""
    cupy = cupy_device
    pool = cuda_pool()
    errors = []

    def work(seed):
        try:
            rng = random.Random(seed)
            with cupy.cuda.Device(0):
                s = cupy.cuda.Stream(non_blocking=True)
                for i in range(60):
                    nbytes = rng.randrange(4, 3 * MiB)
                    ptr = pool.alloc(nbytes, stream=s)
                    kernels.fill(ptr, nbytes, seed=seed * 1000 + i, stream=s)
                    if kernels.count_bad(ptr, nbytes, seed * 1000 + i, s):
                        errors.append(f"thread {seed}: block {i} damaged")
                    pool.free(ptr, stream=s)
                s.synchronize()
        except Exception as exc:  # reported below, in the main thread
            errors.append(f"thread {seed}: {exc!r}")

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    pool.check_invariants()
    assert pool.used_bytes() == 0
    # The threads are gone and so are their references to their streams; the pool caches
    # segments freed on them, so it keeps those streams alive (Note [Pinned streams]) and
    # releasing the segments calls the driver with live handles only.
    assert len(pool.pinned_streams) == 4
    del threads
    gc.collect()
    pool.empty_cache()
    pool.check_invariants()
    assert pool.reserved_bytes() == 0


def test_alloc_from_a_thread_that_never_touched_cuda(cuda_pool, cupy_device, kernels):
    """Only the pool's own calls run on the thread: nothing else made a context current."""
    pool = cuda_pool()
    out = {}

    def work():
        try:
            ptr = pool.alloc(MiB, stream=0)
            pool.free(ptr, stream=0)
            out["ptr"] = ptr
        except Exception as exc:
            out["error"] = exc

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert "error" not in out, out.get("error")
    assert out["ptr"] % 512 == 0
    pool.check_invariants()


def test_a_dropped_cupy_stream_stays_valid_for_cross_stream_reuse(cuda_pool, cupy_device,
                                                                   kernels):
    """A block cached on a stream the user has dropped is taken by another stream: the pool
    records an event on the dropped stream's handle, which must still be a live stream."""
    cupy = cupy_device
    pool = cuda_pool()
    first = cupy.cuda.Stream(non_blocking=True)
    ptr = pool.alloc(8 * MiB, stream=first)
    kernels.fill(ptr, 8 * MiB, seed=3, stream=first)
    pool.free(ptr, stream=first)
    handle = first.ptr
    del first
    gc.collect()
    assert handle in pool.pinned_streams
    other = cupy.cuda.Stream(non_blocking=True)
    again = pool.alloc(8 * MiB, stream=other)         # the only fit: the dropped stream's block
    assert again == ptr and pool.stats()["num_cross_stream_reuse"] == 1
    kernels.fill(again, 8 * MiB, seed=4, stream=other)
    assert kernels.count_bad(again, 8 * MiB, 4, other) == 0
    pool.free(again, stream=other)
    other.synchronize()
    pool.forget_stream(handle)
    assert handle not in pool.pinned_streams
    pool.empty_cache()
    pool.check_invariants()


def test_stream_none_follows_cupys_current_stream(cuda_pool, cupy_device):
    """Note [Current stream]: with CuPy's C layer read to tell an unchanged stream, every
    switch of CuPy's current stream still reaches the pool."""
    cupy = cupy_device
    pool = cuda_pool()
    lookup = pool._current_stream_lookup
    import cupy_backends.cuda.stream as backend
    exported = "get_stream_ptr" in getattr(backend, "__pyx_capi__", {})
    assert lookup.fast == exported      # CuPy 14.2 exports the reader; it must agree and be used
    first, second = (cupy.cuda.Stream(non_blocking=True) for _ in range(2))
    seen = []
    for stream in (first, first, second, cupy.cuda.Stream.null, second, cupy.cuda.Stream.ptds):
        with stream:
            ptr = pool.alloc(4096)
            seen.append((pool.block_info(ptr)[2], stream.ptr))
            pool.free(ptr)
    assert all(got == want for got, want in seen), seen
    assert first.ptr in pool.pinned_streams and second.ptr in pool.pinned_streams
    before = lookup.slow_lookups
    with first:
        for _ in range(100):
            pool.free(pool.alloc(512))
    python_lookups = lookup.slow_lookups - before
    if lookup.fast:
        assert python_lookups <= 1      # the stream did not change: CuPy's C layer says so
    else:
        assert python_lookups == 100
    first.synchronize()
    second.synchronize()


def test_events_are_made_while_other_threads_launch_kernels(cuda_pool, kernels, cupy_device):
    """Note [Events outside the lock]: in a fresh pool, cross-stream reuse finds the event
    cache empty, and so does a free that waits on two streams; each makes its events while
    other threads launch kernels without the GIL. Under compute-sanitizer, whose launch
    callback takes the GIL, an event made with the GIL and the pool lock held deadlocked
    against such a launch."""
    cupy = cupy_device
    stop = threading.Event()
    errors = []

    def launch():
        try:
            with cupy.cuda.Device(0):
                s = cupy.cuda.Stream(non_blocking=True)
                with s:
                    x = cupy.zeros(1 << 20, dtype=cupy.float32)
                    while not stop.is_set():
                        x += 1
                s.synchronize()
        except Exception as exc:  # reported below, in the main thread
            errors.append(repr(exc))

    launchers = [threading.Thread(target=launch) for _ in range(3)]
    for t in launchers:
        t.start()
    try:
        s1, s2, s3 = (cupy.cuda.Stream(non_blocking=True) for _ in range(3))
        for round_ in range(10):
            pool = cuda_pool()
            a = pool.alloc(4 * MiB, stream=s1)
            kernels.fill(a, 4 * MiB, seed=round_, stream=s1)
            pool.free(a)
            b = pool.alloc(4 * MiB, stream=s2)             # s1's block, after an event
            assert b == a and pool.stats()["num_cross_stream_reuse"] == 1
            kernels.fill(b, 4 * MiB, seed=round_ + 100, stream=s2)
            pool.record_stream(b, s3)
            pool.free(b, stream=s1)                        # waits on s2 and s3: two events
            c = pool.alloc(MiB, stream=s3)
            kernels.fill(c, MiB, seed=round_ + 200, stream=s3)
            assert kernels.count_bad(c, MiB, round_ + 200, s3) == 0
            pool.free(c)
            for s in (s1, s2, s3):
                s.synchronize()
            pool.empty_cache()                             # segments of several owners
            pool.check_invariants()
            assert pool.reserved_bytes() == 0
    finally:
        stop.set()
        for t in launchers:
            t.join(30)
    assert not any(t.is_alive() for t in launchers)
    assert errors == []
