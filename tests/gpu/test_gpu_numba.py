"""Numba on a pool (mempool.numba) on a real device. Numba fixes its memory manager when it
makes its context, so each scenario runs in a fresh interpreter that installs the plugin
first and prints its findings as JSON."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)
pytest.importorskip("numba.cuda", reason="needs numba-cuda")

pytestmark = pytest.mark.gpu

from _support import NUMPY_COMPAT, ROOT, child_pythonpath  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30

PRELUDE = """
import gc, json
import numpy as np
import mempool, mempool.numba as mn
pool = mempool.Pool(backend="cuda", device=0, **OPTIONS)
mn.install(pool)
from numba import cuda

@cuda.jit
def add_one(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1

def ptr(arr):
    return arr.__cuda_array_interface__["data"][0]
"""


KERNEL_PROBE = """
import numpy as np
from numba import cuda

@cuda.jit
def add_one(a):
    i = cuda.grid(1)
    if i < a.size:
        a[i] += 1

a = cuda.to_device(np.zeros(256, dtype=np.float32))
add_one[1, 256](a)
assert a.copy_to_host().sum() == 256
"""


@pytest.fixture(scope="module")
def numba_kernels():
    """Skip a test that launches a kernel where numba-cuda cannot compile one at all, with
    its own memory manager and no mempool: that is the installation's problem, not the
    plugin's (the one such problem known, NumPy 2.5 against numba-cuda 0.x, is worked around by
    tests/data/numpy_compat on the children's path)."""
    env = dict(os.environ, PYTHONPATH=child_pythonpath(NUMPY_COMPAT))
    proc = subprocess.run([sys.executable, "-c", KERNEL_PROBE], capture_output=True, env=env,
                          text=True, timeout=300)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        pytest.skip(f"numba-cuda cannot compile a kernel here, without mempool: {last}")


def run(body, env=None, **options):
    code = PRELUDE.replace("OPTIONS", repr(options)) + textwrap.dedent(body)
    full_env = dict(os.environ, PYTHONPATH=child_pythonpath(NUMPY_COMPAT))
    full_env.pop("MEMPOOL_CONF", None)
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_device_arrays_and_kernels_on_pool_memory(numba_kernels):
    out = run("""
        host = np.arange(1 << 20, dtype=np.float32)
        a = cuda.to_device(host)
        b = cuda.device_array(1 << 20, dtype=np.float32)
        b.copy_to_device(host)
        add_one[(1 << 20) // 256, 256](a)
        add_one[(1 << 20) // 256, 256](b)
        cuda.synchronize()
        ok = bool((a.copy_to_host() == host + 1).all() and (b.copy_to_host() == host + 1).all())
        blocks = [pool.block_info(ptr(x)) for x in (a, b)]
        used = pool.used_bytes()
        view = a[1024:2048]                       # a view keeps the block alive
        del a, b
        gc.collect()
        used_view = pool.used_bytes()
        view_ok = bool((view.copy_to_host() == host[1024:2048] + 1).all())
        del view
        gc.collect()
        pool.check_invariants()
        print(json.dumps({"ok": ok, "blocks": blocks, "used": used, "used_view": used_view,
                          "view_ok": view_ok, "used_end": pool.used_bytes(),
                          "manager": type(cuda.current_context().memory_manager).__name__}))
    """)
    assert out["manager"] == "MempoolNumbaManager"
    assert out["ok"] and out["view_ok"]
    assert [b[1] for b in out["blocks"]] == [4 * MiB, 4 * MiB]    # requested sizes
    assert out["used"] == 8 * MiB and out["used_view"] == 4 * MiB and out["used_end"] == 0


def test_a_primary_context_another_library_retained_allocates_from_the_pool():
    """As Numba's own test_attached_primary: a context built around the primary context's
    handle, driver.Context(CUdevice(0), handle), whose device is the driver's CUdevice."""
    out = run("""
        from numba.cuda.cudadrv import driver
        dev = driver.binding.CUdevice(0)
        handle = driver.driver.cuDevicePrimaryCtxRetain(dev)
        try:
            ctx = driver.Context(dev, handle)
            ctx.push()
            try:
                mem = ctx.memalloc(4096)
                block = pool.block_info(mem.device_pointer_value)
                manager = type(ctx.memory_manager).__name__
                del mem
                gc.collect()
            finally:
                ctx.pop()
        finally:
            driver.driver.cuDevicePrimaryCtxRelease(dev)
        print(json.dumps({"block": block, "manager": manager, "used": pool.used_bytes()}))
    """)
    assert out["manager"] == "MempoolNumbaManager"
    assert out["block"][1] == 4096 and out["used"] == 0


def test_env_var_installs_the_plugin_and_default_pool_follows_mempool_conf():
    code = textwrap.dedent("""
        import json, numpy as np, mempool
        from numba import cuda
        a = cuda.device_array(1000, dtype=np.float64)
        pool = mempool.default_pool(0)
        print(json.dumps({"manager": type(cuda.current_context().memory_manager).__name__,
                          "backend": pool.backend, "limit": pool.options["limit"],
                          "block": pool.block_info(a.__cuda_array_interface__["data"][0]),
                          "info": list(cuda.current_context().get_memory_info())}))
    """)
    env = dict(os.environ, PYTHONPATH=child_pythonpath(NUMPY_COMPAT),
               NUMBA_CUDA_MEMORY_MANAGER="mempool.numba", MEMPOOL_CONF="limit:1GiB")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["manager"] == "MempoolNumbaManager"
    assert (out["backend"], out["limit"]) == ("cuda", GiB)
    assert out["block"][1] == 8000
    free, total = out["info"]
    assert total == GiB and free == GiB - 2 * MiB + (2 * MiB - 8192)   # one small segment


def test_memory_info_comes_from_the_pool():
    out = run("""
        ctx = cuda.current_context()
        before = list(ctx.get_memory_info())
        a = cuda.device_array(256 << 20, dtype=np.uint8)
        during = list(ctx.get_memory_info())
        del a
        gc.collect()
        after = list(ctx.get_memory_info())
        print(json.dumps({"before": before, "during": during, "after": after,
                          "reserved": pool.reserved_bytes()}))
    """, limit=GiB)
    assert out["before"] == [GiB, GiB]
    assert out["during"] == [GiB - 256 * MiB, GiB]
    assert out["after"] == [GiB, GiB] and out["reserved"] == 256 * MiB


def test_an_array_is_freed_on_its_own_stream_without_a_sync(numba_kernels):
    out = run("""
        s = cuda.stream()
        a = mn.device_array(1 << 22, dtype=np.float32, stream=s)
        first = ptr(a)
        owner = pool.block_info(first)[2]
        add_one[(1 << 22) // 256, 256, s](a)
        del a                                     # freed on s while the kernel may run
        gc.collect()
        b = mn.device_array(1 << 22, dtype=np.float32, stream=s)
        b.copy_to_device(np.zeros(1 << 22, dtype=np.float32), stream=s)
        add_one[(1 << 22) // 256, 256, s](b)
        back = b.copy_to_host(stream=s)
        s.synchronize()
        ok = bool((back == 1).all())
        handle = getattr(s.handle, "value", s.handle)     # ctypes or cuda-python handle
        print(json.dumps({"owner": owner, "stream": int(handle), "reused": ptr(b) == first,
                          "syncs": pool.stats()["num_sync_all_streams"], "ok": ok}))
    """)
    assert out["owner"] == out["stream"]
    assert out["reused"] and out["ok"]
    assert out["syncs"] == 0


def test_defer_cleanup_holds_the_frees():
    out = run("""
        a = cuda.device_array(1 << 20, dtype=np.float32)
        with cuda.defer_cleanup():
            del a
            gc.collect()
            inside = pool.used_bytes()
        after = pool.used_bytes()
        print(json.dumps({"inside": inside, "after": after}))
    """)
    assert out["inside"] == 4 * MiB and out["after"] == 0


def test_ipc_handles_are_refused_saying_why():
    out = run("""
        a = cuda.device_array(1 << 20, dtype=np.float32)
        try:
            a.get_ipc_handle()
            result = {"refused": False}
        except mn.IpcNotSupportedError as exc:
            result = {"refused": True, "message": str(exc)}
        print(json.dumps(result))
    """)
    assert out["refused"], "the driver exported pool memory through cuIpcGetMemHandle"
    assert "cuIpcGetMemHandle" in out["message"] and "cudaMemPool" in out["message"]


def test_cupy_and_numba_share_the_pool(numba_kernels):
    out = run("""
        import cupy, mempool.cupy as mc
        mc.set_allocator(pool)
        x = cupy.arange(1 << 20, dtype=cupy.float32)
        nx = cuda.as_cuda_array(x)                  # CuPy's pool block, zero-copy
        add_one[(1 << 20) // 256, 256](nx)
        y = cuda.device_array_like(nx)              # Numba's, from the same pool
        y.copy_to_device(nx)
        ok = bool((cupy.asarray(y) == cupy.arange(1 << 20, dtype=cupy.float32) + 1).all())
        print(json.dumps({"ok": ok, "x": pool.block_info(x.data.ptr)[1],
                          "y": pool.block_info(ptr(y))[1]}))
    """)
    assert out["ok"] and out["x"] == out["y"] == 4 * MiB
