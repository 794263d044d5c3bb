"""CUDA graph capture through the CuPy hook (docs/architecture.md, Note [Graph capture]).

``cupy.cuda.set_allocator(pool.malloc)``, then ``s.begin_capture()``, CuPy operations,
``g = s.end_capture()``, ``g.launch()``: with a cold pool every segment the captured work
needs is allocated during the capture, which must give it memory outside the graph
(cuMemAlloc, Note [Capture segments] in mp_cuda.c) and make no call that breaks the capture
(the driver fails ``end_capture`` then). Each test runs in CUDA's relaxed capture mode
(CuPy's default) and in the global mode, where the driver refuses every unsafe call."""
import gc

import numpy as np
import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

MODES = {"global": 0, "relaxed": 2}   # cudaStreamCaptureMode values
MiB = 1 << 20
N = 6 * MiB   # float32 elements: 24 MiB arrays, so large segments are needed too

OPTIONS = [
    {},
    {"release_threshold": 0},
    {"expandable_segments": True},
    {"expandable_segments": True, "release_threshold": 0},
]


def _work(cupy, x):
    """Temporaries of several sizes, freed as the expression goes: small and large blocks
    allocated and freed during the capture, one result kept."""
    y = cupy.sin(x) * 2.0 + 1.0
    small = cupy.arange(1000, dtype=cupy.float32) + x[:1000]
    return y + small.sum() - cupy.cos(x[::2]).repeat(2)


def _expected(x):
    y = np.sin(x) * 2.0 + 1.0
    small = np.arange(1000, dtype=np.float32) + x[:1000]
    return y + small.sum() - np.cos(x[::2]).repeat(2)


@pytest.mark.parametrize("mode", ["relaxed", "global"])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(o) or "default")
def test_cupy_capture_on_a_cold_pool_replays_correctly(cuda_pool, cupy_device, options, mode):
    cupy = cupy_device
    pool = cuda_pool(**options)
    s = cupy.cuda.Stream(non_blocking=True)
    rng = np.random.default_rng(7)
    host = [rng.standard_normal(N, dtype=np.float32) for _ in range(2)]
    with s:
        x = cupy.asarray(host[0])          # CuPy's own memory: the pool stays cold
        _work(cupy, x)                     # compile the kernels outside the capture
        s.synchronize()
        assert pool.reserved_bytes() == 0
        with cupy.cuda.using_allocator(pool.malloc):
            s.begin_capture(mode=MODES[mode])
            out = _work(cupy, x)
            g = s.end_capture()            # raises when a call broke the capture
        assert pool.stats()["num_device_alloc"] > 0       # segments made during the capture
        assert pool.used_bytes() >= out.nbytes
        for h in host:                     # replay on new inputs: the graph recomputes
            x.set(h, stream=s)
            g.launch(stream=s)
            s.synchronize()
            np.testing.assert_allclose(cupy.asnumpy(out, stream=s), _expected(h),
                                       rtol=1e-5, atol=1e-4)
    reserved = pool.reserved_bytes()
    del g, out
    gc.collect()
    pool.check_invariants()
    pool.empty_cache()                     # segments made in the capture go back (cuMemFree)
    assert pool.used_bytes() == 0
    assert pool.reserved_bytes() < reserved
    assert pool.reserved_bytes() == 0


@pytest.mark.parametrize("retention", [False, True], ids=["plain", "empty_cache-trim-inside"])
@pytest.mark.parametrize("mode", ["relaxed", "global"])
def test_capture_after_warm_up_needs_no_segment(cuda_pool, cupy_device, mode, retention):
    """The usual pattern: one eager run fills the pool's free lists, and the capture is
    served from them: no segment is allocated while capturing. With ``empty_cache()`` and
    ``trim()`` called inside the capture, the core releases nothing (Note [Graph capture])
    and the cudaMemPool's trim, which synchronizes the device first, waits for a later call:
    the capture ends and replays all the same."""
    cupy = cupy_device
    pool = cuda_pool()
    s = cupy.cuda.Stream(non_blocking=True)
    h = np.random.default_rng(3).standard_normal(N, dtype=np.float32)
    with s, cupy.cuda.using_allocator(pool.malloc):
        x = cupy.asarray(h)
        _work(cupy, x)                     # warm-up through the pool
        s.synchronize()
        segments = pool.stats()["num_device_alloc"]
        s.begin_capture(mode=MODES[mode])
        out = _work(cupy, x)
        if retention:
            pool.empty_cache()
            pool.trim()
        g = s.end_capture()                # raises when a call broke the capture
        assert pool.stats()["num_device_alloc"] == segments
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_allclose(cupy.asnumpy(out, stream=s), _expected(h),
                                   rtol=1e-5, atol=1e-4)
        del g, out, x
    gc.collect()
    pool.check_invariants()
    pool.empty_cache()                     # no capture now: everything goes back
    assert pool.reserved_bytes() == 0
    assert pool.stats()["cuda_pool.reserved_current"] == 0



@pytest.mark.parametrize("mode", ["relaxed", "global"])
def test_stats_read_by_another_thread_during_a_capture(cuda_pool, cupy_device, mode):
    """A metrics thread (mempool.prometheus) reads ``pool.stats()``, the cudaMemPool's
    attributes included, while another thread captures: every read succeeds and the capture
    ends and replays right (Note [Set-up during a capture])."""
    import threading
    cupy = cupy_device
    pool = cuda_pool()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        x = cupy.arange(1 << 20, dtype=cupy.float32)   # CuPy's memory, made before
        y = cupy.empty_like(x)
        cupy.multiply(x, 2, out=y)                      # compiled outside the capture
        s.synchronize()
        reads = []

        def scrape():
            for _ in range(20):
                reads.append(pool.stats()["cuda_pool.reserved_current"])

        s.begin_capture(mode=MODES[mode])
        cupy.multiply(x, 3, out=y)
        t = threading.Thread(target=scrape)
        t.start()
        t.join()
        g = s.end_capture()                # raises when a call broke the capture
        x += 1
        g.launch(stream=s)
        s.synchronize()
        assert bool((y == x * 3).all())
    assert reads == [0] * 20

# A fresh process, so that the Pool below is the first to measure the cudaMemPool's unit
# (mempool/_cuda.py allocation_unit, once per device and process).
_POOL_DURING_CAPTURE = """
import json, sys, threading
import cupy
import mempool
from mempool import _cuda

mode, where = int(sys.argv[1]), sys.argv[2]
assert 0 not in _cuda._units, "the unit was measured before the capture"
s = cupy.cuda.Stream(non_blocking=True)
with s:
    x = cupy.arange(1 << 20, dtype=cupy.float32)
    y = cupy.empty_like(x)
    cupy.multiply(x, 2, out=y)                # compiled outside the capture
    s.synchronize()
    s.begin_capture(mode=mode)
    cupy.multiply(x, 3, out=y)                # no allocation in the captured work
    made = {}
    def make():
        made["pool"] = mempool.Pool(backend="cuda")
    if where == "thread":
        t = threading.Thread(target=make)
        t.start()
        t.join()
    else:
        make()
    g = s.end_capture()                       # raises when a call broke the capture
    x += 1
    g.launch(stream=s)
    s.synchronize()
    ok = bool((y == (x * 3)).all())
pool = made["pool"]
ptr = pool.alloc(1 << 20)
pool.free(ptr)
print(json.dumps({"graph_ok": ok, "rounding": pool.options["segment_rounding"],
                  "unit": _cuda._units.get(0)}))
"""


@pytest.mark.parametrize("where", ["same thread", "thread"])
@pytest.mark.parametrize("mode", ["relaxed", "global"])
def test_a_pool_made_during_a_capture_measures_the_unit_and_breaks_nothing(mode, where):
    """The first cuda Pool of a process measures the cudaMemPool's unit with a probe
    allocation (a pool and a stream of its own). Made while a stream captures, on the
    capturing thread or another, in the global mode too, the probe must not break the
    capture: the graph replays right, and the Pool rounds to the unit it measured."""
    import json
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _POOL_DURING_CAPTURE, str(MODES[mode]),
                          where.split()[0]], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["graph_ok"]
    assert isinstance(result["unit"], int) and result["unit"] > 0
    assert result["rounding"] == _cuda.segment_rounding_for(result["unit"])


@pytest.mark.parametrize("mode", ["relaxed", "global"])
@pytest.mark.parametrize("reuse", [False, True], ids=["default", "record_stream_reuse"])
def test_a_recorded_block_is_reused_once_the_capture_joins_its_streams(cuda_pool, cupy_device,
                                                                       mode, reuse):
    """Note [Capture reuse] on the driver: s1 captures, s2 joins it and reads block a
    (record_stream), s1 frees a. Before s1 waits for s2 the block is not taken; after, with
    graph_capture_record_stream_reuse, the next request on s1 gets it, and the graph orders
    s2's read before the new owner's write, so each replay computes the same result."""
    cupy = cupy_device
    pool = cuda_pool(graph_capture_record_stream_reuse=reuse)
    s1 = cupy.cuda.Stream(non_blocking=True)
    s2 = cupy.cuda.Stream(non_blocking=True)
    n = 1 << 16
    nbytes = 4 * n

    def view(ptr):
        mem = cupy.cuda.UnownedMemory(ptr, nbytes, pool)
        return cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0))

    def triple(src, dst):                  # in place: no temporary to allocate
        cupy.multiply(view(src), 3.0, out=view(dst))

    def bump(dst):
        cupy.add(view(dst), 1.0, out=view(dst))

    out = pool.alloc(nbytes, stream=s1.ptr)
    with s1:                               # compile the kernels before the capture
        view(out).fill(0.0)
        triple(out, out)
        bump(out)
    s1.synchronize()
    s1.begin_capture(mode=MODES[mode])
    try:
        a = pool.alloc(nbytes, stream=s1.ptr)
        with s1:
            view(a).fill(2.0)
        s2.wait_event(s1.record())         # s2 joins the capture
        with s2:
            triple(a, out)                 # s2 reads a
        pool.record_stream(a, s2.ptr)
        pool.free(a, stream=s1.ptr)
        early = pool.alloc(nbytes, stream=s1.ptr)
        s1.wait_event(s2.record())         # s1 waits for s2
        with s1:
            bump(out)
        late = pool.alloc(nbytes, stream=s1.ptr)
        with s1:
            view(late).fill(5.0)           # a's memory again when reused: after s2's read
    finally:
        g = s1.end_capture()               # raises when a call broke the capture
    assert early != a
    assert (late == a) is reuse
    for _ in range(3):
        g.launch(stream=s1)
        s1.synchronize()
        assert bool((view(out) == 7.0).all())
    del g
    for p in (early, late, out):
        pool.free(p, stream=s1.ptr)
    pool.check_invariants()
    pool.empty_cache()
    assert pool.reserved_bytes() == 0
