"""``python -m mempool demo`` on a GPU: it picks the device and prints the figures of both
allocators side by side."""
import re

import pytest

from mempool import _cuda

if not _cuda.available():
    pytest.skip("needs a CUDA device, CuPy and the CUDA driver", allow_module_level=True)

pytestmark = pytest.mark.gpu

from _support import run_mempool  # noqa: E402


def test_demo_picks_the_gpu_when_there_is_one():
    out = run_mempool("demo")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "demo on backend 'cuda'\n" in text
    assert re.search(r"mempool Pool\.alloc \+ free(\s+[\d,]+ ns){4}\n", text)
    assert re.search(r"cudaMalloc \+ cudaFree(\s+[\d,]+ ns){4}\n", text)
    assert "GPU reserved memory" in text
    assert "mempool memory summary" in text

