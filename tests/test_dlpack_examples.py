"""The sharing examples (examples/*.py) run as tests: their CPU paths here, all of them on
the GPU tier."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def has_gpu():
    try:
        import torch
        return torch.cuda.is_available()
    except ImportError:
        return False


def has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def run_example(name, *args, timeout=600):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name), *args],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_cupy_hook_on_sim():
    out = run_example("cupy_hook.py", "--backend", "sim")
    assert "MemoryPointer ptr=" in out and "after dropping them" in out


@pytest.mark.skipif(not has("torch"), reason="needs PyTorch")
def test_torch_handoff_on_host():
    out = run_example("torch_handoff.py", "--backend", "host")
    assert "same memory: True" in out and "deleters freed" in out


def test_torch_allocator_on_sim():
    out = run_example("torch_allocator.py", "--backend", "sim")
    assert "6 blocks through mempool_torch_alloc" in out and "-> None" in out


@pytest.mark.skipif(not has("jax"), reason="needs JAX")
def test_jax_handoff_on_host():
    out = run_example("jax_handoff.py", "--backend", "host")
    assert "same memory: True" in out and "refused as expected" in out


gpu = pytest.mark.skipif(not has_gpu(), reason="needs a CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", ["cupy_hook.py", "torch_handoff.py", "torch_allocator.py",
                                  "jax_handoff.py"])
def test_example_on_gpu(name):
    out = run_example(name, "--backend", "cuda")
    assert "backend: cuda" in out


@pytest.mark.gpu
@gpu
def test_all_three_on_gpu():
    out = run_example("all_three.py", "--steps", "3")
    print(out)   # the side-by-side table, kept in the log of a GPU run (pytest -rP)
    assert "reserved bytes, side by side" in out and "results agree across modes: True" in out
    assert "one pool reserves less than the three side by side: True" in out
