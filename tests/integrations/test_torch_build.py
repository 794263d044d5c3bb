"""The build of the C++ PyTorch allocator: what it looks for and what it says when it lacks it.

The compile itself needs PyTorch's headers and runs in the GPU tier; here, a fake PyTorch
module tree checks the search for headers and the messages a user sees.
"""
import re
import types
from pathlib import Path

import pytest

from mempool import torch_build


def fake_torch(tmp_path, with_headers=True):
    root = tmp_path / "site" / "torch"
    (root / "lib").mkdir(parents=True)
    if with_headers:
        (root / "include" / "c10" / "cuda").mkdir(parents=True)
        (root / "include" / "c10" / "cuda" / "CUDACachingAllocator.h").write_text("")
    (root / "__init__.py").write_text("")
    mod = types.SimpleNamespace(__file__=str(root / "__init__.py"), __version__="2.11.0",
                                version=types.SimpleNamespace(git_version="abc"),
                                _C=types.SimpleNamespace(_GLIBCXX_USE_CXX11_ABI=True))
    return mod, root


def test_no_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(torch_build.BuildError, match="no C\\+\\+ compiler found"):
        torch_build._compiler()


def test_missing_torch_headers_are_named(tmp_path):
    mod, root = fake_torch(tmp_path, with_headers=False)
    with pytest.raises(torch_build.BuildError, match="PyTorch's C\\+\\+ headers are missing"):
        torch_build._torch_paths(mod)


def test_cuda_headers_from_the_nvidia_wheels_beside_torch(tmp_path, monkeypatch):
    mod, root = fake_torch(tmp_path)
    inc = root.parent / "nvidia" / "cu13" / "include"
    (inc / "crt").mkdir(parents=True)
    (inc / "cuda_runtime_api.h").write_text("")
    (inc / "crt" / "host_config.h").write_text("")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    assert str(inc) in torch_build._cuda_include_dirs(mod)


def test_no_cuda_headers_is_a_clear_error(tmp_path, monkeypatch):
    mod, root = fake_torch(tmp_path)
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.setenv(var, str(tmp_path / "nothing"))
    monkeypatch.setattr(torch_build.os.path, "exists",
                        lambda p, _e=torch_build.os.path.exists: _e(p) and "/usr/local/cuda" not in str(p))
    monkeypatch.setattr(torch_build.sysconfig, "get_paths", lambda: {"purelib": str(tmp_path)})
    with pytest.raises(torch_build.BuildError, match="cuda_runtime_api.h"):
        torch_build._cuda_include_dirs(mod)


def test_the_cache_key_follows_the_pytorch_build_and_the_source(tmp_path, monkeypatch):
    mod, _ = fake_torch(tmp_path)
    cxx = torch_build._compiler()
    a = torch_build._key(mod, cxx)
    mod.version.git_version = "def"
    b = torch_build._key(mod, cxx)
    assert a != b and len(a) == 16
    monkeypatch.setenv("MEMPOOL_CACHE_DIR", str(tmp_path / "cache"))
    assert torch_build.cache_dir() == tmp_path / "cache" / "torch-glue"


def test_install_refuses_an_unknown_allocator_before_touching_torch():
    import mempool
    import mempool.torch as mt
    with pytest.raises(ValueError, match="allocator must be 'auto', 'full' or 'pluggable'"):
        mt.install(mempool.Pool(backend="sim"), allocator="fast")


def test_the_build_command_says_what_it_needs_without_pytorch():
    import subprocess
    import sys
    code = ("import sys, builtins; real = builtins.__import__\n"
            "def block(name, *a, **k):\n"
            "    if name == 'torch' or name.startswith('torch.'): raise ImportError(name)\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = block\n"
            "from mempool.__main__ import main; sys.exit(main(['build-torch']))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert "needs PyTorch (pip install torch)" in out.stderr


def test_the_library_and_the_header_check_share_one_command_line():
    # The header check (tests/integrations/test_torch_glue_headers.py) compiles what the build compiles:
    # the same standard, ABI, include directories and source; only the output differs.
    lib = torch_build.compile_command("c++", "c++17", ["/t/include"], ["/cuda/include"], False,
                                      "/t/lib", Path("/out/glue.so"))
    check = torch_build.compile_command("c++", "c++17", ["/t/include"], ["/cuda/include"],
                                        False, None, None)
    common = ["c++", "-std=c++17", "-D_GLIBCXX_USE_CXX11_ABI=0", "-I/t/include",
              "-I/cuda/include", str(torch_build.SOURCE)]
    for arg in common:
        assert arg in lib and arg in check, (arg, lib, check)
    assert lib[-2:] == ["-o", "/out/glue.so"] and "-shared" in lib and "-lc10_cuda" in lib
    assert "-fsyntax-only" in check and "-o" not in check and not any(
        a.startswith("-l") for a in check)


@pytest.mark.parametrize("version, std", [("2.11.0+cu130", "c++17"), ("2.13.0+cpu", "c++17"),
                                          ("2.14.1", "c++20"), ("3.0.0a0+git1234", "c++20")])
def test_the_glue_is_compiled_in_the_standard_its_pytorchs_headers_need(version, std):
    # PyTorch 2.14's headers use std::strong_ordering: in C++17 the glue did not compile.
    assert torch_build.cxx_standard(torch_build.torch_version(version)) == std


def test_an_unreadable_pytorch_version_is_a_clear_error():
    with pytest.raises(torch_build.BuildError, match="cannot read PyTorch's version"):
        torch_build.torch_version("nightly")


def test_the_glues_parts_key_the_cache_and_each_stays_small():
    # torch_allocator.cpp includes its parts (one unit, by concern): an edit to any part
    # must rebuild the cached library, and no part may grow back into one large file.
    glue = torch_build.SOURCE.parent
    included = re.findall(r'#include "(torch_\w+\.cpp)"', torch_build.SOURCE.read_text())
    assert sorted(glue / name for name in included) == torch_build.PARTS
    for path in [torch_build.SOURCE, *torch_build.PARTS, glue / "torch_allocator.h"]:
        assert len(path.read_text().splitlines()) <= 800, path.name
