"""What the PyTorch drop-in tests share: the prelude that installs the pool in a fresh
interpreter, scripts run there, and C++ built against the installed PyTorch.

Each case runs in a fresh interpreter: install() must come before PyTorch initialises CUDA,
and a broken capture or a crash must cost only its own case.
"""
import os
import subprocess
import sys
import textwrap

PRELUDE = """
import torch, mempool, mempool.torch as mt
pool = mempool.Pool(backend="cuda", device=0)
glue = mt.install(pool, allocator="full")
assert isinstance(glue, mt.Glue), glue
assert torch.cuda.memory.get_allocator_backend() == "mempool"
"""


# The memory fraction set to 256 MiB above what the allocator holds (base) after a first
# tensor; total is the device's memory.
FRACTION_256_MIB_ABOVE_NOW = """
x = torch.empty(1, device="cuda")
torch.cuda.empty_cache()
total = torch.cuda.mem_get_info()[1]
base = torch.cuda.memory_reserved()
torch.cuda.set_per_process_memory_fraction((base + (256 << 20)) / total)
"""


# A CUDA graph g of one product, y = x * 2, captured into the private pool graph_pool.
GRAPH_OF_ONE_PRODUCT = """
x = torch.ones(1 << 18, device="cuda")
graph_pool = torch.cuda.graph_pool_handle()
g = torch.cuda.CUDAGraph()
torch.cuda.synchronize()
with torch.cuda.graph(g, pool=graph_pool):
    y = x * 2
"""


# A pluggable allocator as NCCL's buffer registration brings one: the driver's own cuMemAlloc
# and cuMemFree, counted (loaded with dlopen, so that it builds with no CUDA headers).
COUNTING_ALLOCATOR = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef int (*mem_alloc_t)(unsigned long long *, size_t);
typedef int (*mem_free_t)(unsigned long long);
static mem_alloc_t mem_alloc;
static mem_free_t mem_free;
static int allocs, frees;
static void load(void) {
    if (mem_alloc) return;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW);
    mem_alloc = (mem_alloc_t)dlsym(lib, "cuMemAlloc_v2");
    mem_free = (mem_free_t)dlsym(lib, "cuMemFree_v2");
}
void *counting_alloc(size_t size, int device, void *stream) {
    unsigned long long p = 0;
    load();
    if (mem_alloc(&p, size)) return 0;
    allocs++;
    return (void *)p;
}
void counting_free(void *ptr, size_t size, int device, void *stream) {
    load();
    mem_free((unsigned long long)ptr);
    frees++;
}
int counting_allocs(void) { return allocs; }
int counting_frees(void) { return frees; }
"""


def counting_allocator(tmp_path):
    """COUNTING_ALLOCATOR built as tmp_path/counting.so (skips without a C compiler)."""
    import shutil
    import pytest
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler to build the pluggable allocator")
    source, lib = tmp_path / "counting.c", tmp_path / "counting.so"
    source.write_text(COUNTING_ALLOCATOR)
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(source), "-ldl"],
                   check=True)
    return lib


def run(body, timeout=300, prelude=PRELUDE):
    code = prelude + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout, cwd=os.getcwd())
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stdout}\n{out.stderr}"
    return out.stdout


TRACKER_SOURCE = r"""
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
namespace {
std::mutex mu;
std::string seen;   // one line per entry: action address size, and for a segment_free the
                    // device's free bytes as the tracker heard of it (else 0)
const char* name(c10::CachingDeviceAllocator::TraceEntry::Action a) {
  using E = c10::CachingDeviceAllocator::TraceEntry;
  switch (a) {
    case E::ALLOC: return "alloc";
    case E::FREE_REQUESTED: return "free_requested";
    case E::FREE_COMPLETED: return "free_completed";
    case E::SEGMENT_ALLOC: return "segment_alloc";
    case E::SEGMENT_FREE: return "segment_free";
    case E::SEGMENT_MAP: return "segment_map";
    case E::SEGMENT_UNMAP: return "segment_unmap";
    default: return "other";
  }
}
}  // namespace
extern "C" void tracker_attach() {
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::CachingDeviceAllocator::TraceEntry& te) {
        size_t free_bytes = 0, total = 0;
        if (te.action_ == c10::CachingDeviceAllocator::TraceEntry::SEGMENT_FREE &&
            cudaMemGetInfo(&free_bytes, &total) != cudaSuccess)
          free_bytes = 0;
        std::lock_guard<std::mutex> lock(mu);
        seen += std::string(name(te.action_)) + " " + std::to_string(te.addr_) + " " +
                std::to_string(te.size_) + " " + std::to_string(free_bytes) + "\n";
      });
}
extern "C" void tracker_attach_refusing() {   // throws at every segment_free
  c10::cuda::CUDACachingAllocator::attachAllocatorTraceTracker(
      [](const c10::CachingDeviceAllocator::TraceEntry& te) {
        if (te.action_ == c10::CachingDeviceAllocator::TraceEntry::SEGMENT_FREE)
          throw std::runtime_error("the tracker refused a segment_free");
      });
}
extern "C" size_t tracker_entries(char* out, size_t n) {   // the length; copied when it fits
  std::lock_guard<std::mutex> lock(mu);
  if (seen.size() < n) std::memcpy(out, seen.c_str(), seen.size() + 1);
  return seen.size();
}
"""


# SOURCE (C++ against the installed PyTorch's headers, with the glue's own toolchain) built
# and loaded as `built`.
CPP_BUILD = """
import ctypes, os, subprocess, tempfile
from mempool import torch_build as tb
src = os.path.join(tempfile.mkdtemp(), "built.cpp")
with open(src, "w") as f:
    f.write(SOURCE)
includes, libdir = tb._torch_paths(torch)
lib = src[:-4] + ".so"
subprocess.run([tb._compiler(), "-std=c++17", "-O1", "-shared", "-fPIC",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
                *(f"-I{d}" for d in includes + tb._cuda_include_dirs(torch)), src,
                f"-L{libdir}", "-lc10", "-lc10_cuda", "-o", lib], check=True)
built = ctypes.CDLL(lib)
"""


TRACKER_BUILD = CPP_BUILD + """
tracker = built
tracker.tracker_entries.restype = ctypes.c_size_t

def tracked():
    n = tracker.tracker_entries(None, 0)
    buf = ctypes.create_string_buffer(n + 1)
    tracker.tracker_entries(buf, n + 1)
    return [(a, int(p), int(z), int(f)) for a, p, z, f in
            (line.split() for line in buf.value.decode().splitlines())]
"""


# PyTorch's own allocator, for the cases that check a scenario means under it what they
# check under the pool.
NATIVE_PRELUDE = """
import torch
"""
