"""The DLPack bridge on a real GPU: CUDA Buffers handed to PyTorch, CuPy and JAX, with
their streams. GPU tier (marked gpu; skipped without a device)."""
import gc
import os
import subprocess
import sys
import textwrap
import threading

import pytest

import mempool

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def producer():
    """A stream that outlives every pool of the module: a pool keeps segments made on a
    stream until it is destroyed, and freeing them on a stream already destroyed is an error
    of the CUDA API (see docs/sharing.md, "Streams outlive pools")."""
    cupy = pytest.importorskip("cupy")
    return cupy.cuda.Stream(non_blocking=True)


@pytest.fixture
def pool():
    p = mempool.Pool(backend="cuda", device=0)
    yield p
    gc.collect()
    p.check_invariants()


def test_torch_cuda_zero_copy_on_its_stream(pool, producer):
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    buf = pool.empty((1024, 1024), "float32", stream=producer)
    assert buf.stream == producer.ptr and buf.__dlpack_device__() == (2, 0)
    with producer:
        cupy.asarray(buf).fill(3.0)            # written on the producer's stream
    consumer = torch.cuda.Stream()
    with torch.cuda.stream(consumer):
        t = torch.from_dlpack(buf)             # consumer waits on an event: no host sync
        assert t.data_ptr() == buf.ptr and t.device.type == "cuda"
        total = float(t.sum())
    assert total == 3.0 * 1024 * 1024
    n0 = pool.stats()["allocation.all.freed"]
    del buf                                    # the tensor's export holds the block
    gc.collect()
    assert pool.stats()["allocation.all.freed"] == n0
    del t
    gc.collect()
    assert pool.stats()["allocation.all.freed"] == n0 + 1


def test_one_buffer_to_two_frameworks_on_two_streams(pool, producer):
    # Repeated export: each consumer's stream is ordered after the producer's and recorded
    # on the block, which is reused only once both have finished with it.
    torch = pytest.importorskip("torch")
    cupy = pytest.importorskip("cupy")
    n = 1 << 20
    buf = pool.empty(n, "float32", stream=producer)
    with producer:
        cupy.asarray(buf).fill(2.0)
    s1 = torch.cuda.Stream()
    s2 = cupy.cuda.Stream(non_blocking=True)
    # The torch consumer's stream is held busy by a host function until the gate opens, not
    # by a timed sleep: a sleep could end early while four test workers share the device (it
    # did once, before the check below), and a gate holds s1 exactly as long as the test needs.
    gate = threading.Event()
    try:
        with s2:
            c = cupy.from_dlpack(buf)
            total_c = c.sum()
        cupy.cuda.ExternalStream(s1.cuda_stream).launch_host_func(lambda _: gate.wait(30), None)
        with torch.cuda.stream(s1):
            t = torch.from_dlpack(buf)
            total_t = t.sum()
        assert t.data_ptr() == c.data.ptr == buf.ptr
        ptr = buf.ptr
        del buf, t, c
        gc.collect()
        other = pool.alloc(4 * n, stream=producer.ptr)
        assert not s1.query(), "the torch consumer's stream finished before the gate opened"
        assert other != ptr, "reused while the torch consumer's stream may still read it"
        pool.free(other)
    finally:
        gate.set()
    s1.synchronize()
    s2.synchronize()
    assert float(total_t) == float(total_c) == 2.0 * n
    again = pool.alloc(4 * n, stream=producer.ptr)
    assert again == ptr, "once both consumers are done the block serves again"
    pool.free(again)


def test_cupy_from_dlpack_and_cuda_array_interface(pool):
    cupy = pytest.importorskip("cupy")
    buf = pool.empty(4096, "int32")
    cai = buf.__cuda_array_interface__
    assert cai["version"] == 3 and cai["data"] == (buf.ptr, False)
    assert cai["stream"] == (buf.stream or 1)  # 1: the legacy default stream
    view = cupy.asarray(buf)                    # CAI: the Buffer stays the owner
    view[:] = 7
    arr = cupy.from_dlpack(buf.view())          # DLPack: the array owns its reference
    assert arr.data.ptr == buf.ptr and int(arr.sum()) == 7 * 4096
    assert not hasattr(buf, "__array_interface__")


def test_copy_true_on_device_is_refused(pool):
    buf = pool.empty(16)
    with pytest.raises(BufferError, match="copy"):
        buf.__dlpack__(copy=True, max_version=(1, 0))
    assert not buf.exported


def test_jax_in_a_fresh_process():
    """JAX must be configured before it starts: a fresh interpreter."""
    code = textwrap.dedent("""
        import mempool, mempool.jax as mj
        mj.configure()
        import jax, jax.numpy as jnp, cupy
        jnp.zeros(1).block_until_ready()
        pool = mj.shared_pool(0)
        buf = pool.empty((256, 256), "float32")
        cupy.asarray(buf)[:] = 2.0
        ptr = buf.ptr
        x = mj.from_buffer(buf)
        assert x.unsafe_buffer_pointer() == ptr, (hex(x.unsafe_buffer_pointer()), hex(ptr))
        assert float(jax.jit(lambda a: (a * a).sum())(x)) == 4.0 * 256 * 256
        del x
        pool.check_invariants()
        print("ok", pool.stats()["allocation.all.freed"])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=os.getcwd())
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().startswith("ok")
