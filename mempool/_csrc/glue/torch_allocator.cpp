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

#include <c10/core/Allocator.h>
#include <c10/core/impl/GPUTrace.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/ApproximateClock.h>
#include <c10/util/Exception.h>
#include <c10/util/env.h>

#include <algorithm>
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

extern "C" {
#include "mp_torch.h"
}
#include "torch_current_device.h"

namespace {

using c10::CachingDeviceAllocator::BlockInfo;
using c10::CachingDeviceAllocator::DeviceStats;
using c10::CachingDeviceAllocator::RecordContext;
using c10::CachingDeviceAllocator::SegmentInfo;
using c10::CachingDeviceAllocator::TraceEntry;
using c10::cuda::CUDACachingAllocator::CUDAAllocator;
using CreateContextFn = c10::CachingDeviceAllocator::CreateContextFn;
using c10::MempoolId_t;

const mp_torch_api* api = nullptr;

// Low bits of a DataPtr's context say where the block lives; blocks are 512-byte aligned.
constexpr uintptr_t kTagMask = 511;
// c10's allocator registry keeps the allocator of the highest priority given for a device
// type; PyTorch registers its own CUDA caching allocator with 0.
constexpr uint8_t kRegistryPriority = 1;
constexpr uintptr_t kTagPrivate = 256;   // a private pool's block: look it up in the map

std::string fmt_size(size_t n) {
  // PyTorch's format_size style: "20.00 MiB".
  char buf[64];
  if (n == SIZE_MAX) return "unlimited";
  if (n < 1024) {
    std::snprintf(buf, sizeof buf, "%zu bytes", n);
  } else if (n < (size_t(1) << 20)) {
    std::snprintf(buf, sizeof buf, "%.2f KiB", n / 1024.0);
  } else if (n < (size_t(1) << 30)) {
    std::snprintf(buf, sizeof buf, "%.2f MiB", n / 1048576.0);
  } else {
    std::snprintf(buf, sizeof buf, "%.2f GiB", n / 1073741824.0);
  }
  return buf;
}

// Messages are built here with snprintf and std::string, and handed to TORCH_CHECK as one
// string: c10::str of several arguments instantiates iostream code in this library, and on
// the H200 every error message built that way crashed inside that code (`<< int` in
// c10::str), while one string is passed through without a stream.
std::string piece(const char* s) { return s; }
std::string piece(const std::string& s) { return s; }
std::string piece(int v) { return std::to_string(v); }
std::string piece(unsigned long v) { return std::to_string(v); }
std::string piece(double v) { return std::to_string(v); }
std::string piece(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%p", p);
  return buf;
}
template <typename... A>
std::string cat(const A&... parts) {
  std::string out;
  ((out += piece(parts)), ...);
  return out;
}

// C10_CUDA_CHECK_WARN, whose header macro hands TORCH_WARN two parts: the same warning, one
// string built here.
void warn_if_cuda_error(cudaError_t err) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();   // clear it, as the macro does
  TORCH_WARN(cat("CUDA warning: ", cudaGetErrorString(err)));
}

// Every counter family PyTorch's DeviceStats and the core's mp_stats share, applied to
// both as f(theirs, ours).
template <typename To, typename From, typename F>
void for_each_stat(To& to, From& from, F f) {
  for (int t = 0; t < MP_STAT_TYPES; t++) {
    f(to.allocation[t], from.allocation[t]);
    f(to.segment[t], from.segment[t]);
    f(to.active[t], from.active[t]);
    f(to.inactive_split[t], from.inactive_split[t]);
    f(to.allocated_bytes[t], from.allocated_bytes[t]);
    f(to.reserved_bytes[t], from.reserved_bytes[t]);
    f(to.active_bytes[t], from.active_bytes[t]);
    f(to.inactive_split_bytes[t], from.inactive_split_bytes[t]);
    f(to.requested_bytes[t], from.requested_bytes[t]);
  }
  f(to.oversize_allocations, from.oversize_allocations);
  f(to.oversize_segments, from.oversize_segments);
}

// counts_only: the cumulative counts (allocated, freed) without current and peak.
void add_stats(DeviceStats& to, const mp_stats& s, bool counts_only = false) {
  for_each_stat(to, s, [counts_only](c10::CachingAllocator::Stat& a, const mp_stat& b) {
    if (!counts_only) {
      a.current += b.current;
      a.peak += b.peak;
    }
    a.allocated += b.allocated;
    a.freed += b.freed;
  });
  to.num_alloc_retries += static_cast<int64_t>(s.num_alloc_retries);
  to.num_ooms += static_cast<int64_t>(s.num_ooms);
  to.num_sync_all_streams += static_cast<int64_t>(s.num_sync_all_streams);
  to.num_device_alloc += static_cast<int64_t>(s.num_device_alloc);
  to.num_device_free += static_cast<int64_t>(s.num_device_free);
}

// A graph's or a MemPool's memory: a core pool of its own (plain segments, legal during
// capture; for a MemPool given its own CUDAAllocator, segments from that allocator, Note
// [Custom segment sources] in mp_torch.c).
struct PrivatePool {
  MempoolId_t id;
  int device = 0;
  mp_pool* pool = nullptr;
  int use_count = 1;
  bool use_on_oom = false;
  int64_t live_blocks = 0;
  // Threads using `pool` or this struct with pools_mu_ dropped (a core call may take long):
  // a pinned pool is not destroyed, so they never touch a freed one.
  int pins = 0;
};

// Allocations routed to a private pool: a capture (its filter tests the stream) or a
// MemPool context on one thread.
struct Route {
  MempoolId_t id;
  std::function<bool(cudaStream_t)> filter;
};

struct CheckpointState : c10::cuda::CUDACachingAllocator::AllocatorState {
  MempoolId_t id;
  int device;
  std::map<uintptr_t, std::pair<size_t, uintptr_t>> blocks;   // address -> (size, stream)
};

struct IdHash {
  size_t operator()(const MempoolId_t& id) const {
    return std::hash<unsigned long long>()(id.first * 1000003ULL ^ id.second);
  }
};

void delete_block(void* ctx);
void uncached_delete(void* ptr);

// Note [GPU trace hooks]
// torch.cuda._gpu_trace's callbacks, and the CUDA sanitizer built on them
// (TORCH_CUDA_SANITIZER=1, torch.cuda._sanitizer), hear of each block handed out and each
// block given back, as PyTorch's own allocator tells them from its malloc (after) and free
// (before). The sanitizer keeps every access it saw by address: without these calls a block
// the pool hands out again inherited its last tensor's accesses, and the first write of the
// new tensor was reported as a race with streams that had used the old one. One load while
// no tracer is active (GPUTrace::get_trace); the callbacks run Python, so no lock is held.
void tell_gpu_trace_alloc(void* ptr) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp && ptr))
    (*interp)->trace_gpu_memory_allocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
}

void tell_gpu_trace_free(void* ptr) {
  const c10::impl::PyInterpreter* interp = c10::impl::GPUTrace::get_trace();
  if (C10_UNLIKELY(interp && ptr))
    (*interp)->trace_gpu_memory_deallocation(c10::kCUDA, reinterpret_cast<uintptr_t>(ptr));
}

// Note [Custom segment sources] (mp_torch.c): a MemPool's own allocator as the segment
// source of its pool. The callbacks run inside the core's calls, so no exception may leave
// them: an allocator's out-of-memory error, or a null pointer, is MP_ENOMEM; any other
// error is MP_EUPSTREAM (the request then fails as the pool's out-of-memory error).
struct CustomSource {
  std::shared_ptr<CUDAAllocator> allocator;
};

int custom_source_alloc(void* ctx, size_t nbytes, uintptr_t stream, uintptr_t* out) {
  try {
    void* p = static_cast<CustomSource*>(ctx)->allocator->raw_alloc_with_stream(
        nbytes, reinterpret_cast<cudaStream_t>(stream));
    if (!p) return MP_ENOMEM;
    *out = reinterpret_cast<uintptr_t>(p);
    return MP_OK;
  } catch (const c10::OutOfMemoryError&) {
    return MP_ENOMEM;
  } catch (...) {
    return MP_EUPSTREAM;
  }
}

void custom_source_free(void* ctx, uintptr_t ptr, size_t, uintptr_t) {
  try {
    static_cast<CustomSource*>(ctx)->allocator->raw_delete(reinterpret_cast<void*>(ptr));
  } catch (...) {
    // A free the allocator refuses leaves it its memory: nothing else to do here.
  }
}

void custom_source_release(void* ctx) { delete static_cast<CustomSource*>(ctx); }

// PyTorch 2.12 made attachOomRejectionObserver a pure virtual of CUDAAllocator: observers of
// the requests its throw_on_cudamalloc_oom policy refuses, under its memory fraction, before
// the driver is asked. The glue compiles against whichever PyTorch is installed, so the
// method is declared only where the base has it; elsewhere nothing can attach an observer
// and notify_oom_rejection does nothing.
template <typename Method>
struct ObserverOf;
template <typename C, typename Observer>
struct ObserverOf<void (C::*)(Observer)> {
  using type = Observer;
};

template <typename Base, typename = void>
class WithOomRejection : public Base {
 protected:
  void notify_oom_rejection(int64_t, size_t, size_t, size_t) {}
};

template <typename Base>
class WithOomRejection<Base, std::void_t<decltype(&Base::attachOomRejectionObserver)>>
    : public Base {
 public:
  using Observer = typename ObserverOf<decltype(&Base::attachOomRejectionObserver)>::type;
  void attachOomRejectionObserver(Observer observer) override {
    std::lock_guard<std::mutex> lock(rejection_mu_);
    rejection_observers_.push_back(std::move(observer));
  }

 protected:
  // PyTorch's arguments: the device, the size asked for, what the allocator held before the
  // request and the device's total memory. Called without locks (an observer may allocate).
  void notify_oom_rejection(int64_t device, size_t nbytes, size_t held, size_t total) {
    std::vector<Observer> observers;
    {
      std::lock_guard<std::mutex> lock(rejection_mu_);
      observers = rejection_observers_;
    }
    for (auto& observer : observers) observer(device, nbytes, held, total);
  }

 private:
  std::mutex rejection_mu_;
  std::vector<Observer> rejection_observers_;
};

class MempoolAllocator final : public WithOomRejection<CUDAAllocator> {
  // Stacks by address: of live blocks, or of the segments they were allocated with.
  using Contexts = std::unordered_map<uintptr_t, std::shared_ptr<c10::GatheredContext>>;

 public:
  // ---- data path ---------------------------------------------------------------------
  c10::DataPtr allocate(size_t nbytes) override {
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

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    C10_CUDA_CHECK(cudaMemcpy(dest, src, count, cudaMemcpyDeviceToDevice));
  }

  void* raw_alloc(size_t nbytes) override {
    if (nbytes == 0) return nullptr;
    c10::DeviceIndex device = mempool_torch::current_device();
    return raw_alloc_on(device, nbytes, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override {
    if (nbytes == 0) return nullptr;
    return raw_alloc_on(mempool_torch::current_device(), nbytes, stream);
  }

  void raw_delete(void* ptr) override {
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
  bool free_tagged(uintptr_t ctx) {
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
  void report_to_profiler(int device, uintptr_t ptr, int64_t delta) {
    size_t f[MP_TORCH_FIGURES];
    if (api->memory_figures(device, f) != MP_OK) return;
    c10::reportMemoryUsageToProfiler(
        reinterpret_cast<void*>(ptr), delta, f[1], f[0],
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  }
  // The same with the size of the live block at ptr (taken before its free).
  void report_to_profiler(int device, uintptr_t ptr, MempoolId_t pool, int sign) {
    int64_t nbytes = static_cast<int64_t>(block_facts(device, ptr, pool).nbytes);
    report_to_profiler(device, ptr, sign * nbytes);
  }

  void init(int device_count) override { device_count_ = device_count; }
  bool initialized() override { return true; }

  // ---- limits and caches ---------------------------------------------------------------
  double getMemoryFraction(c10::DeviceIndex device) override {
    size_t f[MP_TORCH_FIGURES];
    check_device(device, api->memory_figures(device, f), "getMemoryFraction");
    if (f[4] == SIZE_MAX || f[5] == 0) return 1.0;
    return static_cast<double>(f[4]) / static_cast<double>(f[5]);
  }

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override {
    TORCH_CHECK(fraction >= 0.0 && fraction <= 1.0,
                cat("invalid fraction: ", fraction, ". Please set within [0, 1]."));
    size_t f[MP_TORCH_FIGURES];
    check_device(device, api->memory_figures(device, f), "setMemoryFraction");
    size_t limit = fraction >= 1.0 ? SIZE_MAX
                                   : static_cast<size_t>(fraction * static_cast<double>(f[5]));
    check_device(device, api->set_limit(device, limit), "setMemoryFraction");
  }

  void emptyCache(MempoolId_t mempool_id) override {
    if (capturing()) return;   // releases wait for the end of every capture
    // As PyTorch's own: a private pool gives its cache back only once nothing uses it (its
    // graph destroyed, its MemPool gone). The free blocks of a live graph's pool are the
    // memory its replays write (the capture's intermediates), and a live MemPool keeps its
    // cache; emptying them made the next replay fault on freed memory.
    empty_unused_pools(mempool_id, -1);   // and destroys those that hold no live block
    if (mempool_id == MempoolId_t{0, 0}) {
      for (int d = 0; d < api->max_devices && d < device_limit(); d++) api->empty_cache(d);
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

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override {
    // As PyTorch's own: free device memory as the first guess when *largest is 0 (cuDNN
    // benchmark sizes its workspace from this), then the largest cached block. A pool
    // limit caps the guess at what the limit still allows.
    size_t f[MP_TORCH_FIGURES];
    if (api->memory_figures(device, f) != MP_OK) return;
    if (*largest == 0) {
      size_t free_bytes = 0, total = 0;
      if (api->mem_info(device, &free_bytes, &total) == MP_OK) *largest = free_bytes;
      if (f[4] != SIZE_MAX) *largest = std::min(*largest, f[4] > f[0] ? f[4] - f[0] : 0);
    }
    *largest = std::max(*largest, f[3]);
    std::lock_guard<std::mutex> lock(pools_mu_);
    for (auto& [key, pp] : private_)
      if (pp->pool && pp->device == device)
        *largest = std::max(*largest, api->pool_largest_free_block(pp->pool));
  }

  void* getBaseAllocation(void* ptr, size_t* size) override {
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

  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override {
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

  // ---- statistics ------------------------------------------------------------------------
  DeviceStats getDeviceStats(c10::DeviceIndex device) override {
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
    size_t f[MP_TORCH_FIGURES];
    if (api->memory_figures(device, f) == MP_OK)
      out.max_split_size = static_cast<int64_t>(f[6]);   // SIZE_MAX reads -1, as PyTorch's
    return out;
  }

  void resetAccumulatedStats(c10::DeviceIndex device) override {
    check_device(device, api->reset_accumulated_stats(device), "resetAccumulatedStats");
    oom_tried_again_[device_slot(device)].store(0, std::memory_order_relaxed);
    oom_retries_[device_slot(device)].store(0, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(pools_mu_);
    retired_[device_slot(device)] = mp_stats{};
    for (auto& [key, pp] : private_)
      if (pp->pool && pp->device == device) api->pool_reset_accumulated_stats(pp->pool);
  }

  void resetPeakStats(c10::DeviceIndex device) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    std::vector<mp_pool*> pools = private_pools_locked(device);
    check_device(device, api->device_reset_peak_stats(device, pools.data(), pools.size()),
                 "resetPeakStats");
  }

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override {
    size_t free_bytes = 0, total = 0;
    check_device(device, api->mem_info(device, &free_bytes, &total), "getMemoryInfo");
    return {free_bytes, total};
  }

  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override {
    // The pool's expandable segments grow by pages, not by PyTorch's per-stream sizes.
    return {};
  }

  // Note [Caching off]
  // torch.cuda.caching_allocator_enable(False), as PyTorch's own allocator takes it: from then on
  // every allocation is the driver's own cudaMalloc and every free its cudaFree, outside the pool
  // and its statistics (what memcheck needs to see each tensor's bounds, and what PyTorch's
  // raw_alloc test checks). Blocks handed out before keep their pool; those handed out while
  // caching is off are freed by the driver whenever they die, caching back on or not: a tensor's
  // carries uncached_delete, and raw_alloc's pointers are remembered until raw_delete (a set,
  // looked up only while it holds any). The pool's fast path pays one relaxed load of enabled_.
  void enable(bool value) override { enabled_.store(value, std::memory_order_relaxed); }
  bool isEnabled() const override { return enabled_.load(std::memory_order_relaxed); }

  // ---- snapshots and history -----------------------------------------------------------
  c10::cuda::CUDACachingAllocator::SnapshotInfo snapshot(MempoolId_t mempool_id,
                                                         bool include_traces) override {
    // Value-initialized: the settings PyTorch pickles as allocator_settings (its own config's
    // fields: the garbage collection threshold, the pinned-memory options...) are plain
    // members with no initializer, and those this allocator does not set were garbage.
    c10::cuda::CUDACachingAllocator::SnapshotInfo info{};
    Contexts contexts;
    Contexts segment_contexts;
    flush_segments();
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      contexts = live_contexts_;
      segment_contexts = segment_contexts_;
      if (include_traces) {
        info.device_traces.resize(std::max(device_count_, 1));
        for (const TraceEntry& e : trace_) {
          if (e.device_ >= 0 && e.device_ < static_cast<int>(info.device_traces.size()))
            info.device_traces[e.device_].push_back(e);
        }
        info.external_annotations.assign(annotations_.begin(), annotations_.end());
      }
    }
    // The copies' times from the approximate clock to µs since the epoch (PyTorch's form).
    auto tsc_to_ns = clock_converter_.makeConverter();
    for (auto& trace : info.device_traces)
      for (TraceEntry& e : trace) e.time_.t_ = tsc_to_ns(e.time_.approx_t_) / 1000;
    for (auto& a : info.external_annotations) a.time_.t_ = tsc_to_ns(a.time_.approx_t_) / 1000;
    if (mempool_id == MempoolId_t{0, 0}) {
      for (int d = 0; d < device_limit(); d++) {
        mp_layout l;
        if (api->layout(d, &l) != MP_OK) continue;
        add_segments(info, l, d, {0, 0}, contexts, segment_contexts);
        api->layout_free(&l);
      }
    }
    std::vector<PrivatePool*> pinned = pin_pools(mempool_id);
    for (PrivatePool* pp : pinned) {
      mp_layout l;
      if (api->pool_layout(pp->pool, &l) != MP_OK) continue;
      add_segments(info, l, pp->device, pp->id, contexts, segment_contexts);
      api->layout_free(&l);
    }
    unpin(pinned);
    // As PyTorch's: each device's segments in address order, graphs' and MemPools' among
    // the device pool's, and, while anything is traced, a snapshot entry per device.
    std::stable_sort(info.segments.begin(), info.segments.end(),
                     [](const SegmentInfo& a, const SegmentInfo& b) {
                       return a.device != b.device ? a.device < b.device
                                                   : a.address < b.address;
                     });
    record_snapshot_entries(info);
    mp_config cfg;
    if (api->config(0, &cfg) == MP_OK) {   // PyTorch's keys: MP_UNLIMITED is its SIZE_MAX too
      info.config_metadata.max_split_size = cfg.max_split_size;
      info.config_metadata.garbage_collection_threshold = cfg.gc_threshold;
      info.config_metadata.roundup_power2_divisions.assign(
          cfg.roundup_divisions, cfg.roundup_divisions + MP_ROUNDUP_INTERVALS);
    }
    info.config_metadata.last_allocator_settings = "mempool";
    for (const SegmentInfo& seg : info.segments)   // a pool with nothing mapped shows none
      if (seg.is_expandable) info.config_metadata.expandable_segments = true;
    return info;
  }

  bool isHistoryEnabled() override { return history_on_.load(); }

  // The snapshot entry of each device, as PyTorch's allocator records one per device at
  // each snapshot, its size the active bytes of the device's segments in the snapshot:
  // given to trackers and, while history is on, kept. PyTorch's snapshot copies a device's
  // trace before it records the entry, so the entry shows in later snapshots, not in this
  // one (whose trace would otherwise end with an entry of the metadata set after the
  // recording, which PyTorch's own test_memory_plots_metadata refuses).
  void record_snapshot_entries(const c10::cuda::CUDACachingAllocator::SnapshotInfo& info) {
    if (!tracing_.load()) return;
    std::vector<size_t> active(device_limit(), 0);
    for (const SegmentInfo& seg : info.segments)
      if (seg.device >= 0 && seg.device < device_limit()) active[seg.device] += seg.active_size;
    std::lock_guard<std::mutex> lock(history_mu_);
    for (int device = 0; device < device_limit(); device++)
      push_trace_locked("snapshot",
                        entry_locked(TraceEntry::SNAPSHOT, device, 0, active[device], nullptr,
                                     {0, 0}, c10::getApproximateTime(), nullptr));
  }

  void recordHistory(bool enabled, CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    // Clearing drops what was recorded, not what lives: as PyTorch's allocator keeps a
    // block's stacks on the block, a live block's stay in the snapshot (Note [Kept block
    // stacks]) until its free.
    if (clearHistory) {
      trace_.clear();
      annotations_.clear();
    }
    // As PyTorch's own allocator: turning history off drops the trace recorded so far (a
    // snapshot is taken before), so the next recording starts empty.
    if (!enabled) {
      trace_.clear();
      annotations_.clear();
    }
    if ((clearHistory || !enabled) && trackers_.empty()) {
      std::lock_guard<std::mutex> segments(segment_mu_);   // history_mu_, then segment_mu_
      pending_segments_.clear();
    }
    // Untraced from now on, a segment's free goes unseen: its stacks would be shown for a
    // later segment at its address (as Note [Kept block stacks] for blocks), so they go.
    if (!enabled && trackers_.empty()) segment_contexts_.clear();
    record_when_ = enabled ? when : RecordContext::NEVER;
    context_recorder_ = enabled ? context_recorder : nullptr;
    max_entries_ = std::max<size_t>(alloc_trace_max_entries, 1);
    skip_.clear();
    for (const std::string& a : skip_actions) skip_.insert(a);
    while (trace_.size() > max_entries_) trace_.pop_front();
    while (annotations_.size() > max_entries_) annotations_.pop_front();
    history_on_.store(enabled);
    tracing_.store(enabled || !trackers_.empty());
  }

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override {
    if (!history_on_.load()) return;
    Annotation entry(c10::cuda::current_device(), c10::getApproximateTime());
    for (const auto& [name, value] : md) entry.recordUserMetadata(name, value);
    std::lock_guard<std::mutex> lock(history_mu_);
    annotations_.push_back(std::move(entry));
    while (annotations_.size() > max_entries_) annotations_.pop_front();
  }
  void pushCompileContext(std::string& md) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    compile_contexts_.push_back(md);
  }
  void popCompileContext() override {
    std::lock_guard<std::mutex> lock(history_mu_);
    if (!compile_contexts_.empty()) compile_contexts_.pop_back();
  }
  void setUserMetadata(const std::string& metadata) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    user_metadata_ = metadata;
  }
  std::string getUserMetadata() override {
    std::lock_guard<std::mutex> lock(history_mu_);
    return user_metadata_;
  }

  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    oom_observers_.push_back(std::move(observer));
  }

  void attachAllocatorTraceTracker(
      c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) override {
    std::lock_guard<std::mutex> lock(history_mu_);
    trackers_.push_back(std::move(tracker));
    tracing_.store(true);   // trackers see every entry, history or not, as PyTorch's do
    trackers_attached_.store(true, std::memory_order_release);
  }

  // ---- CUDA graphs and MemPools ------------------------------------------------------------
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override {
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
  }

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
    bool found = false;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
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
  }

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override {
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

  int getPoolUseCount(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(mempool_id);
    return it == private_.end() ? 0 : it->second->use_count;
  }

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CUDAAllocator> allocator) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    create_or_incref_locked(device, mempool_id, std::move(allocator));
  }

  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t mempool_id, bool use_on_oom) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(mempool_id);
    TORCH_CHECK(it != private_.end(), "setUseOnOOM: no pool with this id");
    it->second->use_on_oom = use_on_oom;
  }

  // MemPool(no_split=True): the pool hands out whole blocks (Note [No split], mp_core.c).
  void setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) override {
    std::lock_guard<std::mutex> lock(pools_mu_);
    auto it = private_.find(mempool_id);
    TORCH_CHECK(it != private_.end(), "setNoSplit: no pool with this id");
    int rc = api->pool_set_no_split(it->second->pool);
    TORCH_CHECK(rc == MP_OK, cat("mempool: MemPool(no_split=True) could not be set on its pool "
                                 "(code ", rc, ")"));
  }

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override {
    require_pool(device, mempool_id, "checkPoolLiveAllocations");
    auto live = allocated_blocks(mempool_id);
    if (live.size() != expected.size()) return false;
    for (void* p : expected)
      if (!live.count(reinterpret_cast<uintptr_t>(p))) return false;
    return true;
  }

  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, MempoolId_t id) override {
    require_pool(device, id, "getCheckpointState");
    auto state = std::make_shared<CheckpointState>();
    state->id = id;
    state->device = device;
    state->blocks = allocated_blocks(id);
    return state;
  }

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override {
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

  // ---- IPC and peers ---------------------------------------------------------------------
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    // What _share_cuda_ asks for a tensor's storage. As PyTorch's allocator, memory the pool
    // did not hand out (DLPack's, another allocator's) is an invalid device pointer.
    getBaseAllocation(ptr, nullptr);
    TORCH_CHECK(false, cat("mempool: sharing a CUDA tensor with another process "
                           "(torch.multiprocessing, tensor.share_memory_) is not supported: "
                           "the pool's memory (", static_cast<const void*>(ptr), ") comes "
                           "from a cudaMemPool whose allocations have no legacy IPC handle. "
                           "Receiving tensors from a process on PyTorch's own allocator "
                           "works."));
  }

  // The receiving side of torch.multiprocessing. PyTorch 2.11's own allocator sends a
  // version byte, a kind byte ('c': a cudaIpcMemHandle follows; 'e': its expandable
  // segments' file-descriptor protocol, which only its own allocator can open) and the
  // handle; older versions send the 64-byte handle alone. A handle is opened once per
  // process (CUDA refuses a second open) and shared by every tensor built from it while any
  // lives, as PyTorch does.
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override {
    size_t skip = 0;
    if (handle.size() == CUDA_IPC_HANDLE_SIZE + 2) {
      TORCH_CHECK(handle[1] == 'c',
                  cat("mempool: this CUDA IPC handle comes from PyTorch's expandable segments "
                      "(kind byte ", static_cast<int>(handle[1]), "), which only PyTorch's own "
                      "allocator can open; the sender can share it after "
                      "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False, or run on mempool"));
      skip = 2;
    } else {
      TORCH_CHECK(handle.size() == CUDA_IPC_HANDLE_SIZE,
                  cat("mempool: this CUDA IPC handle (", handle.size(), " bytes) is neither a "
                      "cudaIpcMemHandle (", CUDA_IPC_HANDLE_SIZE, " bytes) nor PyTorch's "
                      "versioned form of one (", CUDA_IPC_HANDLE_SIZE + 2, " bytes)"));
    }
    std::lock_guard<std::mutex> lock(ipc_mu_);
    for (auto it = ipc_open_.begin(); it != ipc_open_.end();)   // forget closed handles
      it = it->second.expired() ? ipc_open_.erase(it) : std::next(it);
    auto found = ipc_open_.find(handle);
    if (found != ipc_open_.end()) {
      if (auto open = found->second.lock()) return open;
    }
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data() + skip, CUDA_IPC_HANDLE_SIZE);
    void* dev_ptr = nullptr;
    C10_CUDA_CHECK(cudaIpcOpenMemHandle(&dev_ptr, h, cudaIpcMemLazyEnablePeerAccess));
    // As PyTorch's deleter: closed on the device it was opened on (the current one then),
    // under ipc_mu_, so that no thread opens the handle again while it is being closed; the
    // entry goes unless a later opening already replaced it.
    c10::DeviceIndex device = c10::cuda::current_device();
    std::shared_ptr<void> open(dev_ptr, [this, handle, device](void* p) {
      try {   // a deleter must not throw (the guard may, at exit)
        c10::cuda::CUDAGuard guard(device);
        std::lock_guard<std::mutex> lock(ipc_mu_);
        warn_if_cuda_error(cudaIpcCloseMemHandle(p));
        auto it = ipc_open_.find(handle);
        if (it != ipc_open_.end() && it->second.expired()) ipc_open_.erase(it);
      } catch (...) {
      }
    });
    ipc_open_[handle] = open;
    return open;
  }

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override {
    c10::cuda::CUDAGuard guard(dev);
    cudaError_t err = cudaDeviceEnablePeerAccess(dev_to_access, 0);
    if (err == cudaErrorPeerAccessAlreadyEnabled) {
      (void)cudaGetLastError();
    } else {
      C10_CUDA_CHECK(err);
    }
    // Contexts' peer access does not reach pool memory: grant the pool's own.
    (void)api->enable_peer_access(dev_to_access, dev);
  }

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override {
    if (p2p_enabled || dstDevice == srcDevice)
      return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
    return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
  }

  std::string name() override { return "mempool"; }

 private:
  std::mutex ipc_mu_;   // guards ipc_open_
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_open_;   // handle -> its mapping

  // raw_alloc's and raw_alloc_with_stream's block: the pool's, or the driver's while caching
  // is off; the GPU trace hears of it either way (Note [GPU trace hooks]).
  void* raw_alloc_on(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream) {
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

  // ---- caching off (Note [Caching off]) -------------------------------------------------
  void* uncached_alloc(c10::DeviceIndex device, size_t nbytes) {
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

  void* uncached_raw_alloc(c10::DeviceIndex device, size_t nbytes) {
    void* ptr = uncached_alloc(device, nbytes);
    std::lock_guard<std::mutex> lock(uncached_mu_);
    uncached_raw_.insert(reinterpret_cast<uintptr_t>(ptr));
    n_uncached_raw_.store(static_cast<int64_t>(uncached_raw_.size()), std::memory_order_release);
    return ptr;
  }

  bool forget_uncached_raw(void* ptr) {
    std::lock_guard<std::mutex> lock(uncached_mu_);
    if (!uncached_raw_.erase(reinterpret_cast<uintptr_t>(ptr))) return false;
    n_uncached_raw_.store(static_cast<int64_t>(uncached_raw_.size()), std::memory_order_release);
    return true;
  }

  // ---- allocation ------------------------------------------------------------------------
  void* alloc_on(int device, size_t nbytes, cudaStream_t stream, uintptr_t* tag) {
    if (n_routes_[device_slot(device)].load(std::memory_order_acquire) > 0) {
      PrivatePool* pp = route(device, stream);
      if (pp) {
        *tag = kTagPrivate;
        return alloc_private(pp, nbytes, stream);
      }
    }
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
  void* served(int device, uintptr_t out, size_t nbytes, cudaStream_t stream, uintptr_t* tag) {
    *tag = static_cast<uintptr_t>(device) + 1;
    if (tracing_.load(std::memory_order_relaxed))
      record_alloc(device, out, nbytes, stream, {0, 0});
    if (C10_UNLIKELY(c10::memoryProfilingEnabled())) report_to_profiler(device, out, {0, 0}, 1);
    return reinterpret_cast<void*>(out);
  }

  static bool out_of_memory(int rc) { return rc == MP_ENOMEM || rc == MP_ELIMIT; }

  // The pools count each refusal as an OOM; PyTorch counts one per request that fails in
  // the end (an OOM raised), and a retry after releasing cached memory as a retry. So a
  // refusal followed by another try (the retry below, a use_on_oom MemPool) is taken off
  // num_ooms in getDeviceStats, and the retry counted.
  void note_another_try(int device, bool retry) {
    oom_tried_again_[device_slot(device)].fetch_add(1, std::memory_order_relaxed);
    if (retry) oom_retries_[device_slot(device)].fetch_add(1, std::memory_order_relaxed);
  }

  // The device pool's request again, counted as PyTorch counts it (note_another_try).
  int try_again(int device, size_t nbytes, cudaStream_t stream, uintptr_t* out, bool retry) {
    note_another_try(device, retry);
    return api->alloc(device, nbytes, reinterpret_cast<uintptr_t>(stream), out);
  }

  // Note [Free memory callbacks]
  // PyTorch's allocator runs every callback of c10's FreeCudaMemoryCallbacksRegistry when its
  // cache has no block for a request, and searches again if one freed memory: memory that
  // code outside the allocator holds and can let go of (PyTorch's own is CUDA IPC's
  // "cuda_ipc_collect", which frees a producer's shared blocks once every consumer has let
  // them go; under the pool a process does not share its tensors, shareIpcHandle, so that
  // one has nothing to free, but an extension may register its own). The glue cannot tell a
  // miss of the pool from a hit without a call into the core on every allocation, so it
  // runs them when the device's pool refuses a request, and tries once more when one freed
  // anything: the request is served before it fails. The callbacks free through this
  // allocator, and no lock of the glue is held while they run.
  static bool run_free_memory_callbacks() {
    bool freed = false;
    for (const std::string& name : c10::FreeCudaMemoryCallbacksRegistry()->Keys())
      freed |= c10::FreeCudaMemoryCallbacksRegistry()->Create(name)->Execute();
    return freed;
  }

  // Note [Memory other pools hold at OOM]
  // A pool that runs out has released its own cache already (the core's chain), but the
  // device or the shared limit (Note [Shared limit], mp_release.c) may be full of the free
  // blocks of private pools nobody uses any more: a graph or MemPool released while tensors
  // of it lived keeps the blocks of their later frees. As PyTorch's allocator frees its
  // "freeable" graph pools before it raises, their caches go back (those that hold no live
  // block go whole) and the request is tried once more. A live graph's or MemPool's free
  // blocks stay (its replays write there; a MemPool keeps its cache). Nothing is released
  // while a capture or pool context is open anywhere (capturing()): PyTorch's allocator
  // does not release its own cache then either, and a MemPool's request, which is made only
  // in such a context, is never retried. Returns whether any cache was emptied.
  bool release_unused_pools_for_oom(int device) {
    if (capturing()) return false;
    return empty_unused_pools(MempoolId_t{0, 0}, device);
  }

  // Empty the caches of the private pools whose use count is 0 (of one pool id, or all for
  // {0, 0}; of one device, or all for -1), and destroy those that hold no live block.
  bool empty_unused_pools(MempoolId_t mempool_id, int device) {
    std::vector<PrivatePool*> pinned = pin_pools(mempool_id, /*unused_only=*/true, device);
    for (PrivatePool* pp : pinned) api->pool_empty_cache(pp->pool);
    unpin(pinned);
    if (!pinned.empty()) note_private_change_everywhere();
    return !pinned.empty();
  }

  // As PyTorch's allocator does, the newest route whose filter takes the stream wins: a graph
  // captured inside a use_mem_pool context allocates to the graph's pool, not to the
  // MemPool, whose later allocations would otherwise reuse memory the graph replays into.
  // The filters run under pools_mu_, which endAllocateToPool takes to remove a route: a
  // graph's filter reads the graph, and the graph may be destroyed once its route is gone.
  // (They call the CUDA runtime, never this allocator.)
  PrivatePool* route(int device, cudaStream_t stream) {
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
  void* try_alloc_private(PrivatePool* pp, size_t nbytes, cudaStream_t stream, int* rc) {
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

  void* alloc_private(PrivatePool* pp, size_t nbytes, cudaStream_t stream) {
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
  void* alloc_use_on_oom(int device, size_t nbytes, cudaStream_t stream) {
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

  // True when ptr was a private pool's block (now freed).
  bool free_private(uintptr_t ptr) {
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

  // One block fewer counts in pp (freed, or never made); destroys the pools nobody uses.
  void drop_live_block(PrivatePool* pp) {
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
  std::vector<PrivatePool*> pin_pools(MempoolId_t mempool_id, bool unused_only = false,
                                      int device = -1) {
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

  void unpin(const std::vector<PrivatePool*>& pinned) {
    std::vector<mp_pool*> doomed;
    {
      std::lock_guard<std::mutex> lock(pools_mu_);
      for (PrivatePool* pp : pinned) pp->pins--;
      doomed = collect_freeable_locked();
    }
    release_pools(doomed);
  }

  // Destroying a core pool frees its segments (cuMemFree synchronizes): never under pools_mu_.
  void release_pools(const std::vector<mp_pool*>& doomed) {
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
  std::vector<mp_pool*> private_pools_locked(int device) {
    std::vector<mp_pool*> pools;
    for (auto& [key, pp] : private_)
      if (pp->pool && pp->device == device) pools.push_back(pp->pool);
    return pools;
  }

  // Note [Device peaks] (mp_torch.c): after every allocation and free of a private pool,
  // and when private pools release memory or go, the device's peaks take in the stretch
  // that ends here. Without pools_mu_ held.
  void note_private_change(int device) {
    std::lock_guard<std::mutex> lock(pools_mu_);
    std::vector<mp_pool*> pools = private_pools_locked(device);
    (void)api->private_event(device, pools.data(), pools.size());   // MP_EINVAL: no pool
  }

  void note_private_change_everywhere() {
    for (int d = 0; d < device_limit(); d++) note_private_change(d);
  }

  // private_id: the private pool that refused, or nullptr for the device's pool.
  [[noreturn]] void throw_oom(int device, size_t nbytes, cudaStream_t stream, int rc,
                              const MempoolId_t* private_id) {
    size_t f[MP_TORCH_FIGURES] = {0, 0, 0, 0, SIZE_MAX, 0, SIZE_MAX};
    (void)api->memory_figures(device, f);
    size_t free_bytes = 0, total = 0;
    (void)api->mem_info(device, &free_bytes, &total);
    std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> observers;
    std::shared_ptr<c10::GatheredContext> ctx;   // the stacks of the failed allocation
    if (tracing_.load()) {
      RecordContext when;
      ctx = gather_context(RecordContext::STATE, &when);
    }
    flush_segments();   // what the OOM chain released comes before the oom entry
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      observers = oom_observers_;
      if (tracing_.load())
        push_trace_locked("oom",
                          entry_locked(TraceEntry::OOM, device, free_bytes, nbytes, stream,
                                       private_id ? *private_id : MempoolId_t{0, 0},
                                       c10::getApproximateTime(), std::move(ctx)));
    }
    // PyTorch's arguments: the device, the size asked for, the most the device may hold (the
    // limit when one is set, as PyTorch's memory fraction) and the device's free bytes.
    size_t allowed = f[4] != SIZE_MAX ? f[4] : total;
    // The profiler's memory timeline marks the OOM ("[OutOfMemory]"), as PyTorch's reports
    // it: the size asked for, then the device's allocated and reserved bytes.
    c10::reportOutOfMemoryToProfiler(
        static_cast<int64_t>(nbytes), f[1], f[0],
        c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
    for (auto& observer : observers) observer(device, nbytes, allowed, free_bytes);
    // A limit refuses before the driver is asked, always: what PyTorch's allocator does
    // only with throw_on_cudamalloc_oom set, whose observers hear of it.
    if (rc == MP_ELIMIT) notify_oom_rejection(device, nbytes, f[0], total);
    std::string where;
    if (rc == MP_ELIMIT) {
      where = "the pool's limit of " + fmt_size(f[4]) + " (set_per_process_memory_fraction "
              "or the pool's 'limit')";
    } else if (rc == MP_ENOMEM) {
      where = "the device";
    } else {
      where = "an upstream error (code " + std::to_string(rc) + ")";
    }
    std::string hint;
    bool fragmented = f[2] >= nbytes && f[3] < nbytes;
    if (fragmented)
      hint = "free memory is fragmented: expandable_segments:True in MEMPOOL_CONF lets free "
             "neighbours merge";
    else if (rc == MP_ELIMIT)
      hint = "raise the limit, or free memory";
    else
      hint = "free memory, reduce the batch, or cap other processes on the device";
    TORCH_CHECK_WITH(OutOfMemoryError, false, oom_message(device, nbytes, free_bytes, total, f,
                                                          private_id != nullptr, where, hint));
  }

  // The first sentences are PyTorch's own, in its words and order ("CUDA out of memory.
  // Tried to allocate 20.00 MiB. GPU 0 has a total capacity of ..."), since scripts and
  // libraries match them: Hugging Face Accelerate's find_executable_batch_size halves the
  // batch only for a message holding "CUDA out of memory.", and PyTorch's own tests look for
  // "Tried to allocate ... GPU 0 has a total capacity of". So is its refusal of a request
  // of 1 EiB or more. The pool's own explanation follows.
  static std::string oom_message(int device, size_t nbytes, size_t free_bytes, size_t total,
                                 const size_t* f, bool is_private, const std::string& where,
                                 const std::string& hint) {
    constexpr size_t kOneExaByte = size_t(1) << 60;
    std::string head = nbytes >= kOneExaByte
        ? std::string("CUDA out of memory. Tried to allocate more than 1EB memory. ")
        : cat("CUDA out of memory. Tried to allocate ", fmt_size(nbytes), ". GPU ", device,
              " has a total capacity of ", fmt_size(total), " of which ", fmt_size(free_bytes),
              " is free. ", f[4] != SIZE_MAX ? fmt_size(f[4]) + " allowed; " : std::string(),
              "Of the allocated memory ", fmt_size(f[1]), " is allocated by PyTorch, and ",
              fmt_size(f[0] > f[1] ? f[0] - f[1] : 0),
              " is reserved by PyTorch but unallocated. ");
    return cat(head, "mempool", is_private ? " (a CUDA-graph/MemPool private pool)" : "",
               ": ", fmt_size(nbytes), " refused by ", where, "; the pool has ",
               fmt_size(f[0]), " reserved, ", fmt_size(f[1]), " allocated (PyTorch's and any "
               "other library's on this pool), ", fmt_size(f[2]),
               " cached; largest free block ", fmt_size(f[3]), ". Hint: ", hint, ".");
  }

  // ---- private pools ---------------------------------------------------------------------
  PrivatePool* create_or_incref_locked(int device, MempoolId_t id,
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
  std::vector<mp_pool*> collect_freeable_locked() {
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
  void require_pool(c10::DeviceIndex device, MempoolId_t id, const char* what) {
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
  void retire_counts_locked(const PrivatePool& pp) {
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

  std::map<uintptr_t, std::pair<size_t, uintptr_t>> allocated_blocks(MempoolId_t id) {
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

  // ---- history ---------------------------------------------------------------------------
  // The stacks of this call when history records them from `minimum` on, else nullptr. The
  // recorder gathers Python and C++ stacks (it takes the GIL itself): no lock is held.
  std::shared_ptr<c10::GatheredContext> gather_context(RecordContext minimum,
                                                       RecordContext* when) {
    CreateContextFn recorder;
    {
      std::lock_guard<std::mutex> lock(history_mu_);
      recorder = context_recorder_;
      *when = record_when_;
    }
    return recorder && *when != RecordContext::NEVER && *when >= minimum ? recorder() : nullptr;
  }

  void record_alloc(int device, uintptr_t ptr, size_t nbytes, cudaStream_t stream,
                    MempoolId_t pool) {
    RecordContext when;
    std::shared_ptr<c10::GatheredContext> ctx = gather_context(RecordContext::STATE, &when);
    // The segment this allocation made comes before it, with its stacks (Note [Segment
    // event stacks]).
    flush_segments(when >= RecordContext::ALLOC ? ctx : nullptr,
                   when >= RecordContext::ALL ? ctx : nullptr);
    std::lock_guard<std::mutex> lock(history_mu_);
    if (ctx) {
      live_contexts_[ptr] = ctx;
      contexts_kept_.store(true, std::memory_order_relaxed);
    } else {
      erase_context_locked(ptr);
    }
    push_trace_locked("alloc", entry_locked(TraceEntry::ALLOC, device, ptr, nbytes, stream,
                                            pool, c10::getApproximateTime(), ctx));
  }

  // Called before the block is freed. As PyTorch's allocator records a free: the size the
  // block was allocated for (the alloc entry's, so that a viewer's running total comes back
  // to where it was), the block's stream, and the free's own stacks when history records
  // them for every action, else the block's allocation stacks.
  void record_free(int device, uintptr_t ptr, MempoolId_t pool) {
    BlockFacts block = block_facts(device, ptr, pool);
    RecordContext when;
    std::shared_ptr<c10::GatheredContext> ctx = gather_context(RecordContext::ALL, &when);
    flush_segments(ctx, ctx);
    std::lock_guard<std::mutex> lock(history_mu_);
    std::shared_ptr<c10::GatheredContext> stacks = ctx;
    if (!stacks) {
      auto it = live_contexts_.find(ptr);
      if (it != live_contexts_.end()) stacks = it->second;
    }
    erase_context_locked(ptr);
    auto time = c10::getApproximateTime();
    void* s = reinterpret_cast<void*>(block.stream);
    // The pool returns the block to its free lists at once (reuse on other streams waits
    // for their events inside the pool), so the free completes when it is requested.
    push_trace_locked("free_requested", entry_locked(TraceEntry::FREE_REQUESTED, device, ptr,
                                                     block.requested, s, pool, time, stacks));
    push_trace_locked("free_completed", entry_locked(TraceEntry::FREE_COMPLETED, device, ptr,
                                                     block.requested, s, pool, time, stacks));
  }

  // Note [Kept block stacks]
  // As PyTorch's allocator keeps a block's allocation stacks on the block, the snapshot shows them
  // for as long as the block lives, history on or off. Here they live in live_contexts_ by
  // address, so a block recorded while history was on and freed after it went off must still leave
  // the map: otherwise a later block at the same address showed the dead one's stacks (PyTorch's
  // test_memory_plots found a test's name in a snapshot recorded with no stacks). contexts_kept_
  // says the map holds something; frees look it up only then, and only while nothing is traced
  // (record_free erases).
  void forget_context(uintptr_t ptr) {
    std::lock_guard<std::mutex> lock(history_mu_);
    erase_context_locked(ptr);
  }
  void erase_context_locked(uintptr_t ptr) {
    if (live_contexts_.erase(ptr) && live_contexts_.empty())
      contexts_kept_.store(false, std::memory_order_relaxed);
  }

  // A trace entry as PyTorch's allocator records every one: with the compile context in
  // effect ("N/A" outside torch.compile's regions) and the user metadata
  // (torch.cuda.memory._set_memory_metadata), whatever the action, and with stacks only
  // while history records them for allocations: with context="state" no entry carries any
  // (a free's would be its block's allocation stacks; PyTorch's test_memory_plots_free_stack
  // checks there are none), though the snapshot's blocks keep theirs. history_mu_ held.
  TraceEntry entry_locked(TraceEntry::Action action, int device, uintptr_t addr, size_t size,
                          void* stream, MempoolId_t pool, c10::approx_time_t time,
                          std::shared_ptr<c10::GatheredContext> ctx) {
    if (record_when_ < RecordContext::ALLOC) ctx = nullptr;
    return TraceEntry(action, static_cast<c10::DeviceIndex>(device), addr, size, stream, pool,
                      time, std::move(ctx),
                      compile_contexts_.empty() ? std::string("N/A") : compile_contexts_.back(),
                      user_metadata_);
  }

  // ---- segment events (Note [Segment observer] in mp_core.h) -----------------------------
  // The core tells the observer of every segment it allocates, frees, maps or unmaps, under
  // the pool's lock; the event waits in pending_segments_ (segment_mu_ is taken last and
  // nothing is called while it is held) until the next record, snapshot or empty_cache moves
  // it into the trace and to the trackers with its device and pool, as PyTorch records its
  // own segment_alloc, segment_free, segment_map and segment_unmap.
  struct SegmentEvent {
    int device;          // -1: a pool PyTorch does not use
    MempoolId_t owner;   // the private pool's id, {0, 0} for the device's pool
    int action;
    uintptr_t ptr;
    size_t nbytes;
    uintptr_t stream;
    c10::approx_time_t time;
    bool told = false;   // the trackers already have it (Note [Release observer])
  };
  static constexpr size_t kMaxPendingSegments = 1 << 16;

 public:
  static void observe_segment(void* ctx, mp_pool* p, int action, uintptr_t ptr, size_t nbytes,
                              uintptr_t stream) {
    static_cast<MempoolAllocator*>(ctx)->on_segment(p, action, ptr, nbytes, stream);
  }

  static void before_release(void* ctx, mp_pool*) {
    static_cast<MempoolAllocator*>(ctx)->tell_trackers_first();
  }

 private:
  // The event's pool is resolved here, while it exists: a private pool's events come last as
  // it is destroyed (Note [Segment events at destroy] in mp_expand.c), and a later pool may
  // take its address.
  void on_segment(const mp_pool* p, int action, uintptr_t ptr, size_t nbytes,
                  uintptr_t stream) noexcept {
    if (!tracing_.load(std::memory_order_relaxed)) return;
    try {
      std::lock_guard<std::mutex> lock(segment_mu_);
      int device = -1;
      MempoolId_t owner{0, 0};
      auto it = private_owner_.find(p);
      if (it != private_owner_.end()) {
        device = it->second.first;
        owner = it->second.second;
      } else {
        device = api->pool_device(p);   // reads the table; calls no pool
      }
      if (pending_segments_.size() < kMaxPendingSegments)
        pending_segments_.push_back(
            {device, owner, action, ptr, nbytes, stream, c10::getApproximateTime()});
    } catch (...) {
      // No host memory for the event: the trace misses it, the allocation goes on.
    }
  }

  // The core's segment actions as PyTorch names them (skip_actions) and records them.
  struct SegmentAction {
    const char* name;
    TraceEntry::Action action;
  };
  static const SegmentAction* segment_action(int action) {
    static const SegmentAction alloc{"segment_alloc", TraceEntry::SEGMENT_ALLOC},
        free{"segment_free", TraceEntry::SEGMENT_FREE},
        map{"segment_map", TraceEntry::SEGMENT_MAP},
        unmap{"segment_unmap", TraceEntry::SEGMENT_UNMAP};
    switch (action) {
      case MP_TRACE_SEGMENT_ALLOC: return &alloc;
      case MP_TRACE_SEGMENT_FREE: return &free;
      case MP_TRACE_SEGMENT_MAP: return &map;
      case MP_TRACE_SEGMENT_UNMAP: return &unmap;
      default: return nullptr;
    }
  }

  // Note [Segment event stacks]
  // PyTorch's allocator gives a segment_alloc (or segment_map) the stacks of the allocation
  // that made it when history records them for allocations, and a segment_free (or
  // segment_unmap) the stacks of the call that released it (empty_cache, an allocation's
  // out-of-memory release) when history records them for every action, else the stacks
  // its segment was allocated with; while history records stacks for no action, no entry
  // carries any (PyTorch's own test_memory_plots checks it). The pool tells of segment events under its lock, with
  // no stack; they wait in pending_segments_ until the next record, empty_cache or
  // snapshot, which passes the stacks of its own call: those of the allocation or free
  // being recorded, or of empty_cache. A segment's allocation stacks are kept until its
  // free, as PyTorch keeps them on the block.
  //
  // Move the waiting segment events into the trace, with the stacks of the call flushing
  // them: `grown` for segment_alloc and segment_map, `released` for segment_free and
  // segment_unmap (nullptr: none). Called with no lock held. Events of a pool PyTorch does
  // not use (a CuPy pool of the same process, say) are dropped.
  void flush_segments(std::shared_ptr<c10::GatheredContext> grown = nullptr,
                      std::shared_ptr<c10::GatheredContext> released = nullptr) {
    warn_tracker_error();
    // history_mu_ first, held from taking the events to pushing them: another thread whose
    // allocation made one of these segments then records its alloc only after them.
    std::lock_guard<std::mutex> lock(history_mu_);
    std::vector<SegmentEvent> events;
    {
      std::lock_guard<std::mutex> segment_lock(segment_mu_);
      if (pending_segments_.empty()) return;
      events.swap(pending_segments_);
    }
    for (size_t i = 0; i < events.size(); i++) {
      const SegmentEvent& e = events[i];
      const SegmentAction* a = segment_action(e.action);
      if (e.device < 0 || !a) continue;
      std::shared_ptr<c10::GatheredContext> ctx;
      if (a->action == TraceEntry::SEGMENT_ALLOC || a->action == TraceEntry::SEGMENT_MAP) {
        ctx = grown;
        // A segment allocated with no stacks replaces whatever an earlier segment at its
        // address left (one freed while nothing was traced never had its segment_free).
        if (a->action == TraceEntry::SEGMENT_ALLOC) {
          if (ctx) segment_contexts_[e.ptr] = ctx;
          else segment_contexts_.erase(e.ptr);
        }
      } else {
        auto it = segment_contexts_.find(e.ptr);
        ctx = released ? released : (it != segment_contexts_.end() ? it->second : nullptr);
        if (a->action == TraceEntry::SEGMENT_FREE && it != segment_contexts_.end())
          segment_contexts_.erase(it);
      }
      push_trace_locked(a->name, segment_entry_locked(e, *a, std::move(ctx)),
                        /*tell_trackers=*/!e.told);
    }
  }

  // A segment event's trace entry, with the stacks given. history_mu_ held.
  TraceEntry segment_entry_locked(const SegmentEvent& e, const SegmentAction& a,
                                  std::shared_ptr<c10::GatheredContext> ctx) {
    return entry_locked(a.action, e.device, e.ptr, e.nbytes, reinterpret_cast<void*>(e.stream),
                        e.owner, e.time, std::move(ctx));
  }

  // Note [Release observer] (mp_core.h): a pool is about to give the driver segments whose
  // events wait in pending_segments_. PyTorch hands its trackers a segment_free before its
  // cudaFree, and ProcessGroupNCCL's registration hook deregisters the memory from NCCL
  // there, so the trackers hear every waiting event now, in order; the trace gets them at
  // the next flush, with the stacks of the call that made them, and the trackers not again.
  // Called from the core with no pool's lock held, by whichever thread releases.
  void tell_trackers_first() noexcept {
    if (!trackers_attached_.load(std::memory_order_acquire)) return;
    try {
      std::lock_guard<std::mutex> lock(history_mu_);   // history_mu_, then segment_mu_
      std::vector<SegmentEvent> events;
      {
        std::lock_guard<std::mutex> segment_lock(segment_mu_);
        for (SegmentEvent& e : pending_segments_) {
          if (e.told) continue;
          e.told = true;
          events.push_back(e);
        }
      }
      for (const SegmentEvent& e : events) {
        const SegmentAction* a = segment_action(e.action);
        if (e.device < 0 || !a) continue;
        std::shared_ptr<c10::GatheredContext> ctx;   // a segment's own stacks, if kept
        if (a->action == TraceEntry::SEGMENT_FREE || a->action == TraceEntry::SEGMENT_UNMAP) {
          auto it = segment_contexts_.find(e.ptr);
          if (it != segment_contexts_.end()) ctx = it->second;
        }
        TraceEntry entry = segment_entry_locked(e, *a, std::move(ctx));
        for (auto& tracker : trackers_) tracker(entry);
      }
    } catch (...) {
      // Called from C, the exception cannot pass through the core: the release goes on,
      // and the thread keeps the first error for the glue call that made the release.
      if (!tracker_error_) tracker_error_ = std::current_exception();
    }
  }

  // A tracker's error from tell_trackers_first on this thread. emptyCache throws it; a
  // release made inside an allocation or a free (a retry after OOM, the release threshold)
  // cannot fail that call once the pool has served it, so the next flush on the thread
  // warns with it instead. PyTorch's allocator would throw it from the call that released.
  static inline thread_local std::exception_ptr tracker_error_;

  static void warn_tracker_error() noexcept {
    if (!tracker_error_) return;
    std::exception_ptr error = std::exchange(tracker_error_, nullptr);
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      try {
        TORCH_WARN(cat("mempool: a trace tracker (attachAllocatorTraceTracker) failed while "
                       "the pool gave segments back to the device: ", e.what()));
      } catch (...) {
      }
    } catch (...) {
    }
  }

  // A live block of the device pool ({0, 0}) or of a private pool: its size, the size
  // asked for and its stream; all 0 when there is none.
  struct BlockFacts {
    size_t nbytes = 0, requested = 0;
    uintptr_t stream = 0;
  };
  BlockFacts block_facts(int device, uintptr_t ptr, MempoolId_t pool) {
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

  // As PyTorch's record_trace: every entry goes to the trackers (NCCL's registration hook
  // among them), and to the history while it is on unless its action is one of
  // skip_actions. `name` is the action as skip_actions spells it. history_mu_ held.
  void push_trace_locked(const char* name, TraceEntry entry, bool tell_trackers = true) {
    if (tell_trackers)
      for (auto& tracker : trackers_) tracker(entry);
    if (!history_on_.load(std::memory_order_relaxed) || skip_.count(name)) return;
    trace_.push_back(std::move(entry));
    while (trace_.size() > max_entries_) trace_.pop_front();
  }

  // contexts: live blocks' allocation stacks; segment_contexts: segments' (the stacks of
  // the allocation that made each), which PyTorch's snapshot gives each segment as its
  // frames.
  void add_segments(c10::cuda::CUDACachingAllocator::SnapshotInfo& info, const mp_layout& l,
                    int device, MempoolId_t owner, const Contexts& contexts,
                    const Contexts& segment_contexts) {
    for (size_t s = 0; s < l.nsegments; s++) {
      const mp_segment_view& seg = l.segments[s];
      // An expandable segment is one segment per run of mapped pages: PyTorch's viewer
      // lays blocks end to end from the segment's address, and unmapped address space is
      // neither reserved nor free memory.
      SegmentInfo cur;
      bool open = false;
      auto close = [&]() {
        if (open) info.segments.push_back(std::move(cur));
        cur = SegmentInfo();
        open = false;
      };
      for (size_t b = seg.first_block; b < seg.first_block + seg.nblocks; b++) {
        const mp_block_view& bv = l.blocks[b];
        if (bv.state == MP_BLOCK_UNMAPPED) {
          close();
          continue;
        }
        if (!open) {
          cur.device = static_cast<c10::DeviceIndex>(device);
          cur.address = bv.ptr;
          cur.stream = reinterpret_cast<void*>(seg.stream);
          cur.is_large = !seg.is_small;
          cur.is_expandable = seg.is_expandable;
          cur.owner_private_pool_id = owner;
          auto made = segment_contexts.find(bv.ptr);
          if (made != segment_contexts.end()) cur.context_when_allocated = made->second;
          open = true;
        }
        BlockInfo bi;
        bi.size = bv.nbytes;
        // As PyTorch's: a free block shows the size last requested of it (its own, or that of
        // the block freed last into it), which _memory_viz's plots read.
        bi.requested_size = bv.state == MP_BLOCK_FREE ? bv.last_requested : bv.requested;
        bi.allocated = bv.state == MP_BLOCK_ALLOCATED;
        bi.active = bv.state == MP_BLOCK_ALLOCATED || bv.state == MP_BLOCK_PENDING;
        if (bi.allocated) {
          auto it = contexts.find(bv.ptr);
          if (it != contexts.end()) bi.context_when_allocated = it->second;
          cur.allocated_size += bv.nbytes;
        }
        if (bi.active) {   // PyTorch's sums: a pending free is still asked for
          cur.active_size += bv.nbytes;
          cur.requested_size += bv.requested;
        }
        cur.total_size += bv.nbytes;
        cur.blocks.push_back(std::move(bi));
      }
      close();
    }
  }

  // ---- helpers ---------------------------------------------------------------------------
  // Any capture or pool context on any device: releases wait for all of them, because a
  // capture in PyTorch's default (global) mode is invalidated by a cudaFree or a sync made by
  // any thread of the process, whatever the device it is made on.
  bool capturing() const { return captures_.load(std::memory_order_acquire) > 0; }
  static size_t device_slot(int device) {
    return static_cast<size_t>(device) < MP_TORCH_MAX_DEVICES ? static_cast<size_t>(device) : 0;
  }
  int device_limit() const {
    return std::min(std::max(device_count_, 1), static_cast<int>(MP_TORCH_MAX_DEVICES));
  }
  static void check_device(int device, int rc, const char* what) {
    TORCH_CHECK(rc == MP_OK, cat("mempool: ", what, " on device ", device,
                                 ": no mempool pool is registered for this device "
                                 "(mempool.torch.install serves the devices it was given)"));
  }

  // The flags and counts every allocate and free reads, together on one cache line of their
  // own (Note [Hot lines] in mp_internal.h: between two calls from Python the lines an
  // allocation touches have mostly left the first-level caches).
  //
  // Note [Caching off]: whether the pool serves allocations, and raw_alloc's pointers from
  // the driver while it did not (guarded by uncached_mu_; n_uncached_raw_ is their count).
  // PYTORCH_NO_CUDA_MEMORY_CACHING=1, as PyTorch's allocator reads it (set for memcheck,
  // which then sees each tensor's own bounds): caching off from the start.
  alignas(64) std::atomic<bool> enabled_{
      c10::utils::check_env("PYTORCH_NO_CUDA_MEMORY_CACHING") != true};
  // History is on or a trace tracker is attached (history_on_, below).
  std::atomic<bool> tracing_{false};
  // live_contexts_ is not empty (Note [Kept block stacks])
  std::atomic<bool> contexts_kept_{false};
  std::atomic<int64_t> n_uncached_raw_{0};
  // Lock-free hints (exact counts, updated under pools_mu_ or right after): skip the lock
  // when no route or private block exists.
  std::atomic<int64_t> n_private_blocks_{0};
  std::atomic<int> n_routes_[MP_TORCH_MAX_DEVICES] = {};
  std::mutex uncached_mu_;
  std::unordered_set<uintptr_t> uncached_raw_;

  int device_count_ = 0;
  // Private pools, routes and their blocks: guarded by pools_mu_.
  std::mutex pools_mu_;
  std::unordered_map<MempoolId_t, std::unique_ptr<PrivatePool>, IdHash> private_;
  std::vector<Route> routes_[MP_TORCH_MAX_DEVICES];
  std::unordered_map<uintptr_t, PrivatePool*> private_blocks_;
  std::atomic<int> captures_{0};
  // Per device: refusals followed by another try, and the OOM retries (note_another_try).
  std::atomic<int64_t> oom_tried_again_[MP_TORCH_MAX_DEVICES] = {};
  std::atomic<int64_t> oom_retries_[MP_TORCH_MAX_DEVICES] = {};
  // Per device: the cumulative counts of its private pools destroyed so far (pools_mu_).
  mp_stats retired_[MP_TORCH_MAX_DEVICES] = {};
  // History: guarded by history_mu_ (history_on_ is read without it on the hot path).
  // tracing_ (with the hot flags above): history is on or a trace tracker is attached, so
  // allocations, frees and segment events are recorded; the trace keeps them only while
  // history is on, the trackers (attachAllocatorTraceTracker) get them either way, as from
  // PyTorch's own allocator.
  std::mutex history_mu_;
  std::atomic<bool> history_on_{false};
  RecordContext record_when_ = RecordContext::NEVER;
  CreateContextFn context_recorder_ = nullptr;
  size_t max_entries_ = 1;
  std::deque<TraceEntry> trace_;
  // record_function's annotations (recordAnnotation), kept as the trace is, at most
  // max_entries_; the snapshot's external_annotations.
  using Annotation =
      decltype(c10::cuda::CUDACachingAllocator::SnapshotInfo::external_annotations)::value_type;
  std::deque<Annotation> annotations_;
  // Trace times are the approximate clock's (a TSC read); a snapshot gives them as µs since
  // the epoch, as PyTorch's allocator does.
  c10::ApproximateClockToUnixTimeConverter clock_converter_;
  std::unordered_set<std::string> skip_;
  Contexts live_contexts_;
  // Per thread, as in PyTorch's allocator: one thread's torch.compile region or
  // _set_memory_metadata label says nothing of another's allocations.
  inline static thread_local std::vector<std::string> compile_contexts_;
  inline static thread_local std::string user_metadata_;
  // Note [Segment event stacks]: the allocation stacks of each segment whose segment_alloc
  // had some, by address, until its segment_free.
  Contexts segment_contexts_;
  std::vector<c10::cuda::CUDACachingAllocator::OutOfMemoryObserver> oom_observers_;
  std::vector<c10::CachingDeviceAllocator::AllocatorTraceTracker> trackers_;
  // Set with the first tracker (never cleared: PyTorch has no detach): read without
  // history_mu_ by the release observer, which has nothing to do without trackers.
  std::atomic<bool> trackers_attached_{false};
  // Segment events waiting for the trace: guarded by segment_mu_, taken last.
  std::mutex segment_mu_;
  std::vector<SegmentEvent> pending_segments_;
  // The device and id of each private pool's core pool, from its creation until its
  // destruction has returned (so that its last segment events still find it): guarded by
  // segment_mu_, read by on_segment under the core pool's lock.
  std::unordered_map<const mp_pool*, std::pair<int, MempoolId_t>> private_owner_;
};

MempoolAllocator* the_allocator = nullptr;

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
