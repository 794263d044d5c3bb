// Statistics, limits and caches: PyTorch's DeviceStats from the core's counters, the memory
// fraction, empty_cache and cacheInfo.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline double MempoolAllocator::getMemoryFraction(c10::DeviceIndex device) {
  mp_torch_figures fig;
  check_device(device, api->memory_figures(device, &fig), "getMemoryFraction");
  if (fig.limit == SIZE_MAX || fig.capacity == 0) return 1.0;
  return static_cast<double>(fig.limit) / static_cast<double>(fig.capacity);
}

inline void MempoolAllocator::setMemoryFraction(double fraction, c10::DeviceIndex device) {
  TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0,
              cat("invalid fraction: ", fraction, ". Please set within [0, 1]."));
  mp_torch_figures fig;
  check_device(device, api->memory_figures(device, &fig), "setMemoryFraction");
  size_t limit = fraction >= 1.0 ? SIZE_MAX
                                 : static_cast<size_t>(fraction * static_cast<double>(fig.capacity));
  check_device(device, api->set_limit(device, limit), "setMemoryFraction");
}

inline void MempoolAllocator::emptyCache(MempoolId_t mempool_id) {
  if (capturing()) return;   // releases wait for the end of every capture
  // As PyTorch's own: a private pool gives its cache back only once nothing uses it (its
  // graph destroyed, its MemPool gone). The free blocks of a live graph's pool are the
  // memory its replays write (the capture's intermediates), and a live MemPool keeps its
  // cache; emptying them made the next replay fault on freed memory.
  empty_unused_pools(mempool_id, -1);   // and destroys those that hold no live block
  if (mempool_id == MempoolId_t{0, 0}) {
    for (int d = 0; d < api->max_devices && d < device_limit(); d++) api->empty_cache(d);
    empty_companions(-1);   // Note [Segment kind at run time]: the device's memory too
  }
  // A tracker that threw as the segments went (Note [Release observer]) fails this call
  // after the trace has them, as PyTorch's empty_cache lets its trackers' errors through.
  std::exception_ptr tracker_error = std::exchange(tracker_error_, nullptr);
  // Trackers (NCCL's registration hook) learn of the freed segments now, each with this
  // call's stacks where history records them for every action (Note [Segment event
  // stacks]).
  std::shared_ptr<c10::GatheredContext> ctx;
  if (tracing_.load(std::memory_order_relaxed)) {
    RecordContext when;
    ctx = gather_context(RecordContext::ALL, &when);
  }
  flush_segments(nullptr, std::move(ctx));
  if (tracker_error) std::rethrow_exception(tracker_error);
}

inline void MempoolAllocator::cacheInfo(c10::DeviceIndex device, size_t* largest) {
  // As PyTorch's own: free device memory as the first guess when *largest is 0 (cuDNN
  // benchmark sizes its workspace from this), then the largest cached block. A pool
  // limit caps the guess at what the limit still allows.
  mp_torch_figures fig;
  if (api->memory_figures(device, &fig) != MP_OK) return;
  if (*largest == 0) {
    size_t free_bytes = 0, total = 0;
    if (api->mem_info(device, &free_bytes, &total) == MP_OK) *largest = free_bytes;
    if (fig.limit != SIZE_MAX) *largest = std::min(*largest, fig.limit > fig.reserved ? fig.limit - fig.reserved : 0);
  }
  *largest = std::max(*largest, fig.largest_free_block);
  std::lock_guard<std::mutex> lock(pools_mu_);
  for (auto& [key, pp] : private_)
    if (pp->pool && pp->device == device)
      *largest = std::max(*largest, api->pool_largest_free_block(pp->pool));
}

inline DeviceStats MempoolAllocator::getDeviceStats(c10::DeviceIndex device) {
  // The device's pool and its private pools together, each peak the device's own (Note
  // [Device peaks] in mp_torch.c), as PyTorch counts its graph pools in its device stats.
  DeviceStats out;
  mp_stats s, retired;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    std::vector<mp_pool*> pools = private_pools_locked(device);
    check_device(device, api->device_stats(device, pools.data(), pools.size(), &s),
                 "getDeviceStats");
    retired = retired_[device_slot(device)];
  }
  add_stats(out, s);
  add_stats(out, retired, /*counts_only=*/true);
  // One OOM per request that failed in the end, as PyTorch counts them (note_another_try).
  size_t slot = device_slot(device);
  out.num_ooms -= std::min(oom_tried_again_[slot].load(std::memory_order_relaxed),
                           out.num_ooms);
  out.num_alloc_retries += oom_retries_[slot].load(std::memory_order_relaxed);
  mp_torch_figures fig;
  if (api->memory_figures(device, &fig) == MP_OK)
    out.max_split_size = static_cast<int64_t>(fig.max_split_size);   // SIZE_MAX reads -1, as PyTorch's
  return out;
}

inline void MempoolAllocator::resetAccumulatedStats(c10::DeviceIndex device) {
  check_device(device, api->reset_accumulated_stats(device), "resetAccumulatedStats");
  oom_tried_again_[device_slot(device)].store(0, std::memory_order_relaxed);
  oom_retries_[device_slot(device)].store(0, std::memory_order_relaxed);
  std::lock_guard<std::mutex> lock(pools_mu_);
  retired_[device_slot(device)] = mp_stats{};
  for (auto& [key, pp] : private_)
    if (pp->pool && pp->device == device) api->pool_reset_accumulated_stats(pp->pool);
}

inline void MempoolAllocator::resetPeakStats(c10::DeviceIndex device) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  std::vector<mp_pool*> pools = private_pools_locked(device);
  check_device(device, api->device_reset_peak_stats(device, pools.data(), pools.size()),
               "resetPeakStats");
}

inline std::pair<size_t, size_t> MempoolAllocator::getMemoryInfo(c10::DeviceIndex device) {
  size_t free_bytes = 0, total = 0;
  check_device(device, api->mem_info(device, &free_bytes, &total), "getMemoryInfo");
  return {free_bytes, total};
}

inline std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> MempoolAllocator::getExpandableSegmentSizes(
 c10::DeviceIndex /*device*/) {
  // The pool's expandable segments grow by pages, not by PyTorch's per-stream sizes.
  return {};
}

inline void MempoolAllocator::check_device(int device, int rc, const char* what) {
  TORCH_CHECK(rc == MP_OK, cat("mempool: ", what, " on device ", device,
                               ": no mempool pool is registered for this device "
                               "(mempool.torch.install serves the devices it was given)"));
}

}  // namespace
