"""The README's first command: ``python -m mempool demo`` (here on the simulated device)."""
import os
import re
import subprocess
import sys

import pytest

from mempool import _cuda

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "mempool", *args], capture_output=True,
                          text=True, timeout=300, cwd=ROOT, env=env)


def test_demo_on_the_simulated_device():
    out = run("demo", "--backend", "sim")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "demo on backend 'sim'" in text
    assert re.search(r"mempool Pool\.alloc/free\s+\d+ns", text)
    assert "stream 2 ordered after stream 1's work: True; host syncs: 0" in text
    ratios = dict(re.findall(r"^\s+(default|expandable_segments)\s+(\d\.\d{3})", text, re.M))
    assert set(ratios) == {"default", "expandable_segments"}
    assert 1.0 <= float(ratios["expandable_segments"]) < float(ratios["default"])
    assert "mempool memory summary" in text


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda.available(), reason="needs a CUDA device")
def test_demo_picks_the_gpu_when_there_is_one():
    out = run("demo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "demo on backend 'cuda'\n" in text
    assert re.search(r"mempool Pool\.alloc/free\s+\d+ns", text)
    assert "mempool memory summary" in text


def test_cli_help_and_unknown_command():
    assert run("--help").returncode == 0
    bad = run("frobnicate")
    assert bad.returncode == 2 and "unknown command 'frobnicate'" in bad.stderr
