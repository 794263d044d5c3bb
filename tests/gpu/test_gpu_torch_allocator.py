"""mempool.torch.install and mem_pool on a GPU: PyTorch allocates from the pool, in a fresh
interpreter each (install() must precede PyTorch's CUDA init)."""
import os
import subprocess
import sys
import textwrap

import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu
pytest.importorskip("torch")


def run_gpu_script(body, timeout=600):
    """Run `body` in a fresh interpreter (install() must precede PyTorch's CUDA init)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], capture_output=True,
                         text=True, timeout=timeout, cwd=os.getcwd())
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_install_into_torch():
    out = run_gpu_script("""
        import torch, mempool, mempool.torch as mt
        pool = mempool.Pool(backend="cuda", device=0)
        mt.install(pool)
        assert mt.install(pool) is not None          # idempotent
        x = torch.randn(1024, 1024, device="cuda")
        assert pool.used_bytes() >= 4 << 20
        y = (x @ x).sum().item()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            z = x * 2
        x.record_stream(s)
        del x, z
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(0.5, 0)
        try:
            pool.free(pool.alloc(int(pool.capacity * 0.6)))
        except mempool.OutOfMemoryError:
            pass
        else:
            raise AssertionError("the memory fraction did not cap the pool")
        pool.check_invariants()
        print("used", pool.used_bytes(), "reserved", pool.reserved_bytes())
    """)
    assert "used" in out


def test_install_after_cuda_init_is_refused():
    run_gpu_script("""
        import torch, mempool, mempool.torch as mt
        torch.zeros(1, device="cuda")
        try:
            mt.install(mempool.Pool(backend="cuda", device=0))
        except RuntimeError as exc:
            assert "already initialised CUDA" in str(exc)
        else:
            raise AssertionError("install after CUDA init must fail")
    """)


def test_mem_pool_routes_a_context_to_the_pool():
    run_gpu_script("""
        import torch, mempool, mempool.torch as mt
        torch.zeros(1, device="cuda")                 # works after CUDA init
        pool = mempool.Pool(backend="cuda", device=0)
        mp = mt.mem_pool(pool)
        with torch.cuda.use_mem_pool(mp):
            a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        assert pool.used_bytes() >= 64 << 20
        b = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")   # outside: torch's own
        del a, b
        print("ok")
    """)


def test_training_step_with_backward_while_threads_allocate_through_cupy():
    pytest.importorskip("cupy")
    out = run_gpu_script("""
        import threading, torch, cupy, mempool, mempool.torch as mt, mempool.cupy as mc
        pool = mempool.Pool(backend="cuda", device=0)
        mt.install(pool)
        mc.set_allocator(pool)
        stop = threading.Event()
        errors = []
        def cupy_worker(seed):
            try:
                with cupy.cuda.Stream(non_blocking=True):
                    rng = cupy.random.default_rng(seed)
                    while not stop.is_set():
                        a = rng.standard_normal((512, 512), dtype=cupy.float32)
                        b = (a @ a.T).sum()
                        float(b)
            except BaseException as exc:
                errors.append(exc)
        threads = [threading.Thread(target=cupy_worker, args=(k,)) for k in range(4)]
        for t in threads: t.start()
        model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(),
                                    torch.nn.Linear(4096, 1024)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(20):
            x = torch.randn(256, 1024, device="cuda")
            loss = model(x).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()                       # allocates on the autograd thread
            opt.step()
        torch.cuda.synchronize()
        stop.set()
        for t in threads: t.join()
        assert not errors, errors
        pool.check_invariants()
        st = pool.stats()
        print("allocs", st["allocation.all.allocated"], "loss", float(loss))
    """)
    assert "allocs" in out

