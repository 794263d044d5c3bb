"""The PyTorch glue compiles against the headers of a PyTorch other than the GPU machine's.

The glue (mempool/_csrc/glue/torch_allocator.cpp) implements every virtual method of the
installed PyTorch's CUDAAllocator, and a PyTorch release may add pure virtual methods (2.12
added attachOomRejectionObserver): a glue that misses one does not compile, and install()
fails for every user of that release. This check needs PyTorch's C++ headers and the CUDA
runtime headers, no GPU and no PyTorch library: ``MEMPOOL_TORCH_HEADERS`` names a PyTorch
wheel (a CPU build ships the same headers) or an unpacked ``include`` directory; without it,
an installed PyTorch's headers are used, and without those the test skips.
"""
import importlib.util
import os
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from mempool import torch_build

ALLOCATOR_HEADER = Path("c10") / "cuda" / "CUDACachingAllocator.h"


def torch_include(tmp_path):
    given = os.environ.get("MEMPOOL_TORCH_HEADERS")
    if given and given.endswith(".whl"):
        with zipfile.ZipFile(given) as wheel:
            for name in wheel.namelist():
                if name.startswith("torch/include/"):
                    wheel.extract(name, tmp_path)
        return tmp_path / "torch" / "include"
    if given:
        return Path(given)
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        pytest.skip("no PyTorch headers: set MEMPOOL_TORCH_HEADERS to a torch wheel or include "
                    "directory")
    return Path(spec.origin).parent / "include"


def headers_version(include):
    """(major, minor) as the headers define TORCH_VERSION_MAJOR and _MINOR."""
    for rel in ("torch/headeronly/version.h", "torch/csrc/api/include/torch/version.h"):
        path = include / rel
        if path.exists():
            found = dict(re.findall(r"#define TORCH_VERSION_(MAJOR|MINOR) (\d+)",
                                    path.read_text()))
            if len(found) == 2:
                return int(found["MAJOR"]), int(found["MINOR"])
    pytest.fail(f"no TORCH_VERSION_MAJOR/MINOR in {include}'s version headers")


def cuda_include():
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (Path(home) / "include" / "cuda_runtime_api.h").exists():
            return Path(home) / "include"
    pytest.skip("no CUDA runtime headers (set CUDA_HOME)")


def test_the_glue_compiles_against_the_given_pytorch_headers(tmp_path):
    include = torch_include(tmp_path)
    if not (include / ALLOCATOR_HEADER).exists():
        pytest.skip(f"{include} has no {ALLOCATOR_HEADER}")
    cxx = shutil.which(os.environ.get("CXX") or "c++") or shutil.which("g++")
    if not cxx:
        pytest.skip("no C++ compiler")
    cuda = cuda_include()
    # A CPU build of PyTorch lacks the one header CMake writes for CUDA builds; it holds
    # only build flags the glue does not read.
    stub = tmp_path / "stub"
    macros = stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not (include / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").exists():
        macros.parent.mkdir(parents=True)
        macros.write_text("#pragma once\n")
    torch_includes = [str(include), str(include / "torch" / "csrc" / "api" / "include"),
                      str(stub)]
    std = torch_build.cxx_standard(headers_version(include))
    cmd = torch_build.compile_command(cxx, std, torch_includes, [str(cuda)], True, None, None)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
