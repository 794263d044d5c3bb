"""``python -m mempool run`` and ``import mempool.auto`` on a GPU: an unchanged PyTorch (and
CuPy) script allocates from the default pool, configured from ``MEMPOOL_CONF`` or PyTorch's
own variable. Every case is a fresh process: the allocator goes in before CUDA starts."""
import importlib.util
import textwrap

import pytest

from mempool import _cuda
from _support import child     # a child process with no conf variables

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                 reason="needs PyTorch")

# A script that knows nothing of mempool but the checks: it makes tensors as any script does.
TORCH_SCRIPT = """
import os, sys
import torch
import mempool, mempool.torch

pool = mempool.default_pool(0)
before = pool.used_bytes()
x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
y = torch.ones(1 << 20, device="cuda") * 2
assert y.sum().item() == 2 * (1 << 20)
assert pool.used_bytes() >= before + (64 << 20), (before, pool.used_bytes())
pool.block_info(x.data_ptr())            # raises unless x is a block of the pool
assert torch.cuda.memory_allocated() == pool.stats()["allocated_bytes.all.current"] >= 64 << 20
pinned = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()   # PyTorch's own host allocator
assert pinned.is_pinned()
print("counters", mempool.torch.counters(0))
print("options", {k: pool.options[k] for k in sys.argv[1:]})
print("env", os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), os.environ.get("MEMPOOL_CONF"))
del x, y
torch.cuda.synchronize()
pool.check_invariants()
"""


@pytest.fixture
def torch_script(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(TORCH_SCRIPT)
    return path


@needs_torch
def test_run_puts_an_unchanged_torch_script_on_the_pool(torch_script, tmp_path):
    ran = child(["--no-cupy", str(torch_script)], tmp_path,
                {"MEMPOOL_CONF": "expandable_segments:True"})
    assert ran.returncode == 0, ran.stderr
    assert "torch: hooked on device 0" in ran.stderr
    assert "counters {'live_blocks': " in ran.stdout
    live = int(ran.stdout.split("'live_blocks': ")[1].split(",")[0])
    assert live >= 2


@needs_torch
def test_run_reads_pytorchs_variable_and_leaves_pytorch_only_its_pinned_keys(torch_script,
                                                                           tmp_path):
    # backend:cudaMallocAsync and a lowercase bool would each make PyTorch itself raise or
    # check its backend against the installed allocator; the pool takes the rest.
    pytorch = ("backend:cudaMallocAsync,initial_pool_size_mb:128,expandable_segments:true,"
               "pinned_use_cuda_host_register:True")
    ran = child(["--no-cupy", str(torch_script), "initial_pool_size", "expandable_segments"],
                tmp_path, {"PYTORCH_CUDA_ALLOC_CONF": pytorch})
    assert ran.returncode == 0, ran.stderr
    # what cudaMallocAsync ignores in PyTorch the pool ignores too: expandable_segments goes
    assert "options {'initial_pool_size': 134217728, 'expandable_segments': False}" in ran.stdout
    assert "env pinned_use_cuda_host_register:True initial_pool_size:128MiB" in ran.stdout
    assert "ignores expandable_segments" in ran.stderr


@needs_torch
def test_run_with_the_issues_string(torch_script, tmp_path):
    conf = "backend:cuda,initial_pool_size_mb:2048,max_split_size_mb:128,expandable_segments:true"
    ran = child(["--no-cupy", str(torch_script), "initial_pool_size", "max_split_size",
                 "expandable_segments"], tmp_path, {"MEMPOOL_CONF": conf})
    assert ran.returncode == 0, ran.stderr
    assert ("options {'initial_pool_size': 2147483648, 'max_split_size': None, "
            "'expandable_segments': True}") in ran.stdout
    assert "expandable segments win" in ran.stderr


@needs_torch
def test_local_rank_hooks_only_that_device(torch_script, tmp_path):
    ran = child(["--no-cupy", str(torch_script)], tmp_path, {"LOCAL_RANK": "0"})
    assert ran.returncode == 0, ran.stderr
    assert "pool on cuda device 0 (" in ran.stderr and "torch: hooked on device 0;" in ran.stderr


@needs_torch
def test_import_mempool_auto_after_cuda_started_says_so(tmp_path):
    code = "import torch\ntorch.zeros(1, device='cuda')\nimport mempool.auto\n"
    ran = child(["-c", code], tmp_path, python=())
    assert ran.returncode == 1
    assert "PyTorch has already initialised CUDA in this process" in ran.stderr


@needs_torch
def test_import_mempool_auto_first_puts_python_c_on_the_pool(tmp_path):
    code = textwrap.dedent("""
        import mempool.auto
        import torch, mempool
        x = torch.empty(8 << 20, dtype=torch.uint8, device="cuda")
        mempool.default_pool(0).block_info(x.data_ptr())
        print("ok", mempool.auto.installed.hooked["torch"])
    """)
    ran = child(["-c", code], tmp_path, python=())
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.startswith("ok [0")


def test_run_puts_cupy_on_the_pool(tmp_path):
    script = tmp_path / "cp.py"
    script.write_text(textwrap.dedent("""
        import cupy, mempool
        pool = mempool.default_pool(cupy.cuda.runtime.getDevice())
        before = pool.used_bytes()
        a = cupy.ones(16 << 20, dtype=cupy.uint8)
        assert pool.used_bytes() >= before + (16 << 20)
        print("ok", int(a.sum()))
    """))
    ran = child(["--no-torch", str(script)], tmp_path)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout == f"ok {16 << 20}\n"
    assert "cupy: hooked on device" in ran.stderr
