// What PyTorch's CUDA allocator in this process costs per allocate + free, timed from C++:
// the allocator's own call (CUDACachingAllocator::get()->allocate) and the DataPtr's
// deleter, with no Python and no tensor around them. torch.empty's other work (argument
// parsing, the dispatcher, the tensor) is the same whatever the allocator, so this is the
// part an allocator can change (bench/torch_allocator_pairs.py).
#include <c10/cuda/CUDACachingAllocator.h>

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
