// The registry of private pools (CUDA graphs' and MemPools'): routes, use counts, pins, and
// each pool's destruction once nothing uses it.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline void MempoolAllocator::beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
            std::function<bool(cudaStream_t)> filter) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  PrivatePool* pp = create_or_incref_locked(device, mempool_id, nullptr);
  (void)pp;
  auto& routes = routes_[device_slot(device)];
  for (const Route& r : routes)
    TORCH_CHECK(r.id != mempool_id, "beginAllocateToPool: already recording to mempool_id");
  routes.push_back(Route{mempool_id, std::move(filter)});
  n_routes_[device_slot(device)].fetch_add(1, std::memory_order_release);
  captures_.fetch_add(1, std::memory_order_acq_rel);
  // A capture may begin right after this (PyTorch routes first): from now on the device's
  // pool makes no call a global-mode capture refuses. A MemPool context routes the same
  // way; for it this only defers the pool's releases until the context ends.
  (void)api->capture_begin(device);
  if (PrivatePool* c = companions_[device_slot(device)]) (void)api->pool_capture_begin(c->pool);
}

inline void MempoolAllocator::endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  bool found = false;
  PrivatePool* companion = nullptr;   // its captures were begun with this route's
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    companion = companions_[device_slot(device)];
    auto& routes = routes_[device_slot(device)];
    for (auto it = routes.begin(); it != routes.end(); ++it) {
      if (it->id == mempool_id) {
        routes.erase(it);
        n_routes_[device_slot(device)].fetch_sub(1, std::memory_order_release);
        captures_.fetch_sub(1, std::memory_order_acq_rel);
        found = true;
        break;
      }
    }
  }
  TORCH_CHECK(found, "endAllocateToPool: not currently recording to mempool_id");
  // The pool may now make the releases it deferred: without our lock, it may synchronize.
  (void)api->capture_end(device);
  if (companion) (void)api->pool_capture_end(companion->pool);
}

inline void MempoolAllocator::releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) {
  std::vector<PrivatePool*> pinned;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(mempool_id);
    TORCH_CHECK(it != private_.end(),
                cat("releasePool: no pool with this id on device ", static_cast<int>(device)));
    PrivatePool* pp = it->second.get();
    TORCH_INTERNAL_ASSERT(pp->use_count > 0);
    // Its cache goes back now (its live blocks, held by tensors, stay until freed).
    if (--pp->use_count == 0 && pp->pool && !capturing()) {
      pp->pins++;
      pinned.push_back(pp);
    }
  }
  for (PrivatePool* pp : pinned) api->pool_empty_cache(pp->pool);
  unpin(pinned);   // and destroys the pool once it holds no live block
  if (!pinned.empty()) note_private_change_everywhere();
}

inline int MempoolAllocator::getPoolUseCount(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  auto it = private_.find(mempool_id);
  return it == private_.end() ? 0 : it->second->use_count;
}

inline void MempoolAllocator::createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
           std::shared_ptr<CUDAAllocator> allocator) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  create_or_incref_locked(device, mempool_id, std::move(allocator));
}

inline void MempoolAllocator::setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t mempool_id, bool use_on_oom) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  auto it = private_.find(mempool_id);
  TORCH_CHECK(it != private_.end(), "setUseOnOOM: no pool with this id");
  it->second->use_on_oom = use_on_oom;
}

// MemPool(no_split=True): the pool hands out whole blocks (Note [No split], mp_core.c).
inline void MempoolAllocator::setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  auto it = private_.find(mempool_id);
  TORCH_CHECK(it != private_.end(), "setNoSplit: no pool with this id");
  int rc = api->pool_set_no_split(it->second->pool);
  TORCH_CHECK(rc == MP_OK, cat("mempool: MemPool(no_split=True) could not be set on its pool "
                               "(code ", rc, ")"));
}

inline bool MempoolAllocator::checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
              const std::unordered_set<void*>& expected) {
  require_pool(device, mempool_id, "checkPoolLiveAllocations");
  auto live = allocated_blocks(mempool_id);
  if (live.size() != expected.size()) return false;
  for (void* p : expected)
    if (!live.count(reinterpret_cast<uintptr_t>(p))) return false;
  return true;
}

// Empty the caches of the private pools whose use count is 0 (of one pool id, or all for
// {0, 0}; of one device, or all for -1), and destroy those that hold no live block.
inline bool MempoolAllocator::empty_unused_pools(MempoolId_t mempool_id, int device) {
  std::vector<PrivatePool*> pinned = pin_pools(mempool_id, /*unused_only=*/true, device);
  for (PrivatePool* pp : pinned) api->pool_empty_cache(pp->pool);
  unpin(pinned);
  if (!pinned.empty()) note_private_change_everywhere();
  return !pinned.empty();
}

// One block fewer counts in pp (freed, or never made); destroys the pools nobody uses.
inline void MempoolAllocator::drop_live_block(PrivatePool* pp) {
  std::vector<mp_pool*> doomed;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    pp->live_blocks--;
    doomed = collect_freeable_locked();
  }
  release_pools(doomed);
}

// The private pools matching mempool_id ({0, 0}: all) that have a core pool, pinned; with
// unused_only, only those whose use count has dropped to 0 (graph or MemPool released);
// of `device` only, unless it is -1.
inline std::vector<PrivatePool*> MempoolAllocator::pin_pools(MempoolId_t mempool_id, bool unused_only,
                 int device) {
  std::vector<PrivatePool*> pinned;
  std::lock_guard<std::mutex> lock(pools_mu_);
  for (auto& [key, pp] : private_) {
    if (unused_only && pp->use_count > 0) continue;
    if (device >= 0 && pp->device != device) continue;
    if (pp->pool && (mempool_id == MempoolId_t{0, 0} || pp->id == mempool_id)) {
      pp->pins++;
      pinned.push_back(pp.get());
    }
  }
  return pinned;
}

inline void MempoolAllocator::unpin(const std::vector<PrivatePool*>& pinned) {
  std::vector<mp_pool*> doomed;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (PrivatePool* pp : pinned) pp->pins--;
    doomed = collect_freeable_locked();
  }
  release_pools(doomed);
}

// Destroying a core pool frees its segments (cuMemFree synchronizes): never under pools_mu_.
inline void MempoolAllocator::release_pools(const std::vector<mp_pool*>& doomed) {
  for (mp_pool* p : doomed) {
    std::pair<int, MempoolId_t> owner{-1, {0, 0}};
    {
      std::lock_guard<std::mutex> lock(segment_mu_);
      auto it = private_owner_.find(p);
      if (it != private_owner_.end()) owner = it->second;
    }
    api->pool_release(p);   // its last segment events are resolved through private_owner_
    // Forget it unless a pool made since took its address (and its entry).
    std::lock_guard<std::mutex> lock(segment_mu_);
    auto it = private_owner_.find(p);
    if (it != private_owner_.end() && it->second == owner) private_owner_.erase(it);
  }
  if (!doomed.empty()) note_private_change_everywhere();
}

// The core pools of the device's private pools. Called with pools_mu_ held, which keeps
// them alive (a pool leaves private_ under it before it is destroyed).
inline std::vector<mp_pool*> MempoolAllocator::private_pools_locked(int device) {
  std::vector<mp_pool*> pools;
  for (auto& [key, pp] : private_)
    if (pp->pool && pp->device == device) pools.push_back(pp->pool);
  return pools;
}

// Note [Device peaks] (mp_torch.c): after every allocation and free of a private pool,
// and when private pools release memory or go, the device's peaks take in the stretch
// that ends here. Without pools_mu_ held.
inline void MempoolAllocator::note_private_change(int device) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  std::vector<mp_pool*> pools = private_pools_locked(device);
  (void)api->private_event(device, pools.data(), pools.size());   // MP_EINVAL: no pool
}

inline void MempoolAllocator::note_private_change_everywhere() {
  for (int d = 0; d < device_limit(); d++) note_private_change(d);
}

inline PrivatePool* MempoolAllocator::create_or_incref_locked(int device, MempoolId_t id,
                  std::shared_ptr<CUDAAllocator> custom) {
  auto it = private_.find(id);
  if (it != private_.end()) {
    it->second->use_count++;
    return it->second.get();
  }
  auto pp = std::make_unique<PrivatePool>();
  pp->id = id;
  pp->device = device;
  if (custom) {
    // Note [Custom segment sources]: the pool owns the holder once it is made.
    auto* holder = new CustomSource{std::move(custom)};
    mp_segment_source src{holder, &custom_source_alloc, &custom_source_free,
                          &custom_source_release};
    int rc = api->custom_pool_create(device, &src, &pp->pool);
    if (rc != MP_OK) delete holder;
    TORCH_CHECK(rc == MP_OK,
                cat("mempool: could not create the pool of a MemPool with its own allocator "
                    "on device ", device, " (code ", rc, ")"));
  } else {
    int rc = api->private_pool_create(device, &pp->pool);
    TORCH_CHECK(rc == MP_OK,
                cat("mempool: could not create a private pool (CUDA graph or MemPool) on "
                    "device ", device, ": ",
                    rc == MP_EINVAL ? std::string("no mempool pool is registered for this "
                                                  "device")
                                    : cat("the driver lacks plain allocations (code ", rc,
                                          ")")));
  }
  try {
    std::lock_guard<std::mutex> lock(segment_mu_);   // taken last, as always
    private_owner_[pp->pool] = {device, id};
  } catch (...) {
    api->pool_release(pp->pool);   // new and empty: no segment to free under pools_mu_
    throw;
  }
  PrivatePool* raw = pp.get();
  private_.emplace(id, std::move(pp));
  return raw;
}

// Take out the private pools nobody uses, that hold no live block and that no thread has
// pinned; their core pools are returned, for release_pools once pools_mu_ is dropped.
// Called with pools_mu_.
inline std::vector<mp_pool*> MempoolAllocator::collect_freeable_locked() {
  std::vector<mp_pool*> doomed;
  if (capturing()) return doomed;
  for (auto it = private_.begin(); it != private_.end();) {
    PrivatePool* pp = it->second.get();
    if (pp->use_count == 0 && pp->live_blocks == 0 && pp->pins == 0) {
      if (pp->pool) {
        retire_counts_locked(*pp);
        doomed.push_back(pp->pool);
      }
      it = private_.erase(it);
    } else {
      ++it;
    }
  }
  return doomed;
}

// As PyTorch's allocator: asking after a pool it does not know (never made, or gone) is
// an error, not an empty pool, whose live allocations would match an empty set.
inline void MempoolAllocator::require_pool(c10::DeviceIndex device, MempoolId_t id, const char* what) {
  std::lock_guard<std::mutex> lock(pools_mu_);
  TORCH_CHECK(private_.count(id),
              cat(what, ": Could not find pool of id (", static_cast<unsigned long>(id.first),
                  ", ", static_cast<unsigned long>(id.second),
                  ") on device ", static_cast<int>(device), ": no CUDA graph or MemPool "
                  "of this allocator has it, or it was released and freed"));
}

// PyTorch keeps one set of counters per device, and a graph's or MemPool's pool going
// away frees what it held: its cumulative counts stay. Here the device's counts are the
// sum of its pools', so a private pool about to be destroyed leaves its counts in
// retired_, with everything it still holds (cached segments, their bytes) counted as
// freed, as its destroy frees them. pools_mu_ held.
inline void MempoolAllocator::retire_counts_locked(const PrivatePool& pp) {
  mp_stats st;
  api->pool_stats(pp.pool, &st);
  mp_stats& r = retired_[device_slot(pp.device)];
  for_each_stat(r, st, [](mp_stat& a, const mp_stat& b) {
    a.allocated += b.allocated;
    a.freed += b.freed + b.current;
  });
  r.num_alloc_retries += st.num_alloc_retries;
  r.num_ooms += st.num_ooms;
  r.num_sync_all_streams += st.num_sync_all_streams;
  r.num_device_alloc += st.num_device_alloc;
  r.num_device_free +=   // and one free for each segment its destroy frees
      st.num_device_free + static_cast<uint64_t>(st.segment[MP_STAT_ALL].current);
}

inline std::map<uintptr_t, std::pair<size_t, uintptr_t>> MempoolAllocator::allocated_blocks(MempoolId_t id) {
  std::map<uintptr_t, std::pair<size_t, uintptr_t>> out;
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(id);
    if (it == private_.end()) return out;
  }
  std::vector<PrivatePool*> pinned = pin_pools(id);
  for (PrivatePool* pp : pinned) {
    mp_layout l;
    if (api->pool_layout(pp->pool, &l) != MP_OK) continue;
    for (size_t i = 0; i < l.nblocks; i++)
      if (l.blocks[i].state == MP_BLOCK_ALLOCATED)
        out[l.blocks[i].ptr] = {l.blocks[i].nbytes, l.blocks[i].stream};
    api->layout_free(&l);
  }
  unpin(pinned);
  return out;
}

}  // namespace
