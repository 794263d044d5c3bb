// The C++ PyTorch allocator's declarations: the helpers every part uses and the
// MempoolAllocator class, whose methods are defined by concern in the torch_*.cpp parts
// that torch_allocator.cpp compiles as one unit (Note [Torch allocator glue], mp_torch.h).
// Included once, by torch_allocator.cpp only.
#ifndef MEMPOOL_TORCH_ALLOCATOR_H
#define MEMPOOL_TORCH_ALLOCATOR_H

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

// Note [Segment kind at run time] (mp_torch_private.c): the device's companion pool of the
// other segment kind is kept among the private pools under an id of its own (PyTorch's are
// {graph, 0} and {0, MemPool}); traces and snapshots show its memory as the device pool's.
constexpr c10::CaptureId_t kCompanionMark = ~c10::CaptureId_t{0};
inline MempoolId_t companion_id(int device) {
  return {kCompanionMark, static_cast<c10::CaptureId_t>(device)};
}
inline bool is_companion(MempoolId_t id) { return id.first == kCompanionMark; }
inline MempoolId_t reported_id(MempoolId_t id) {
  return is_companion(id) ? MempoolId_t{0, 0} : id;
}

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
// string: c10::str of several arguments instantiates iostream code in this library, and an
// error message built that way can crash inside that code (`<< int` in c10::str), while one
// string is passed through without a stream.
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

// Each method's notes are at its definition, in the part its section names.
class MempoolAllocator final : public WithOomRejection<CUDAAllocator> {
  // Stacks by address: of live blocks, or of the segments they were allocated with.
  using Contexts = std::unordered_map<uintptr_t, std::shared_ptr<c10::GatheredContext>>;

 public:
  // ---- data path ---------------------------------------------------------------------
  c10::DataPtr allocate(size_t nbytes) override;

  c10::DeleterFnPtr raw_deleter() const override { return &delete_block; }

  void copy_data(void* dest, const void* src, std::size_t count) const override;

  void* raw_alloc(size_t nbytes) override;

  void* raw_alloc_with_stream(size_t nbytes, cudaStream_t stream) override;

  void raw_delete(void* ptr) override;

  bool free_tagged(uintptr_t ctx);

  void report_to_profiler(int device, uintptr_t ptr, int64_t delta);
  void report_to_profiler(int device, uintptr_t ptr, MempoolId_t pool, int sign);

  void init(int device_count) override { device_count_ = device_count; }
  bool initialized() override { return true; }

  // ---- limits and caches ---------------------------------------------------------------
  double getMemoryFraction(c10::DeviceIndex device) override;

  void setMemoryFraction(double fraction, c10::DeviceIndex device) override;

  void emptyCache(MempoolId_t mempool_id) override;

  void cacheInfo(c10::DeviceIndex device, size_t* largest) override;

  void* getBaseAllocation(void* ptr, size_t* size) override;

  void recordStream(const c10::DataPtr& data, c10::cuda::CUDAStream stream) override;

  // ---- statistics ------------------------------------------------------------------------
  DeviceStats getDeviceStats(c10::DeviceIndex device) override;

  void resetAccumulatedStats(c10::DeviceIndex device) override;

  void resetPeakStats(c10::DeviceIndex device) override;

  std::pair<size_t, size_t> getMemoryInfo(c10::DeviceIndex device) override;

  std::vector<c10::cuda::CUDACachingAllocator::StreamSegmentSize> getExpandableSegmentSizes(
      c10::DeviceIndex /*device*/) override;

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
                                                         bool include_traces) override;

  bool isHistoryEnabled() override { return history_on_.load(); }

  void record_snapshot_entries(const c10::cuda::CUDACachingAllocator::SnapshotInfo& info);

  void recordHistory(bool enabled, CreateContextFn context_recorder,
                     size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
                     const std::vector<std::string>& skip_actions) override;

  void recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) override;
  void pushCompileContext(std::string& md) override;
  void popCompileContext() override;
  void setUserMetadata(const std::string& metadata) override;
  std::string getUserMetadata() override;

  void attachOutOfMemoryObserver(
      c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override;

  void attachAllocatorTraceTracker(
      c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) override;

  // ---- CUDA graphs and MemPools ------------------------------------------------------------
  void beginAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                           std::function<bool(cudaStream_t)> filter) override;

  void endAllocateToPool(c10::DeviceIndex device, MempoolId_t mempool_id) override;

  void releasePool(c10::DeviceIndex device, MempoolId_t mempool_id) override;

  int getPoolUseCount(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) override;

  void createOrIncrefPool(c10::DeviceIndex device, MempoolId_t mempool_id,
                          std::shared_ptr<CUDAAllocator> allocator) override;

  void setUseOnOOM(c10::DeviceIndex /*device*/, MempoolId_t mempool_id, bool use_on_oom) override;

  void setNoSplit(c10::DeviceIndex /*device*/, MempoolId_t mempool_id) override;

  bool checkPoolLiveAllocations(c10::DeviceIndex device, MempoolId_t mempool_id,
                                const std::unordered_set<void*>& expected) override;

  std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> getCheckpointState(
      c10::DeviceIndex device, MempoolId_t id) override;

  c10::cuda::CUDACachingAllocator::CheckpointDelta setCheckpointPoolState(
      c10::DeviceIndex device,
      std::shared_ptr<c10::cuda::CUDACachingAllocator::AllocatorState> pps) override;

  // ---- IPC and peers ---------------------------------------------------------------------
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override;

  std::shared_ptr<void> getIpcDevPtr(std::string handle) override;

  std::shared_ptr<void> open_pool_handle(const std::string& handle);

  void enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) override;

  cudaError_t memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
                          size_t count, cudaStream_t stream, bool p2p_enabled) override;

  std::string name() override { return "mempool"; }

 private:
  std::mutex ipc_mu_;   // guards ipc_open_
  std::unordered_map<std::string, std::weak_ptr<void>> ipc_open_;   // handle -> its mapping

  void* raw_alloc_on(c10::DeviceIndex device, size_t nbytes, cudaStream_t stream);

  // ---- caching off (Note [Caching off]) -------------------------------------------------
  void* uncached_alloc(c10::DeviceIndex device, size_t nbytes);

  void* uncached_raw_alloc(c10::DeviceIndex device, size_t nbytes);

  bool forget_uncached_raw(void* ptr);

  // ---- allocation ------------------------------------------------------------------------
  void* alloc_on(int device, size_t nbytes, cudaStream_t stream, uintptr_t* tag);

  void* served(int device, uintptr_t out, size_t nbytes, cudaStream_t stream, uintptr_t* tag);

  static bool out_of_memory(int rc) { return rc == MP_ENOMEM || rc == MP_ELIMIT; }

  void note_another_try(int device, bool retry);

  int try_again(int device, size_t nbytes, cudaStream_t stream, uintptr_t* out, bool retry);

  static bool run_free_memory_callbacks();

  bool release_unused_pools_for_oom(int device);

  bool empty_unused_pools(MempoolId_t mempool_id, int device);

  PrivatePool* route(int device, cudaStream_t stream);

  void* try_alloc_private(PrivatePool* pp, size_t nbytes, cudaStream_t stream, int* rc);

  void* alloc_private(PrivatePool* pp, size_t nbytes, cudaStream_t stream);

  void* alloc_use_on_oom(int device, size_t nbytes, cudaStream_t stream);

  // Note [Segment kind at run time] (mp_torch_private.c).
  bool kind_switched(int device) const {
    return __atomic_load_n(&api->kind_switched[device_slot(device)], __ATOMIC_RELAXED) != 0;
  }
  PrivatePool* companion_for_block_locked(int device);
  void* alloc_companion(int device, size_t nbytes, cudaStream_t stream, uintptr_t* tag);
  bool empty_companions(int device);
  bool empty_device_pool_for_oom(int device);
  mp_pool* companion_pool_of_block(uintptr_t ptr);

  bool free_private(uintptr_t ptr);

  void drop_live_block(PrivatePool* pp);

  std::vector<PrivatePool*> pin_pools(MempoolId_t mempool_id, bool unused_only = false,
                                      int device = -1);

  void unpin(const std::vector<PrivatePool*>& pinned);

  void release_pools(const std::vector<mp_pool*>& doomed);

  std::vector<mp_pool*> private_pools_locked(int device);

  void note_private_change(int device);

  void note_private_change_everywhere();

  std::string explain_oom(int device, size_t nbytes, cudaStream_t stream, int rc,
                          const MempoolId_t* private_id);
  [[noreturn]] void throw_oom(int device, size_t nbytes, cudaStream_t stream, int rc,
                              const MempoolId_t* private_id);
  static std::string oom_message(int device, size_t nbytes, size_t free_bytes, size_t total,
                                 const mp_torch_figures& fig, bool is_private,
                                 const std::string& explanation);

  // ---- private pools ---------------------------------------------------------------------
  PrivatePool* create_or_incref_locked(int device, MempoolId_t id,
                                       std::shared_ptr<CUDAAllocator> custom);

  std::vector<mp_pool*> collect_freeable_locked();

  void require_pool(c10::DeviceIndex device, MempoolId_t id, const char* what);

  void retire_counts_locked(const PrivatePool& pp);

  std::map<uintptr_t, std::pair<size_t, uintptr_t>> allocated_blocks(MempoolId_t id);

  // ---- history ---------------------------------------------------------------------------
  std::shared_ptr<c10::GatheredContext> gather_context(RecordContext minimum,
                                                       RecordContext* when);

  void record_alloc(int device, uintptr_t ptr, size_t nbytes, cudaStream_t stream,
                    MempoolId_t pool);

  void record_free(int device, uintptr_t ptr, MempoolId_t pool);

  void forget_context(uintptr_t ptr);
  void erase_context_locked(uintptr_t ptr);

  TraceEntry entry_locked(TraceEntry::Action action, int device, uintptr_t addr, size_t size,
                          void* stream, MempoolId_t pool, c10::approx_time_t time,
                          std::shared_ptr<c10::GatheredContext> ctx);

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
  void on_segment(const mp_pool* p, int action, uintptr_t ptr, size_t nbytes,
                  uintptr_t stream) noexcept;

  // The core's segment actions as PyTorch names them (skip_actions) and records them.
  struct SegmentAction {
    const char* name;
    TraceEntry::Action action;
  };
  static const SegmentAction* segment_action(int action);

  void flush_segments(std::shared_ptr<c10::GatheredContext> grown = nullptr,
                      std::shared_ptr<c10::GatheredContext> released = nullptr);

  TraceEntry segment_entry_locked(const SegmentEvent& e, const SegmentAction& a,
                                  std::shared_ptr<c10::GatheredContext> ctx);

  void tell_trackers_first() noexcept;

  // A tracker's error from tell_trackers_first on this thread. emptyCache throws it; a
  // release made inside an allocation or a free (a retry after OOM, the release threshold)
  // cannot fail that call once the pool has served it, so the next flush on the thread
  // warns with it instead. PyTorch's allocator would throw it from the call that released.
  static inline thread_local std::exception_ptr tracker_error_;

  static void warn_tracker_error() noexcept;

  // A live block of the device pool ({0, 0}) or of a private pool: its size, the size
  // asked for and its stream; all 0 when there is none.
  struct BlockFacts {
    size_t nbytes = 0, requested = 0;
    uintptr_t stream = 0;
  };
  BlockFacts block_facts(int device, uintptr_t ptr, MempoolId_t pool);

  void push_trace_locked(const char* name, TraceEntry entry, bool tell_trackers = true);

  void add_segments(c10::cuda::CUDACachingAllocator::SnapshotInfo& info, const mp_layout& l,
                    int device, MempoolId_t owner, const Contexts& contexts,
                    const Contexts& segment_contexts);

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
  static void check_device(int device, int rc, const char* what);

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
  // Note [Segment kind at run time]: each device's companion pool, once made (also in
  // private_, never destroyed while the allocator lives).
  PrivatePool* companions_[MP_TORCH_MAX_DEVICES] = {};
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

}  // namespace

#endif
