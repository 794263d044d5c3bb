"""Every example (examples/*.py) runs as a test: on a machine without a GPU, with and
without the framework it needs (its import blocked in a child process: the example must
then say in one line what to install), and all of them on the GPU tier."""
import os
import subprocess
import sys

import pytest

from _support import run_example

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


# Each example on a machine without a GPU: (file, CPU backend arguments, the framework it
# needs there or None, what its full run prints, what its skip line names).
CPU_RUNS = [
    ("cupy_hook.py", ["--backend", "sim"], "cupy", ["MemoryPointer ptr=", "after dropping them"],
     "pip install cupy-cuda12x"),
    ("torch_handoff.py", ["--backend", "host"], "torch",
     ["same memory: True", "deleters freed"], "pip install torch"),
    ("torch_allocator.py", ["--backend", "sim"], None,
     ["6 blocks through mempool_torch_alloc", "-> None"], None),
    ("jax_handoff.py", ["--backend", "host"], "jax",
     ["same memory: True", "refused as expected"], "pip install 'jax[cpu]'"),
    ("ddp_allreduce.py", ["--backend", "host", "--steps", "2"], "torch",
     ["processes over gloo", "all ranks agree"], "pip install torch"),
]
BLOCK = """
import runpy, sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name == {module!r} or name.startswith({module!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)
sys.meta_path.insert(0, Block())
sys.argv = {argv!r}
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run_blocked(name, args, module):
    """Run an example in a child process where importing `module` fails, as on a machine
    without it."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    argv = [os.path.join(ROOT, "examples", name), *args]
    return subprocess.run([sys.executable, "-c", BLOCK.format(module=module, argv=argv)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


@pytest.mark.parametrize("name, args, module, printed, install", CPU_RUNS,
                         ids=[r[0] for r in CPU_RUNS])
def test_example_on_cpu_with_what_is_installed(name, args, module, printed, install):
    out = run_example(name, *args)
    if module is None or has(module):
        for text in printed:
            assert text in out
        assert "skipped" not in out
    else:
        lines = out.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{name}: skipped, it needs ")
        assert lines[0].endswith(f"({install})")


@pytest.mark.parametrize("name, args, module, printed, install",
                         [r for r in CPU_RUNS if r[2]], ids=[r[0] for r in CPU_RUNS if r[2]])
def test_example_without_its_framework_says_what_to_install(name, args, module, printed,
                                                             install):
    out = run_blocked(name, args, module)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{name}: skipped, it needs ")
    assert lines[0].endswith(f"({install})") and "Traceback" not in out.stderr


def test_torch_allocator_on_sim_needs_no_torch():
    out = run_blocked("torch_allocator.py", ["--backend", "sim"], "torch")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "6 blocks through mempool_torch_alloc" in out.stdout


@pytest.mark.skipif(has_gpu(), reason="checks the run without a GPU")
def test_all_three_without_a_gpu_says_it_needs_one():
    out = run_example("all_three.py")
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("all_three.py: skipped, it needs a CUDA GPU")
    assert "pip install" in lines[0]




def test_trainer_to_reader_without_a_gpu_says_what_it_needs():
    """It shares CUDA tensors between processes: on a CPU it says in one line what it needs
    (PyTorch, when that is missing; a GPU, when PyTorch is there) and exits 0."""
    if has_gpu():
        pytest.skip("checks the run without a GPU")
    lines = run_example("trainer_to_reader.py", "--steps", "2").strip().splitlines()
    assert len(lines) == 1, lines
    if has("torch"):
        assert lines[0].startswith("trainer_to_reader.py: skipped, it needs a CUDA GPU")
    else:
        assert lines[0] == ("trainer_to_reader.py: skipped, it needs PyTorch (with CUDA), "
                            "which is not installed here (pip install torch)")
    blocked = run_blocked("trainer_to_reader.py", ["--steps", "2"], "torch")
    assert blocked.returncode == 0 and "Traceback" not in blocked.stderr, blocked.stderr
    assert blocked.stdout.strip().endswith("(pip install torch)")
