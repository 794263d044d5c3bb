"""Build of the C++ PyTorch allocator (``_csrc/glue/torch_allocator.cpp``), once per PyTorch.

The glue implements PyTorch's whole ``CUDAAllocator`` interface, so it must be compiled
against the headers of the PyTorch that will load it (Note [Torch allocator glue],
docs/architecture.md). It is built on first use, with the C++ compiler that builds any
PyTorch extension, and cached under ``$MEMPOOL_CACHE_DIR`` (default
``~/.cache/mempool``) by a key of the source, the PyTorch build and the compiler, so each
PyTorch build compiles it once (about 10 s). ``python -m mempool build-torch`` builds it
ahead of time (e.g. in a container image) and prints its path.

What it needs: a C++17 compiler (``$CXX``, else ``c++``), PyTorch's headers (every PyTorch
wheel ships them), and the CUDA runtime headers (``cuda_runtime_api.h``: the
``nvidia-cuda-runtime`` wheel PyTorch depends on, or a CUDA toolkit under ``$CUDA_HOME``).
It links against PyTorch's own ``libc10``/``libc10_cuda`` and nothing else, so it uses the
CUDA runtime PyTorch loaded.
"""
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "_csrc" / "glue" / "torch_allocator.cpp"
# The parts SOURCE includes, one concern each (its opening comment says why one unit); they
# key the cache with it.
PARTS = sorted(p for p in SOURCE.parent.glob("torch_*.cpp") if p != SOURCE)
# The glue includes mp_torch.h, which reaches the core's public headers by their bare names:
# the same layer folders the extension is built with (setup.py). Every header of those
# folders keys the cache, so an edit to any header the glue may reach rebuilds it.
INCLUDE_DIRS = [HERE / "_csrc" / layer for layer in ("glue", "core", "upstream", "common")]
HEADERS = sorted(h for d in INCLUDE_DIRS for h in d.glob("*.h"))
LIBRARY = "mempool_torch_glue.so"


class BuildError(RuntimeError):
    """The glue could not be compiled; the message says what was missing or what failed."""


def cache_dir() -> Path:
    root = os.environ.get("MEMPOOL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "mempool")
    return Path(root) / "torch-glue"


def _compiler() -> str:
    cxx = os.environ.get("CXX") or "c++"
    path = shutil.which(cxx) or shutil.which("g++") or shutil.which("clang++")
    if not path:
        raise BuildError(f"no C++ compiler found (tried $CXX={cxx!r}, g++, clang++); install "
                         "one (e.g. apt-get install g++) to build mempool's PyTorch allocator")
    return path


def _cuda_include_dirs(torch) -> list[str]:
    """Directories holding cuda_runtime_api.h and crt/host_config.h."""
    candidates = []
    purelib = Path(sysconfig.get_paths()["purelib"])
    torch_site = Path(torch.__file__).resolve().parent.parent
    for site in dict.fromkeys([torch_site, purelib]):
        nvidia = site / "nvidia"
        if nvidia.is_dir():
            candidates += sorted(str(p) for p in nvidia.glob("*/include"))
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:   # an old or CPU-only PyTorch: fall back on the environment
        CUDA_HOME = None
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), CUDA_HOME,
                 "/usr/local/cuda"):
        if home:
            candidates += [os.path.join(home, "include"),
                           os.path.join(home, "targets", "x86_64-linux", "include")]
    found, have_runtime, have_crt = [], False, False
    for d in dict.fromkeys(candidates):
        runtime = os.path.exists(os.path.join(d, "cuda_runtime_api.h"))
        crt = os.path.exists(os.path.join(d, "crt", "host_config.h"))
        if runtime or crt:
            found.append(d)
            have_runtime |= runtime
            have_crt |= crt
    if not have_runtime:
        raise BuildError("the CUDA runtime headers (cuda_runtime_api.h) were not found; "
                         "install a CUDA toolkit and set CUDA_HOME, or pip install the "
                         "nvidia-cuda-runtime wheel of your PyTorch's CUDA version")
    return found


def _torch_paths(torch) -> tuple[list[str], str]:
    root = Path(torch.__file__).resolve().parent
    include = root / "include"
    if not (include / "c10" / "cuda" / "CUDACachingAllocator.h").exists():
        raise BuildError(f"PyTorch's C++ headers are missing from {include} (a CUDA build of "
                         "PyTorch ships them)")
    return [str(include), str(include / "torch" / "csrc" / "api" / "include")], str(root / "lib")


def cxx_standard(torch_version: tuple[int, int]) -> str:
    """The C++ standard to compile the glue in for PyTorch (major, minor): PyTorch 2.14's
    headers need C++20 (``std::strong_ordering`` in c10/util/intrusive_ptr.h); earlier ones
    are built as they always were, in C++17."""
    return "c++20" if tuple(torch_version) >= (2, 14) else "c++17"


def torch_version(version: str) -> tuple[int, int]:
    """(major, minor) of a PyTorch version string such as ``2.11.0+cu130``."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise BuildError(f"cannot read PyTorch's version {version!r} (expected major.minor...)")


def compile_command(cxx: str, std: str, torch_includes: list[str], cuda_includes: list[str],
                    cxx11_abi: bool, torch_lib: str | None, output: Path | None) -> list[str]:
    """The compiler's command line for the glue in C++ standard `std` (cxx_standard): a
    shared library at `output` linked against `torch_lib`, or, with `output` None, a check
    of the source alone (``-fsyntax-only``, which needs PyTorch's headers but no library,
    nor a GPU)."""
    cmd = [cxx, f"-std={std}", f"-D_GLIBCXX_USE_CXX11_ABI={int(cxx11_abi)}",
           *(f"-I{d}" for d in INCLUDE_DIRS),
           *(f"-I{d}" for d in torch_includes), *(f"-I{d}" for d in cuda_includes)]
    if output is None:
        return [*cmd, "-fsyntax-only", str(SOURCE)]
    # Default visibility, as PyTorch's own extensions are built.
    return [*cmd, "-O2", "-shared", "-fPIC", str(SOURCE), f"-L{torch_lib}", "-lc10",
            "-lc10_cuda", f"-Wl,-rpath,{torch_lib}", "-o", str(output)]


def _key(torch, cxx: str) -> str:
    h = hashlib.sha256()
    for path in [SOURCE, *PARTS, *HEADERS, Path(__file__)]:   # this file holds the flags
        h.update(path.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    for part in (torch.__version__, getattr(torch.version, "git_version", ""),
                 str(torch._C._GLIBCXX_USE_CXX11_ABI), version):
        h.update(part.encode())
    return h.hexdigest()[:16]


def build(force: bool = False, verbose: bool = False) -> Path:
    """Compile the glue for the PyTorch imported here (cached); returns the library's path.

    Raises
    ------
    BuildError
        No compiler, no PyTorch headers, no CUDA headers, or the compiler failed (its
        output is in the message).
    """
    import torch

    cxx = _compiler()
    torch_includes, torch_lib = _torch_paths(torch)
    cuda_includes = _cuda_include_dirs(torch)
    out_dir = cache_dir() / _key(torch, cxx)
    lib = out_dir / LIBRARY
    if lib.exists() and not force:
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / "build.lock", "w") as lock:   # one build at a time per key
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.exists() and not force:
            return lib
        tmp = out_dir / f".{LIBRARY}.{os.getpid()}"
        cmd = compile_command(cxx, cxx_standard(torch_version(torch.__version__)),
                              torch_includes, cuda_includes, torch._C._GLIBCXX_USE_CXX11_ABI,
                              torch_lib, tmp)
        if verbose:
            print(" ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise BuildError(f"compiling mempool's PyTorch allocator failed ({cxx}, exit "
                             f"{done.returncode}):\n{done.stderr[-4000:]}")
        os.replace(tmp, lib)   # atomic: a concurrent loader never sees half a file
    return lib


def main(command, argv):
    """``python -m mempool build-torch [--force]``: build the glue now (e.g. in a container
    image, so that the first ``install`` pays nothing), and print where it is."""
    import argparse
    ap = argparse.ArgumentParser(prog="python -m mempool build-torch", description=main.__doc__)
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached copy exists")
    args = ap.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("mempool build-torch: needs PyTorch (pip install torch)", file=sys.stderr)
        return 1
    try:
        path = build(force=args.force)
    except BuildError as exc:
        print(f"mempool build-torch: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0
