// The data path: allocate and free, raw allocations, caching off (Note [Caching off]),
// routing to private pools, and what the profiler and the GPU trace hear of each block.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline c10::DataPtr MempoolAllocator::allocate(size_t nbytes) {
  c10::DeviceIndex device = mempool_torch::current_device();   // Note [The current device]
  if (nbytes == 0) {
    return {nullptr, nullptr, &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
  }
  if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
    void* ptr = uncached_alloc(device, nbytes);   // the deleter gets the context: ptr
    tell_gpu_trace_alloc(ptr);
    return {ptr, ptr, &uncached_delete, c10::Device(c10::DeviceType::CUDA, device)};
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  uintptr_t tag = 0;
  void* ptr = alloc_on(device, nbytes, stream, &tag);
  tell_gpu_trace_alloc(ptr);   // Note [GPU trace hooks]
  return {ptr, reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(ptr) | tag),
          &delete_block, c10::Device(c10::DeviceType::CUDA, device)};
}

inline void MempoolAllocator::copy_data(void* dest, const void* src, std::size_t count) const {
  C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
}

inline void* MempoolAllocator::raw_alloc(size_t nbytes) {
  if (nbytes == 0) return nullptr;
  c10::DeviceIndex device = mempool_torch::current_device();
  return raw_alloc_on(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
}

inline void* MempoolAllocator::raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) {
  if (nbytes == 0) return nullptr;
  return raw_alloc_on(mempool_torch::current_device(), nbytes, stream);
}

inline void MempoolAllocator::raw_delete(void* ptr) {
  if (C10_UNLIKELY(n_uncached_raw_.load(std::memory_order_acquire) > 0) &&
      forget_uncached_raw(ptr)) {
    uncached_delete(ptr);
    return;
  }
  // raw_alloc's pointers carry no tag (they are 512-byte aligned): a pointer with low bits
  // set points into a block, and must not be read as allocate()'s tagged context, which
  // would free the live block it points into. As PyTorch's allocator, refuse a pointer at
  // which no live block starts (inside one, unknown, or freed already); nothing is freed.
  uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  TORCH_CHECK(!p || ((p & kTagMask) == 0 && free_tagged(p)),
              cat("invalid device pointer: ", static_cast<const void*>(ptr),
                  " (mempool: no live block of the pool starts there; raw_delete takes a "
                  "pointer raw_alloc returned, once)"));
}

// ctx: the block's address with the tag of allocate() in its low bits. False when no live
// block of the pools starts at an untagged ptr (nothing is freed then).
inline bool MempoolAllocator::free_tagged(uintptr_t ctx) {
  uintptr_t ptr = ctx & ~kTagMask;
  uintptr_t tag = ctx & kTagMask;
  if (!ptr) return true;
  if (tag == 0 || tag == kTagPrivate) {
    if (n_private_blocks_.load(std::memory_order_acquire) > 0 && free_private(ptr)) return true;
    if (tag == kTagPrivate) return false;   // freed already: PyTorch's precondition was broken
    int device = api->find_device(ptr);
    if (device < 0) return false;
    tag = static_cast<uintptr_t>(device) + 1;
  }
  int device = static_cast<int>(tag) - 1;
  tell_gpu_trace_free(reinterpret_cast<void*>(ptr));   // Note [GPU trace hooks]
  if (tracing_.load(std::memory_order_relaxed)) record_free(device, ptr, {0, 0});
  else if (C10_UNLIKELY(contexts_kept_.load(std::memory_order_relaxed))) forget_context(ptr);
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) {
    int64_t nbytes = static_cast<int64_t>(block_facts(device, ptr, {0, 0}).nbytes);
    api->free(device, ptr);
    report_to_profiler(device, ptr, -nbytes);
    return true;
  }
  api->free(device, ptr);
  return true;
}

// torch.profiler.profile(profile_memory=True) hears of each allocation and free as from
// PyTorch's own allocator: the block's address and signed size, then the device pool's
// allocated and reserved bytes after it (c10::reportMemoryUsageToProfiler, which does
// nothing outside a profiled region). Called only while memory profiling is on.
inline void MempoolAllocator::report_to_profiler(int device, uintptr_t ptr, int64_t delta) {
  mp_torch_figures fig;
  if (api->memory_figures(device, &fig) != MP_OK) return;
  c10::reportMemoryUsageToProfiler(
      reinterpret_cast<void*>(ptr), delta, fig.used, fig.reserved,
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
}

// The same with the size of the live block at ptr (taken before its free).
inline void MempoolAllocator::report_to_profiler(int device, uintptr_t ptr, MempoolId_t pool, int sign) {
  int64_t nbytes = static_cast<int64_t>(block_facts(device, ptr, pool).nbytes);
  report_to_profiler(device, ptr, sign * nbytes);
}

// raw_alloc's and raw_alloc_with_stream's block: the pool's, or the driver's while caching
// is off; the GPU trace hears of it either way (Note [GPU trace hooks]).
inline void* MempoolAllocator::raw_alloc_on(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream) {
  void* ptr = nullptr;
  if (C10_UNLIKELY(!enabled_.load(std::memory_order_relaxed))) {
    ptr = uncached_raw_alloc(device, nbytes);
  } else {
    uintptr_t tag = 0;
    ptr = alloc_on(device, nbytes, stream, &tag);
  }
  tell_gpu_trace_alloc(ptr);
  return ptr;
}

inline void* MempoolAllocator::uncached_alloc(c10::DeviceIndex device, size_t nbytes) {
  c10::cuda::CUDAGuard guard(device);
  void* ptr = nullptr;
  cudaError_t err = cudaMalloc(&ptr, nbytes);
  if (err == cudaErrorMemoryAllocation) {
    (void)cudaGetLastError();   // clear it, as PyTorch does before raising
    size_t free_bytes = 0, total = 0;
    (void)cudaMemGetInfo(&free_bytes, &total);
    TORCH_CHECK_WITH(OutOfMemoryError, false,
                     cat("CUDA out of memory. Tried to allocate ", fmt_size(nbytes), ". GPU ",
                         static_cast<int>(device), " has a total capacity of ",
                         fmt_size(total), " of which ", fmt_size(free_bytes),
                         " is free. mempool: caching is off "
                         "(torch.cuda.caching_allocator_enable(False)), so this was the "
                         "driver's cudaMalloc, outside the pool."));
  }
  C10_CUDA_CHECK(err);
  return ptr;
}

inline void* MempoolAllocator::uncached_raw_alloc(c10::DeviceIndex device, size_t nbytes) {
  void* ptr = uncached_alloc(device, nbytes);
  std::lock_guard<std::mutex> lock(uncached_mu_);
  uncached_raw_.insert(reinterpret_cast<uintptr_t>(ptr));
  n_uncached_raw_.store(static_cast<int64_t>(uncached_raw_.size()), std::memory_order_release);
  return ptr;
}

inline bool MempoolAllocator::forget_uncached_raw(void* ptr) {
  std::lock_guard<std::mutex> lock(uncached_mu_);
  if (!uncached_raw_.erase(reinterpret_cast<uintptr_t>(ptr))) return false;
  n_uncached_raw_.store(static_cast<int64_t>(uncached_raw_.size()), std::memory_order_release);
  return true;
}

inline void* MempoolAllocator::alloc_on(int device, size_t nbytes, cudaStream_t stream, uintptr_t* tag) {
  if (n_routes_[device_slot(device)].load(std::memory_order_acquire) > 0) {
    PrivatePool* pp = route(device, stream);
    if (pp) {
      *tag = kTagPrivate;
      return alloc_private(pp, nbytes, stream);
    }
  }
  if (C10_UNLIKELY(kind_switched(device))) return alloc_companion(device, nbytes, stream, tag);
  uintptr_t out = 0;
  int rc = api->alloc(device, nbytes, reinterpret_cast<uintptr_t>(stream), &out);
  if (rc == MP_OK) return served(device, out, nbytes, stream, tag);
  // Refused: what memory others hold is given back, and the request tried again after
  // each way that freed any (Note [Free memory callbacks], Note [Memory other pools hold
  // at OOM]).
  if (out_of_memory(rc) && run_free_memory_callbacks())
    rc = try_again(device, nbytes, stream, &out, /*retry=*/false);
  if (out_of_memory(rc) && release_unused_pools_for_oom(device))
    rc = try_again(device, nbytes, stream, &out, /*retry=*/true);
  if (out_of_memory(rc) && empty_companions(device))   // Note [Segment kind at run time]
    rc = try_again(device, nbytes, stream, &out, /*retry=*/true);
  if (rc == MP_OK) return served(device, out, nbytes, stream, tag);
  if (out_of_memory(rc)) {
    void* p = alloc_use_on_oom(device, nbytes, stream);
    if (p) {
      *tag = kTagPrivate;
      return p;
    }
  }
  throw_oom(device, nbytes, stream, rc, nullptr);
}

// The device pool's block at `out`, handed out: traced and profiled where asked.
inline void* MempoolAllocator::served(int device, uintptr_t out, size_t nbytes, cudaStream_t stream, uintptr_t* tag) {
  *tag = static_cast<uintptr_t>(device) + 1;
  if (tracing_.load(std::memory_order_relaxed))
    record_alloc(device, out, nbytes, stream, {0, 0});
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(device, out, {0, 0}, 1);
  return reinterpret_cast<void*>(out);
}

// As PyTorch's allocator does, the newest route whose filter takes the stream wins: a graph
// captured inside a use_mem_pool context allocates to the graph's pool, not to the
// MemPool, whose later allocations would otherwise reuse memory the graph replays into.
// The filters run under pools_mu_, which endAllocateToPool takes to remove a route: a
// graph's filter reads the graph, and the graph may be destroyed once its route is gone.
// (They call the CUDA runtime, never this allocator.)
inline PrivatePool* MempoolAllocator::route(int device, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  const std::vector<Route>& routes = routes_[device_slot(device)];
  for (auto r = routes.rbegin(); r != routes.rend(); ++r) {
    if (!r->filter(stream)) continue;
    auto it = private_.find(r->id);
    if (it == private_.end()) continue;
    it->second->live_blocks++;   // the block to come: try_alloc_private's precondition
    return it->second.get();
  }
  return nullptr;
}

// Precondition: pp->live_blocks already counts this block (route, alloc_use_on_oom), so
// that no other thread destroys the pool while it allocates without pools_mu_. Returns
// nullptr, with the core's code in *rc, when the pool cannot serve the request (pp may be
// destroyed by then); the caller reports it, once.
inline void* MempoolAllocator::try_alloc_private(PrivatePool* pp, size_t nbytes, cudaStream_t stream, int* rc) {
  uintptr_t out = 0;
  *rc = api->pool_alloc(pp->pool, nbytes, reinterpret_cast<uintptr_t>(stream), &out);
  if (*rc != MP_OK) {
    drop_live_block(pp);   // pp may be destroyed from here on
    return nullptr;
  }
  try {
    std::lock_guard<std::mutex> lock(pools_mu_);
    private_blocks_[out] = pp;
  } catch (...) {
    // No host memory to remember the block: it goes back, else it would count in
    // live_blocks for ever and keep its pool (and a MemPool's allocator) alive.
    api->pool_free(pp->pool, out, 0, 0);
    drop_live_block(pp);
    throw;
  }
  n_private_blocks_.fetch_add(1, std::memory_order_release);
  note_private_change(pp->device);
  if (tracing_.load(std::memory_order_relaxed))
    record_alloc(pp->device, out, nbytes, stream, pp->id);
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(pp->device, out, pp->id, 1);
  return reinterpret_cast<void*>(out);
}

inline void* MempoolAllocator::alloc_private(PrivatePool* pp, size_t nbytes, cudaStream_t stream) {
  MempoolId_t id = pp->id;
  int device = pp->device;
  int rc = MP_OK;
  void* ptr = try_alloc_private(pp, nbytes, stream, &rc);
  if (!ptr) throw_oom(device, nbytes, stream, rc, &id);
  return ptr;
}

// The MemPools made with use_on_oom=True serve what the device's pool could not, each
// tried in turn as PyTorch's allocator tries them all. When none can, the caller raises
// the device's out-of-memory error: one report, as PyTorch's allocator makes one (its
// observers and trace hear of it once).
inline void* MempoolAllocator::alloc_use_on_oom(int device, size_t nbytes, cudaStream_t stream) {
  std::vector<MempoolId_t> ids;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (auto& [key, pp] : private_)
      if (pp->use_on_oom && pp->device == device) ids.push_back(key);
  }
  for (const MempoolId_t& id : ids) {
    PrivatePool* pp = nullptr;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      auto it = private_.find(id);
      if (it == private_.end() || !it->second->use_on_oom) continue;   // gone meanwhile
      pp = it->second.get();
      pp->live_blocks++;   // try_alloc_private's precondition
    }
    note_another_try(device, /*retry=*/false);
    int rc = MP_OK;
    if (void* p = try_alloc_private(pp, nbytes, stream, &rc)) return p;
  }
  return nullptr;
}

// Note [Segment kind at run time] (mp_torch_private.c): the device's companion pool of the
// other segment kind, made on first use (its captures begun once for each capture or
// MemPool context open on the device, as the device pool's were), with the block to come
// counted in its live_blocks (try_alloc_private's precondition). pools_mu_ held.
inline PrivatePool* MempoolAllocator::companion_for_block_locked(int device) {
  size_t slot = device_slot(device);
  if (!companions_[slot]) {
    auto pp = std::make_unique<PrivatePool>();
    pp->id = companion_id(device);
    pp->device = device;
    int rc = api->companion_pool_create(device, &pp->pool);
    TORCH_CHECK(rc == MP_OK,
                cat("mempool: expandable_segments was switched at run time, and the pool of "
                    "the other segment kind could not be made on device ", device, " (code ",
                    rc, rc == MP_EINVAL ? ": no mempool pool is registered for this device"
                                        : "", ")"));
    for (size_t i = 0; i < routes_[slot].size(); i++) (void)api->pool_capture_begin(pp->pool);
    try {
      std::lock_guard<std::mutex> lock(segment_mu_);   // taken last, as always
      private_owner_[pp->pool] = {device, pp->id};
    } catch (...) {
      api->pool_release(pp->pool);   // new and empty: no segment to free under pools_mu_
      throw;
    }
    companions_[slot] = pp.get();
    MempoolId_t id = pp->id;
    private_.emplace(id, std::move(pp));
  }
  companions_[slot]->live_blocks++;
  return companions_[slot];
}

// A request of the device while PyTorch's setting asks for the other segment kind. When
// the companion refuses for want of memory, what others hold is given back as for the
// device pool's requests, then the device pool's own cache (its segments are of the other
// kind: the companion cannot reuse them), and the request tried again after each.
inline void* MempoolAllocator::alloc_companion(int device, size_t nbytes, cudaStream_t stream,
                                               uintptr_t* tag) {
  int rc = MP_OK;
  auto attempt = [&]() -> void* {
    PrivatePool* pp;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      pp = companion_for_block_locked(device);
    }
    return try_alloc_private(pp, nbytes, stream, &rc);
  };
  void* ptr = attempt();
  if (!ptr && out_of_memory(rc) && run_free_memory_callbacks()) {
    note_another_try(device, /*retry=*/false);
    ptr = attempt();
  }
  if (!ptr && out_of_memory(rc) &&
      (release_unused_pools_for_oom(device) | empty_device_pool_for_oom(device))) {
    note_another_try(device, /*retry=*/true);
    ptr = attempt();
  }
  if (!ptr) {
    MempoolId_t id = companion_id(device);
    throw_oom(device, nbytes, stream, rc, &id);
  }
  *tag = kTagPrivate;
  return ptr;
}

// The caches of the device's companion pools (of every device for -1) emptied; whether
// any of them held one. Not during a capture (nothing is released then).
inline bool MempoolAllocator::empty_companions(int device) {
  if (capturing()) return false;
  std::vector<mp_pool*> pools;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (int d = 0; d < MP_TORCH_MAX_DEVICES; d++)
      if (companions_[d] && (device < 0 || d == device)) pools.push_back(companions_[d]->pool);
  }
  bool emptied = false;
  for (mp_pool* p : pools) {   // never destroyed while the allocator lives: no pin needed
    size_t before = api->pool_reserved_bytes(p);
    api->pool_empty_cache(p);
    emptied |= api->pool_reserved_bytes(p) < before;
  }
  if (emptied) note_private_change_everywhere();
  return emptied;
}

// The device pool's cache emptied for a companion's request; whether it held one.
inline bool MempoolAllocator::empty_device_pool_for_oom(int device) {
  if (capturing()) return false;
  mp_torch_figures before, after;
  if (api->memory_figures(device, &before) != MP_OK) return false;
  (void)api->empty_cache(device);
  return api->memory_figures(device, &after) == MP_OK && after.reserved < before.reserved;
}

// The companion pool whose live block starts at ptr, or nullptr.
inline mp_pool* MempoolAllocator::companion_pool_of_block(uintptr_t ptr) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  auto it = private_blocks_.find(ptr);
  return it != private_blocks_.end() && is_companion(it->second->id) ? it->second->pool
                                                                     : nullptr;
}

// True when ptr was a private pool's block (now freed).
inline bool MempoolAllocator::free_private(uintptr_t ptr) {
  PrivatePool* pp = nullptr;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_blocks_.find(ptr);
    if (it == private_blocks_.end()) return false;
    pp = it->second;
    private_blocks_.erase(it);   // still counted in live_blocks: pp stays until the free
  }
  n_private_blocks_.fetch_sub(1, std::memory_order_release);
  tell_gpu_trace_free(reinterpret_cast<void*>(ptr));   // Note [GPU trace hooks]
  if (tracing_.load(std::memory_order_relaxed)) record_free(pp->device, ptr, pp->id);
  else if (C10_UNLIKELY(contexts_kept_.load(std::memory_order_relaxed))) forget_context(ptr);
  if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(pp->device, ptr, pp->id, -1);
  api->pool_free(pp->pool, ptr, 0, 0);
  note_private_change(pp->device);
  drop_live_block(pp);
  return true;
}

inline void MempoolAllocator::recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) {
  uintptr_t p = reinterpret_cast<uintptr_t>(data.get());
  if (!p) return;
  // Only blocks of this allocator: a tensor from elsewhere (from_blob) has another deleter.
  if (data.get_deleter() != &delete_block) return;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_blocks_.find(p);
    if (it != private_blocks_.end()) {
      if (it->second->pool)
        api->pool_record_stream(it->second->pool, p, reinterpret_cast<uintptr_t>(stream.stream()));
      return;
    }
  }
  int device = data.device().index();
  api->record_stream(device, p, reinterpret_cast<uintptr_t>(stream.stream()));
}

inline void* MempoolAllocator::getBaseAllocation(void* ptr, size_t* size) {
  uintptr_t p = reinterpret_cast<uintptr_t>(ptr);
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_blocks_.find(p);
    if (it != private_blocks_.end() && it->second->pool) {
      size_t nbytes = 0, requested = 0;
      uintptr_t stream = 0;
      if (api->pool_block_info(it->second->pool, p, &nbytes, &requested, &stream) == MP_OK &&
          size)
        *size = nbytes;
      return ptr;
    }
  }
  // As PyTorch's allocator: a pointer at which no live block starts (memory from another
  // allocator, DLPack's, a freed block) is refused, before anything is shared from it.
  int device = api->find_device(p);
  uintptr_t base = p;
  size_t nbytes = 0;
  TORCH_CHECK(device >= 0 && api->base_allocation(device, p, &base, &nbytes) == MP_OK,
              cat("invalid device pointer: ", ptr,
                  " (mempool: no live block of the pool starts there; only memory the "
                  "pool handed out has a base allocation)"));
  if (size) *size = nbytes;
  return reinterpret_cast<void*>(base);
}

inline MempoolAllocator::BlockFacts MempoolAllocator::block_facts(int device, uintptr_t ptr, MempoolId_t pool) {
  BlockFacts f;
  int rc = MP_EINVAL;
  if (pool == MempoolId_t{0, 0}) {
    rc = api->block_info(device, ptr, &f.nbytes, &f.requested, &f.stream);
  } else {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(pool);
    if (it != private_.end() && it->second->pool)
      rc = api->pool_block_info(it->second->pool, ptr, &f.nbytes, &f.requested, &f.stream);
  }
  return rc == MP_OK ? f : BlockFacts{};
}

}  // namespace
