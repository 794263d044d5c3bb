"""The latency suite's child processes find the right modules (mempool/bench/benchkit.py)."""
import os
import subprocess
import sys

from mempool.bench.benchkit import child_env


def test_the_torch_empty_child_imports_pytorch_not_mempools_torch_module():
    """The torch.empty child's path must not put mempool/torch.py in front of PyTorch (it
    once named the package's own folder, and every child failed on `torch.empty`)."""
    paths = [p for p in child_env()["PYTHONPATH"].split(os.pathsep) if p]
    assert not any(os.path.exists(os.path.join(p, "torch.py")) for p in paths), paths
    probe = subprocess.run(
        [sys.executable, "-c", "import mempool, importlib.util as u; "
         "s = u.find_spec('torch'); print(mempool.__file__, s and s.origin)"],
        capture_output=True, text=True, env=child_env(), cwd=os.sep)
    assert probe.returncode == 0, probe.stderr
    mempool_file, torch_origin = probe.stdout.split()
    assert os.path.join("mempool", "torch.py") not in torch_origin, torch_origin
