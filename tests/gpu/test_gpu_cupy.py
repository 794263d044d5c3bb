"""CuPy on pool memory: as CuPy's allocator (set_allocator(pool.malloc)) and through
pool.alloc + cupy.cuda.UnownedMemory."""
import gc

import numpy as np
import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

KiB, MiB = 1 << 10, 1 << 20
# Element counts of int32 arrays: empty, tiny, around the 1 MiB small/large split, large.
COUNTS = [0, 1, 127, 128, 1000, 256 * KiB - 1, 256 * KiB, 256 * KiB + 1, 3 * MiB, 16 * MiB + 3]


def _held_by(pool, array):
    """Whether `pool` holds at least the array's bytes (only the test uses the pool)."""
    return array.nbytes == 0 or pool.used_bytes() >= array.nbytes


@pytest.mark.parametrize("count", COUNTS)
def test_set_allocator_kernels_write_and_read(cuda_pool, cupy_device, count, held_cupy_arrays):
    cupy = cupy_device
    pool = cuda_pool()
    with cupy.cuda.using_allocator(pool.malloc):
        a = cupy.arange(count, dtype=cupy.int32)
        b = a * 2 + 1
        assert _held_by(pool, a) and _held_by(pool, b)
        expected = np.arange(count, dtype=np.int32) * 2 + 1
        np.testing.assert_array_equal(cupy.asnumpy(b), expected)
        assert int(b.sum(dtype=cupy.int64)) == int(expected.sum(dtype=np.int64))
        del a, b
    gc.collect()
    cupy.cuda.get_current_stream().synchronize()
    assert pool.used_bytes() == 0, held_cupy_arrays()
    pool.check_invariants()


def test_set_allocator_many_live_arrays(cuda_pool, cupy_device, held_cupy_arrays):
    """Hundreds of live arrays of mixed sizes: each keeps its own values."""
    cupy = cupy_device
    pool = cuda_pool()
    rng = np.random.default_rng(5)
    with cupy.cuda.using_allocator(pool.malloc):
        arrays = []
        for i in range(300):
            n = int(rng.choice([1, 17, 4096, 70_000, 300_000, 2_000_000]))
            arrays.append((i, cupy.full(n, i, dtype=cupy.int32)))
            if i % 3 == 2:
                arrays.pop(int(rng.integers(len(arrays))))
        pool.check_invariants()
        for i, arr in arrays:
            assert int((arr != i).sum()) == 0, f"array {i} was overwritten"
        del arrays, arr
    gc.collect()
    assert pool.used_bytes() == 0, held_cupy_arrays()


def test_set_allocator_library_calls(cuda_pool, cupy_device, held_cupy_arrays):
    """cuBLAS and cuFFT workspaces and temporaries come from the pool too."""
    cupy = cupy_device
    pool = cuda_pool()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 384)).astype(np.float32)
    y = rng.standard_normal((384, 256)).astype(np.float32)
    with cupy.cuda.using_allocator(pool.malloc):
        z = cupy.asarray(x) @ cupy.asarray(y)
        np.testing.assert_allclose(cupy.asnumpy(z), x @ y, rtol=1e-3, atol=1e-3)
        f = cupy.fft.fft(cupy.asarray(x[0]))
        np.testing.assert_allclose(cupy.asnumpy(f), np.fft.fft(x[0]), rtol=1e-3, atol=1e-3)
        assert pool.stats()["allocation.all.allocated"] > 0
        del z, f
        # cuFFT plans keep their work area (allocated from the pool) in CuPy's plan cache.
        cupy.fft.config.get_plan_cache().clear()
    gc.collect()
    assert pool.used_bytes() == 0, held_cupy_arrays()


def test_set_allocator_on_a_stream(cuda_pool, streams, cupy_device, held_cupy_arrays):
    cupy = cupy_device
    pool = cuda_pool()
    s, _ = streams
    with s, cupy.cuda.using_allocator(pool.malloc):
        a = cupy.ones(5 * MiB, dtype=cupy.float32)
        total = float(a.sum())
        del a
    assert total == 5 * MiB
    s.synchronize()
    gc.collect()
    assert pool.used_bytes() == 0, held_cupy_arrays()


@pytest.mark.parametrize("nbytes", [4, 512, 4100, MiB, 5 * MiB + 12, 48 * MiB])
def test_alloc_as_unowned_memory(cuda_pool, streams, kernels, cupy_device, nbytes,
                                 held_cupy_arrays):
    cupy = cupy_device
    pool = cuda_pool()
    s, _ = streams
    ptr = pool.alloc(nbytes, stream=s)
    view = kernels.view(ptr, nbytes, owner=pool, dtype="uint8")
    with s:
        view[...] = cupy.arange(nbytes, dtype=cupy.uint8)
        back = cupy.asnumpy(view, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(back, np.arange(nbytes, dtype=np.uint8))
    del view
    pool.free(ptr, stream=s)
    pool.check_invariants()
    assert pool.used_bytes() == 0, held_cupy_arrays()
