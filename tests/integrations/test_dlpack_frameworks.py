"""The framework helpers: mempool.jax (on JAX's CPU backend when JAX is installed) and
mempool.cupy's allocator switching (CuPy imports without a GPU)."""
import gc
import os
import subprocess
import sys

import numpy
import pytest

import mempool


@pytest.fixture
def pool():
    p = mempool.Pool(backend="host", capacity="64MB")
    yield p
    gc.collect()
    p.check_invariants()


# ---- JAX ------------------------------------------------------------------------------------

@pytest.fixture
def jax_cpu(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return pytest.importorskip("jax")


def test_from_buffer_is_zero_copy(jax_cpu, pool):
    import mempool.jax as mj
    buf = pool.empty((4, 8), "float32")
    numpy.asarray(buf)[:] = numpy.arange(32).reshape(4, 8)
    ptr = buf.ptr
    x = mj.from_buffer(buf)
    assert x.unsafe_buffer_pointer() == ptr and buf.exported
    assert float(x.sum()) == 31 * 32 / 2
    n0 = pool.stats()["allocation.all.freed"]
    del buf                   # the export holds its own reference: the array keeps the block
    gc.collect()
    assert pool.stats()["allocation.all.freed"] == n0
    del x
    gc.collect()
    assert pool.stats()["allocation.all.freed"] == n0 + 1


def test_from_pool(jax_cpu, pool):
    import mempool.jax as mj
    x = mj.from_pool(pool, (16,), "int32")
    assert x.shape == (16,) and str(x.dtype) == "int32"
    assert pool.used_bytes() > 0


def test_misaligned_view_is_refused_rather_than_silently_copied(jax_cpu, pool):
    import mempool.jax as mj
    buf = pool.empty(64, "float32")
    v = buf.view((8,), offset=16)
    with pytest.raises(ValueError, match="aligned to 64 bytes"):
        mj.from_buffer(v)
    assert not v.exported
    copied = mj.from_buffer(v, allow_copy=True)
    assert copied.unsafe_buffer_pointer() != v.ptr
    aligned = mj.from_buffer(buf.view((8,), offset=64))
    assert aligned.unsafe_buffer_pointer() == buf.ptr + 64


def test_sim_buffers_are_refused(pool):
    import mempool.jax as mj
    sim = mempool.Pool(backend="sim", capacity="1GB")
    with pytest.raises(ValueError, match="simulated"):
        mj.check_importable(sim.empty(4))


def test_configure_sets_the_sharing_environment():
    code = ("import os, sys, mempool.jax as mj\n"
            "os.environ.pop('XLA_PYTHON_CLIENT_ALLOCATOR', None)\n"
            "os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'true'\n"
            "print(mj.configure())\n"
            "print(mj.configure(overwrite=True))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ))
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert "'XLA_PYTHON_CLIENT_PREALLOCATE': 'true'" in first      # kept
    assert "'XLA_PYTHON_CLIENT_ALLOCATOR': 'cuda_async'" in first
    assert "'XLA_PYTHON_CLIENT_PREALLOCATE': 'false'" in second


def test_configure_after_jax_started_is_refused(jax_cpu):
    import jax.numpy as jnp
    import mempool.jax as mj
    jnp.zeros(1).block_until_ready()
    with pytest.raises(RuntimeError, match="already initialised"):
        mj.configure()


# ---- CuPy -----------------------------------------------------------------------------------

def test_use_switches_and_restores_cupys_allocator():
    cupy = pytest.importorskip("cupy")
    import mempool.cupy as mc
    sim = mempool.Pool(backend="sim", capacity="1GB")
    before = cupy.cuda.get_allocator()
    with mc.use(sim) as p:
        assert p is sim
        assert cupy.cuda.get_allocator() == sim.malloc
        mp = cupy.cuda.get_allocator()(1 << 20)     # what CuPy would call
        assert sim.used_bytes() >= 1 << 20 and mp.ptr
        del mp
    assert cupy.cuda.get_allocator() == before
    assert sim.used_bytes() == 0


def test_use_restores_after_an_error():
    cupy = pytest.importorskip("cupy")
    import mempool.cupy as mc
    sim = mempool.Pool(backend="sim", capacity="1GB")
    before = cupy.cuda.get_allocator()
    with pytest.raises(KeyError):
        with mc.use(sim):
            raise KeyError("boom")
    assert cupy.cuda.get_allocator() == before


def test_set_allocator_and_back():
    cupy = pytest.importorskip("cupy")
    import mempool.cupy as mc
    sim = mempool.Pool(backend="sim", capacity="1GB")
    before = cupy.cuda.get_allocator()
    try:
        mc.set_allocator(sim)
        assert cupy.cuda.get_allocator() == sim.malloc
        mc.set_allocator(None)
        assert cupy.cuda.get_allocator() == cupy.get_default_memory_pool().malloc
    finally:
        cupy.cuda.set_allocator(before)
