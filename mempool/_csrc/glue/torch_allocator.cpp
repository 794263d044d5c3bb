// PyTorch's CUDA allocator over mempool pools: every method of c10's CUDAAllocator.
//
// Note [Torch allocator glue] (mp_torch.h). PyTorch's CUDAPluggableAllocator
// forwards only malloc and free; its statistics, cacheInfo (cuDNN benchmark), history and
// graph-pool methods throw. This class implements the whole interface of the installed
// PyTorch, is compiled against that PyTorch's headers (mempool/torch_build.py) and reaches
// the pools only through the C table of mp_torch.h, so the core knows nothing of PyTorch:
//   - allocations on the current stream go to the device's pool (the device table), or to a
//     private pool while a CUDA graph captures or a MemPool is in use on this thread;
//   - statistics are the core's counters, which already have PyTorch's meaning, summed over
//     the device's pool and its private pools;
//   - out of memory throws c10::OutOfMemoryError (torch.OutOfMemoryError in Python) with the
//     pool's explanation, after the OOM observers ran; the pool is unchanged;
//   - history and snapshots are kept here, in PyTorch's structures, so torch.cuda.memory
//     ._snapshot() and memory_viz read them unchanged.
// Lock order: history_mu_ and pools_mu_ are never held while calling into a pool whose
// call may block for long (segment allocation); neither is held while the other is taken.
//
// One compilation unit, in parts by concern: the class is declared in torch_allocator.h and
// each torch_*.cpp below defines the methods of one concern. They are included here rather
// than compiled apart because the class lives in an anonymous namespace (nothing of it is
// exported beside the two entry points at the end) and its methods stay inline as they
// were in the class, and because PyTorch's headers are then parsed once per build
// (mempool/torch_build.py compiles this file alone).

#include "torch_allocator.h"

#include "torch_data_path.cpp"
#include "torch_stats.cpp"
#include "torch_oom.cpp"
#include "torch_private_pools.cpp"
#include "torch_checkpoints.cpp"
#include "torch_ipc.cpp"
#include "torch_history.cpp"
#include "torch_segment_events.cpp"
#include "torch_snapshot.cpp"

namespace {

void delete_block(void* ctx) {
  if (ctx && the_allocator) the_allocator->free_tagged(reinterpret_cast<uintptr_t>(ctx));
}

// A block of the driver's own, allocated while caching was off (Note [Caching off]).
void uncached_delete(void* ptr) {
  if (!ptr) return;
  tell_gpu_trace_free(ptr);
  warn_if_cuda_error(cudaFree(ptr));
}

}  // namespace

// Install: check the table, then make the allocator PyTorch's, as PyTorch's own
// changeCurrentAllocator does (refused once PyTorch's allocator has served memory). Returns 0,
// or a code with a message in err: 1 a table of another version, 2 PyTorch already
// allocated on CUDA, 3 an exception.
extern "C" __attribute__((visibility("default"))) int mempool_torch_glue_install(
    const mp_torch_api* table, int device_count, char* err, size_t errlen) {
  auto say = [&](const std::string& s) {
    if (err && errlen) std::snprintf(err, errlen, "%s", s.c_str());
  };
  if (!table || table->version != MP_TORCH_API_VERSION ||
      table->struct_size != sizeof(mp_torch_api)) {
    say("the compiled glue and the mempool extension disagree on the table version; "
        "rebuild the glue (mempool.torch.build(force=True))");
    return 1;
  }
  try {
    auto* current = c10::cuda::CUDACachingAllocator::allocator.load();
    if (the_allocator && current == the_allocator) return 0;
    if (current && current->initialized()) {
      say("PyTorch's CUDA allocator has already been initialised (a CUDA tensor was made "
          "before mempool.torch.install); install before the first CUDA allocation");
      return 2;
    }
    api = table;
    if (!the_allocator) the_allocator = new MempoolAllocator();   // lives for the process
    the_allocator->init(device_count);
    api->set_segment_observer(&MempoolAllocator::observe_segment, the_allocator);
    api->set_release_observer(&MempoolAllocator::before_release, the_allocator);
    c10::cuda::CUDACachingAllocator::allocator.store(the_allocator);
    // PyTorch registers its own caching allocator for kCUDA as well (priority 0), and
    // c10::GetAllocator(kCUDA) answers with it: torch.accelerator's memory functions
    // (memory_stats, memory_allocated, empty_cache, ...) and generic code that allocates
    // through the device type's allocator. Registered above it, the glue answers them too.
    c10::SetAllocator(c10::DeviceType::CUDA, the_allocator, kRegistryPriority);
    return 0;
  } catch (const std::exception& e) {
    say(e.what());
    return 3;
  }
}

// Whether this glue is PyTorch's allocator now.
extern "C" __attribute__((visibility("default"))) int mempool_torch_glue_installed(void) {
  return the_allocator && c10::cuda::CUDACachingAllocator::allocator.load() == the_allocator;
}
