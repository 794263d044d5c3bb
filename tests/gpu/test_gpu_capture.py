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


@pytest.mark.parametrize("mode", ["relaxed", "global"])
def test_capture_after_warm_up_needs_no_segment(cuda_pool, cupy_device, mode):
    """The usual pattern: one eager run fills the pool's free lists, and the capture is
    served from them: no segment is allocated while capturing."""
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
        g = s.end_capture()
        assert pool.stats()["num_device_alloc"] == segments
        g.launch(stream=s)
        s.synchronize()
        np.testing.assert_allclose(cupy.asnumpy(out, stream=s), _expected(h),
                                   rtol=1e-5, atol=1e-4)
        del g, out, x
    gc.collect()
    pool.check_invariants()
