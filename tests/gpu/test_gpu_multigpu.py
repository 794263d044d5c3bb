"""Several GPUs: a pool per device, peer access from another GPU's kernels, PyTorch routing
each device to its pool, and NCCL collectives and DDP steps on pool memory.

Needs two CUDA devices; the peer-access tests also need a peer path between devices 0 and 1
(``cudaDeviceCanAccessPeer``). Accessing a pool's memory from a device without access faults
the kernel (and poisons the context), so only the granted path is exercised on hardware; the
refusals and the bookkeeping are tested on the simulated devices (tests/core/test_multidevice.py)
and on a stand-in driver (tests/upstreams/test_cuda_fake_driver.py).
"""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

import mempool
from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)


def _device_count():
    try:
        from cupy.cuda import runtime
        return runtime.getDeviceCount()
    except Exception:
        return 0


if _device_count() < 2:
    pytest.skip("needs two CUDA devices", allow_module_level=True)

pytestmark = pytest.mark.gpu

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def gpus():
    """CuPy, with both devices synchronized and CuPy's caches emptied after the test."""
    import cupy
    yield cupy
    for d in (0, 1):
        with cupy.cuda.Device(d):
            cupy.cuda.Device(d).synchronize()
            cupy.get_default_memory_pool().free_all_blocks()
    gc.collect()


@pytest.fixture
def peers(gpus):
    """Skip unless device 1 can reach device 0's memory and back."""
    rt = gpus.cuda.runtime
    if not (rt.deviceCanAccessPeer(1, 0) and rt.deviceCanAccessPeer(0, 1)):
        pytest.skip("devices 0 and 1 have no peer path (cudaDeviceCanAccessPeer)")
    return gpus


@pytest.fixture(scope="module")
def kernels_on(kernels):
    """Kernels compiled for each device: a module loaded on one device cannot launch on
    another."""
    import cupy
    made = {}

    def get(device):
        if device not in made:
            with cupy.cuda.Device(device):
                made[device] = type(kernels)()
        return made[device]

    return get


def run_script(body, timeout=600):
    """`body` in a fresh interpreter: PyTorch's allocator is chosen before CUDA starts."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                         text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


# ---- a pool per device ------------------------------------------------------------------------

@pytest.mark.parametrize("expandable", [False, True])
def test_each_pool_allocates_on_its_own_device(gpus, expandable):
    cupy = gpus
    pools = [mempool.Pool(backend="cuda", device=d, expandable_segments=expandable)
             for d in (0, 1)]
    for d, pool in enumerate(pools):
        other = pools[1 - d]
        before = other.stats()
        ptr = pool.alloc(4 * MiB, stream=0)
        assert cupy.cuda.runtime.pointerGetAttributes(ptr).device == d
        assert other.stats() == before
        pool.free(ptr)
    for d, pool in enumerate(pools):
        with cupy.cuda.Device(d):
            cupy.cuda.Device(d).synchronize()
        pool.check_invariants()


def test_the_default_stream_is_the_pools_own_devices(gpus):
    cupy = gpus
    pool1 = mempool.Pool(backend="cuda", device=1)
    with cupy.cuda.Device(0):
        s0 = cupy.cuda.Stream(non_blocking=True)
        with s0:                                 # device 0's current stream is s0 ...
            ptr = pool1.alloc(MiB)               # ... but the pool is on device 1
    assert pool1.block_info(ptr)[2] == cupy.cuda.get_current_stream(1).ptr != s0.ptr
    pool1.free(ptr)
    s0.synchronize()


# ---- peer access ------------------------------------------------------------------------------

@pytest.mark.parametrize("expandable", [False, True])
def test_a_kernel_on_gpu1_reads_and_writes_gpu0_pool_memory(peers, kernels_on, expandable):
    cupy = peers
    k0, k1 = kernels_on(0), kernels_on(1)
    pool = mempool.Pool(backend="cuda", device=0, expandable_segments=expandable)
    with cupy.cuda.Device(0):
        s0 = cupy.cuda.Stream(non_blocking=True)
    with cupy.cuda.Device(1):
        s1 = cupy.cuda.Stream(non_blocking=True)
    early = pool.alloc(8 * MiB, stream=s0)       # handed out before access was granted
    pool.enable_peer_access(1)
    late = pool.alloc(64 * MiB, stream=s0)       # after (expandable: pages mapped later)
    assert pool.peer_devices() == (1,)
    assert pool.access_devices(early) == pool.access_devices(late) == (0, 1)
    for i, (ptr, nbytes) in enumerate([(early, 8 * MiB), (late, 64 * MiB)]):
        with cupy.cuda.Device(0):
            k0.fill(ptr, nbytes, seed=10 + i, stream=s0)
            s0.synchronize()
        with cupy.cuda.Device(1):
            assert k1.count_bad(ptr, nbytes, 10 + i, s1) == 0     # GPU 1 reads GPU 0's data
            k1.fill(ptr, nbytes, seed=20 + i, stream=s1)          # and writes over it
            s1.synchronize()
        with cupy.cuda.Device(0):
            assert k0.count_bad(ptr, nbytes, 20 + i, s0) == 0     # GPU 0 sees GPU 1's writes
    pool.free(early, stream=s0)
    pool.free(late, stream=s0)
    s0.synchronize()
    pool.check_invariants()


def test_peer_devices_and_refusals_on_gpus(peers):
    count = _device_count()
    pool = mempool.Pool(backend="cuda", device=1)
    assert pool.peer_devices() == ()
    with pytest.raises(ValueError, match="peer_device 1 is the pool's own device"):
        pool.enable_peer_access(1)
    with pytest.raises(ValueError, match=rf"in \[0, {count}\), got {count}"):
        pool.enable_peer_access(count)
    ptr = pool.alloc(MiB, stream=0)
    assert pool.access_devices(ptr) == (1,)
    pool.enable_peer_access(0)
    pool.enable_peer_access(0)
    assert pool.peer_devices() == (0,)
    assert pool.access_devices(ptr) == (0, 1)
    pool.free(ptr)


# ---- PyTorch over a pool per device -----------------------------------------------------------

def test_install_all_routes_each_device_to_its_pool():
    out = run_script("""
        import torch, mempool, mempool.torch as mt
        pools = {d: mempool.Pool(backend="cuda", device=d) for d in (0, 1)}
        mt.install_all(pools)
        assert mt.routed_devices() == (0, 1)
        a = torch.ones(1 << 20, device="cuda:0")
        b = torch.ones(1 << 20, device="cuda:1")
        pools[0].block_info(a.data_ptr())        # raises unless a is a block of pool 0
        pools[1].block_info(b.data_ptr())
        if torch.cuda.can_device_access_peer(0, 1):   # install_all granted the peers
            assert pools[0].peer_devices() == (1,) and pools[1].peer_devices() == (0,)
        used0 = pools[0].used_bytes()
        c = a.to("cuda:1")                       # a copy across devices lands on device 1
        pools[1].block_info(c.data_ptr())
        assert pools[0].used_bytes() == used0
        assert (b + c).sum().item() == 2 * (1 << 20)
        # Not a plain memcpy: with a peer path PyTorch runs the copy as a kernel on one device
        # that reaches the other's pool memory, which faults unless that pool granted access.
        m = torch.arange(1 << 20, device="cuda:0", dtype=torch.float32).view(1024, 1024)
        t = m.t().to("cuda:1", dtype=torch.float16)
        assert torch.equal(t.float().cpu(), m.t().cpu().half().float())
        side = torch.cuda.Stream(device=1)
        with torch.cuda.stream(side):
            side.wait_stream(torch.cuda.current_stream(1))
            d = c * 3
        c.record_stream(side)
        del a, b, c, d
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        torch.cuda.empty_cache()
        for p in pools.values():
            p.check_invariants()
        print("counters", mt.counters(0), mt.counters(1))
    """)
    assert "counters" in out


def test_installing_again_adds_devices_and_never_replaces_a_pool():
    run_script("""
        import torch, mempool, mempool.torch as mt
        p0 = mempool.Pool(backend="cuda", device=0)
        mt.install(p0)
        x = torch.ones(1024, device="cuda:0")
        p1 = mempool.Pool(backend="cuda", device=1)
        mt.install_all([p0, p1])                 # adds device 1
        y = torch.ones(1024, device="cuda:1")
        p1.block_info(y.data_ptr())
        try:
            mt.install(mempool.Pool(backend="cuda", device=0))
        except RuntimeError as exc:
            assert "other pools on device(s) [0]" in str(exc), exc
        else:
            raise AssertionError("an installed pool was replaced")
        p0.block_info(x.data_ptr())
        print("ok")
    """)


def test_install_all_defaults_to_a_default_pool_per_device():
    out = run_script("""
        import os, torch, mempool, mempool.torch as mt
        os.environ.pop("MEMPOOL_CONF", None)
        mt.install_all()
        n = torch.cuda.device_count()
        assert mt.routed_devices() == tuple(range(n))
        for d in range(n):
            x = torch.empty(1 << 20, device=f"cuda:{d}")
            mempool.default_pool(d).block_info(x.data_ptr())
        print("devices", n)
    """)
    assert "devices" in out


# ---- NCCL and DDP: the example ----------------------------------------------------------------

def _example(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ddp_allreduce.py"),
                          *args], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


@pytest.mark.parametrize("expandable", [False, True])
def test_ddp_example_all_reduces_and_trains_on_pool_memory(expandable):
    args = ["--backend", "cuda", "--procs", "2", "--steps", "5"]
    if expandable:
        args.append("--expandable")
    out = _example(*args)
    assert "NCCL_NVLS_ENABLE=0" in out and "all ranks agree" in out
    for rank in (0, 1):
        assert f"rank {rank}: all_reduce of 4194304 floats from the pool on cuda:{rank} = 3 " \
               f"(expected 3)" in out
        assert f"rank {rank}: 5 DDP steps" in out and "replicas equal: True" in out
