// History (_record_memory_history): the trace, its entries' stacks and metadata, and the
// observers and trackers attached.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline void MempoolAllocator::recordHistory(bool enabled, CreateContextFn context_recorder,
         size_t alloc_trace_max_entries, RecordContext when, bool clearHistory,
         const std::vector<std::string>& skip_actions) {
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

inline void MempoolAllocator::recordAnnotation(const std::vector<std::pair<std::string, std::string>>& md) {
  if (!history_on_.load()) return;
  Annotation entry(c10::cuda::current_device(), c10::getApproximateTime());
  for (const auto& [name, value] : md) entry.recordUserMetadata(name, value);
  std::lock_guard<std::mutex> lock(history_mu_);
  annotations_.push_back(std::move(entry));
  while (annotations_.size() > max_entries_) annotations_.pop_front();
}

inline void MempoolAllocator::pushCompileContext(std::string& md) {
  std::lock_guard<std::mutex> lock(history_mu_);
  compile_contexts_.push_back(md);
}

inline void MempoolAllocator::popCompileContext() {
  std::lock_guard<std::mutex> lock(history_mu_);
  if (!compile_contexts_.empty()) compile_contexts_.pop_back();
}

inline void MempoolAllocator::setUserMetadata(const std::string& metadata) {
  std::lock_guard<std::mutex> lock(history_mu_);
  user_metadata_ = metadata;
}

inline std::string MempoolAllocator::getUserMetadata() {
  std::lock_guard<std::mutex> lock(history_mu_);
  return user_metadata_;
}

inline void MempoolAllocator::attachOutOfMemoryObserver(
 c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) {
  std::lock_guard<std::mutex> lock(history_mu_);
  oom_observers_.push_back(std::move(observer));
}

inline void MempoolAllocator::attachAllocatorTraceTracker(
 c10::CachingDeviceAllocator::AllocatorTraceTracker tracker) {
  std::lock_guard<std::mutex> lock(history_mu_);
  trackers_.push_back(std::move(tracker));
  tracing_.store(true);   // trackers see every entry, history or not, as PyTorch's do
  trackers_attached_.store(true, std::memory_order_release);
}

// The stacks of this call when history records them from `minimum` on, else nullptr. The
// recorder gathers Python and C++ stacks (it takes the GIL itself): no lock is held.
inline std::shared_ptr<c10::GatheredContext> MempoolAllocator::gather_context(RecordContext minimum,
                          RecordContext* when) {
  CreateContextFn recorder;
  {
    std::lock_guard<std::mutex> lock(history_mu_);
    recorder = context_recorder_;
    *when = record_when_;
  }
  return recorder && *when != RecordContext::NEVER && *when >= minimum ? recorder() : nullptr;
}

inline void MempoolAllocator::record_alloc(int device, uintptr_t ptr, size_t nbytes, cudaStream_t stream,
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
inline void MempoolAllocator::record_free(int device, uintptr_t ptr, MempoolId_t pool) {
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
inline void MempoolAllocator::forget_context(uintptr_t ptr) {
  std::lock_guard<std::mutex> lock(history_mu_);
  erase_context_locked(ptr);
}

inline void MempoolAllocator::erase_context_locked(uintptr_t ptr) {
  if (live_contexts_.erase(ptr) && live_contexts_.empty())
    contexts_kept_.store(false, std::memory_order_relaxed);
}

// A trace entry as PyTorch's allocator records every one: with the compile context in
// effect ("N/A" outside torch.compile's regions) and the user metadata
// (torch.cuda.memory._set_memory_metadata), whatever the action, and with stacks only
// while history records them for allocations: with context="state" no entry carries any
// (a free's would be its block's allocation stacks; PyTorch's test_memory_plots_free_stack
// checks there are none), though the snapshot's blocks keep theirs. history_mu_ held.
inline TraceEntry MempoolAllocator::entry_locked(TraceEntry::Action action, int device, uintptr_t addr, size_t size,
           void* stream, MempoolId_t pool, c10::approx_time_t time,
           std::shared_ptr<c10::GatheredContext> ctx) {
  if (record_when_ < RecordContext::ALLOC) ctx = nullptr;
  return TraceEntry(action, static_cast<c10::DeviceIndex>(device), addr, size, stream,
                    reported_id(pool),
                    time, std::move(ctx),
                    compile_contexts_.empty() ? std::string("N/A") : compile_contexts_.back(),
                    user_metadata_);
}

// As PyTorch's record_trace: every entry goes to the trackers (NCCL's registration hook
// among them), and to the history while it is on unless its action is one of
// skip_actions. `name` is the action as skip_actions spells it. history_mu_ held.
inline void MempoolAllocator::push_trace_locked(const char* name, TraceEntry entry, bool tell_trackers) {
  if (tell_trackers)
    for (auto& tracker : trackers_) tracker(entry);
  if (!history_on_.load(std::memory_order_relaxed) || skip_.count(name)) return;
  trace_.push_back(std::move(entry));
  while (trace_.size() > max_entries_) trace_.pop_front();
}

}  // namespace
