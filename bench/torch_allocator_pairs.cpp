// What PyTorch's CUDA allocator in this process costs per allocate + free, timed from C++:
// the allocator's own call (CUDACachingAllocator::get()->allocate) and the DataPtr's
// deleter, with no Python and no tensor around them. torch.empty's other work (argument
// parsing, the dispatcher, the tensor) is the same whatever the allocator, so this is the
// part an allocator can change (bench/torch_allocator_pairs.py).
#include <c10/core/Allocator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstddef>

extern "C" double allocator_pairs_ns(size_t nbytes, long pairs) {
  c10::Allocator* allocator = c10::cuda::CUDACachingAllocator::get();
  for (long i = 0; i < 200; i++) c10::DataPtr warm = allocator->allocate(nbytes);
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < pairs; i++) {
    c10::DataPtr p = allocator->allocate(nbytes);   // freed by its deleter at the brace
  }
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(pairs);
}

// ---- the pieces of one allocate + free that are not the pool's: each timed alone, in a loop
// of `calls`, ns per call. Both allocators make these calls (PyTorch's allocator asks the
// device, the stream and the profiler's state as the glue does); what is left of the glue's
// pair once they are taken off is its own code and the pool's.

namespace {
volatile intptr_t sink;

template <class F>
double per_call(long calls, F f) {
  for (long i = 0; i < 200; i++) f();
  auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < calls; i++) f();
  auto t1 = std::chrono::steady_clock::now();
  return std::chrono::duration<double, std::nano>(t1 - t0).count() / static_cast<double>(calls);
}
}  // namespace

// piece: 0 cudaGetDevice, 1 c10::cuda::current_device, 2 getCurrentCUDAStream(device),
// 3 c10::memoryProfilingEnabled, 4 GPUTrace::get_trace, 5 the pool's C entry points
// (alloc_fn/free_fn: mempool_torch_alloc/mempool_torch_free) as one pair of nbytes.
extern "C" double piece_ns(int piece, long calls, size_t nbytes, void* alloc_fn, void* free_fn) {
  switch (piece) {
    case 0:
      return per_call(calls, [] { int d = -1; cudaGetDevice(&d); sink = d; });
    case 1:
      return per_call(calls, [] { sink = c10::cuda::current_device(); });
    case 2: {
      c10::DeviceIndex device = c10::cuda::current_device();
      return per_call(calls, [device] {
        sink = reinterpret_cast<intptr_t>(c10::cuda::getCurrentCUDAStream(device).stream());
      });
    }
    case 3:
      return per_call(calls, [] { sink = c10::memoryProfilingEnabled(); });
    case 4:
      return per_call(calls, [] {
        sink = reinterpret_cast<intptr_t>(c10::impl::GPUTrace::get_trace());
      });
    case 5: {
      if (!alloc_fn || !free_fn) return -1.0;
      using Alloc = void* (*)(ssize_t, int, void*);
      using Free = void (*)(void*, ssize_t, int, void*);
      auto a = reinterpret_cast<Alloc>(alloc_fn);
      auto f = reinterpret_cast<Free>(free_fn);
      c10::DeviceIndex device = c10::cuda::current_device();
      void* stream = c10::cuda::getCurrentCUDAStream(device).stream();
      auto n = static_cast<ssize_t>(nbytes);
      return per_call(calls, [=] { f(a(n, device, stream), n, device, stream); });
    }
    default:
      return -1.0;
  }
}
