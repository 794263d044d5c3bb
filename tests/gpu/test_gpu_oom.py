"""Out of memory on a real device with the device full: after the OutOfMemoryError the pool
is unchanged and usable. The pool's own limit is the upstream contract's
(tests/upstreams/test_contract.py)."""
import pytest

import mempool
from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

# The first test fills the device: no other test may run on it meanwhile.
pytestmark = [pytest.mark.gpu, pytest.mark.gpu_exclusive]

MiB, GiB = 1 << 20, 1 << 30


def test_full_device_raises_then_recovers(cuda_pool, streams, kernels, cupy_device):
    """Fill the device through the pool until it refuses, then give everything back."""
    cupy = cupy_device
    free_before, total = cupy.cuda.runtime.memGetInfo()
    chunk = 2 * GiB
    pool = cuda_pool(release_threshold=0)
    s, _ = streams
    held = []
    with pytest.raises(mempool.OutOfMemoryError) as info:
        for _ in range(total // chunk + 2):  # the device must refuse before this ends
            held.append(pool.alloc(chunk, stream=s))
    assert isinstance(info.value, MemoryError)
    assert len(held) * chunk >= free_before // 2, "the pool gave up long before the device"
    pool.check_invariants()
    # A smaller request may still fit in what is left; either way the pool stays sound.
    try:
        tail = pool.alloc(256 * MiB, stream=s)
    except mempool.OutOfMemoryError:
        tail = None
    pool.check_invariants()
    # The blocks handed out before the refusal are good memory.
    for ptr in (held[0], held[-1]):
        kernels.fill(ptr, 256 * MiB, 3, stream=s)
        assert kernels.count_bad(ptr, 256 * MiB, 3, s) == 0
    for ptr in held:
        pool.free(ptr, stream=s)
    if tail is not None:
        pool.free(tail, stream=s)
    pool.empty_cache()
    s.synchronize()
    assert pool.reserved_bytes() == 0
    assert pool.stats()["cuda_pool.reserved_current"] == 0
    free_after, _ = cupy.cuda.runtime.memGetInfo()
    assert free_after >= free_before - 512 * MiB, "device memory was not given back"
    # The pool works as before.
    ptr = pool.alloc(GiB, stream=s)
    kernels.fill(ptr, 256 * MiB, 4, stream=s)
    assert kernels.count_bad(ptr, 256 * MiB, 4, s) == 0
    pool.free(ptr, stream=s)
    pool.check_invariants()


def test_oom_record_on_the_device(cuda_pool, streams):
    # The record (mp_oom) is the pool at the refusal: its figures add up, and with nothing
    # run since, they are what the pool's views say.
    pool = cuda_pool(limit=256 * MiB)
    s, _ = streams
    first = pool.alloc(200 * MiB, stream=s)
    small = pool.alloc(3 * MiB, stream=s)
    pool.free(small, stream=s)
    with pytest.raises(mempool.OutOfMemoryError) as info:
        pool.alloc(100 * MiB, stream=s)
    r = info.value.record
    assert r["reserved_bytes"] == r["used_bytes"] + r["pending_bytes"] + r["cached_bytes"]
    assert r["reserved_bytes"] == pool.reserved_bytes() and r["used_bytes"] == pool.used_bytes()
    assert r["largest_free_block"] == pool.largest_free_block() <= r["cached_bytes"]
    assert r["num_ooms"] == pool.stats()["num_ooms"]
    pool.free(first, stream=s)
    pool.check_invariants()
