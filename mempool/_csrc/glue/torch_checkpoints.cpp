// CUDA-graph pool checkpoints (cudagraph trees): a private pool's allocated blocks recorded
// and put back.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> MempoolAllocator::getCheckpointState(
 c10::DeviceIndex device, MempoolId_t id) {
  require_pool(device, id, "getCheckpointState");
  auto state = std::make_shared<CheckpointState>();
  state->id = id;
  state->device = device;
  state->blocks = allocated_blocks(id);
  return state;
}

inline c10::cuda::CUDACachingAllocator::CheckpointDelta MempoolAllocator::setCheckpointPoolState(
 c10::DeviceIndex device,
 std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) {
  auto state = std::dynamic_pointer_cast<CheckpointState>(pps);
  TORCH_CHECK(state, "setCheckpointPoolState: not a mempool checkpoint");
  c10::cuda::CUDACachingAllocator::CheckpointDelta delta;
  auto now = allocated_blocks(state->id);
  PrivatePool* pp = nullptr;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(state->id);
    TORCH_CHECK(it != private_.end(), "setCheckpointPoolState: the pool no longer exists");
    pp = it->second.get();
    pp->pins++;
  }
  std::vector<PrivatePool*> pinned{pp};
  // As PyTorch's own: every block allocated now is freed, and every block of the
  // checkpoint is allocated again at its address (Note [Allocation at an address]).
  // Blocks in both simply stay.
  for (auto& [p, what] : now) {
    delta.ptrs_freed.push_back(reinterpret_cast<void*>(p));
    if (!state->blocks.count(p)) free_private(p);
  }
  // Every block is put back before any DataPtr is made: a DataPtr frees its block when it
  // dies, so one made before a failure would, as the exception unwinds, free blocks that
  // live tensors still use. On a failure only the blocks put back by this call go again.
  std::vector<uintptr_t> restored;
  restored.reserve(state->blocks.size());   // no allocation once blocks are put back
  try {
    for (auto& [p, what] : state->blocks) {
      if (now.count(p)) continue;
      int rc = api->pool_alloc_at(pp->pool, p, what.first, what.second);
      if (rc == MP_OK) {
        try {
          std::lock_guard<std::mutex> lock(pools_mu_);
          private_blocks_[p] = pp;
          pp->live_blocks++;
        } catch (...) {
          (void)api->pool_free(pp->pool, p, 0, 0);
          rc = MP_ENOMEM;   // no host memory to remember the block
        }
      }
      TORCH_CHECK(rc == MP_OK,
                  cat("mempool: restoring a CUDA-graph pool checkpoint could not put the "
                      "block at ", reinterpret_cast<void*>(p), " (", fmt_size(what.first),
                      ") back (code ", rc, ")"));
      n_private_blocks_.fetch_add(1, std::memory_order_release);
      restored.push_back(p);
    }
    // Each block put back is an allocation to history, trackers and the profiler, as
    // PyTorch's restore allocates each (the frees above were recorded by free_private).
    for (uintptr_t p : restored) {
      const auto& what = state->blocks.at(p);
      if (tracing_.load(std::memory_order_relaxed))
        record_alloc(pp->device, p, what.first, reinterpret_cast<cudaStream_t>(what.second),
                     pp->id);
      if (C10_UNLIKELY(c10::memoryProfilingEnabled()))
        report_to_profiler(pp->device, p, pp->id, 1);
    }
  } catch (...) {
    for (uintptr_t q : restored) free_private(q);
    unpin(pinned);
    throw;
  }
  for (auto& [p, what] : state->blocks)
    delta.dataptrs_allocd.emplace_back(
        reinterpret_cast<void*>(p), reinterpret_cast<void*>(p | kTagPrivate), &delete_block,
        c10::Device(c10::DeviceType::CUDA, device));
  note_private_change(device);
  unpin(pinned);
  return delta;
}

}  // namespace
