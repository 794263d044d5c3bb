// Segment events (Note [Segment observer] in mp_core.h): the core's events kept until the
// next record, then given to the trace and the trace trackers.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

// The event's pool is resolved here, while it exists: a private pool's events come last as
// it is destroyed (Note [Segment events at destroy] in mp_expand.c), and a later pool may
// take its address.
inline void MempoolAllocator::on_segment(const mp_pool* p, int action, uintptr_t ptr, size_t nbytes,
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

inline const MempoolAllocator::SegmentAction* MempoolAllocator::segment_action(int action) {
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
inline void MempoolAllocator::flush_segments(std::shared_ptr<c10::GatheredContext> grown,
         std::shared_ptr<c10::GatheredContext> released) {
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
inline TraceEntry MempoolAllocator::segment_entry_locked(const SegmentEvent& e, const SegmentAction& a,
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
inline void MempoolAllocator::tell_trackers_first() noexcept {
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

inline void MempoolAllocator::warn_tracker_error() noexcept {
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

}  // namespace
