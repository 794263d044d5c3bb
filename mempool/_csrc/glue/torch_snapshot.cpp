// Snapshots (torch.cuda.memory._snapshot): every pool's segments and blocks in PyTorch's
// SegmentInfo, with the trace.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline c10::cuda::CUDACachingAllocator::SnapshotInfo MempoolAllocator::snapshot(MempoolId_t mempool_id,
                           bool include_traces) {
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
    add_segments(info, l, pp->device, reported_id(pp->id), contexts, segment_contexts);
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

// The snapshot entry of each device, as PyTorch's allocator records one per device at
// each snapshot, its size the active bytes of the device's segments in the snapshot:
// given to trackers and, while history is on, kept. PyTorch's snapshot copies a device's
// trace before it records the entry, so the entry shows in later snapshots, not in this
// one (whose trace would otherwise end with an entry of the metadata set after the
// recording, which PyTorch's own test_memory_plots_metadata refuses).
inline void MempoolAllocator::record_snapshot_entries(const c10::cuda::CUDACachingAllocator::SnapshotInfo& info) {
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

// contexts: live blocks' allocation stacks; segment_contexts: segments' (the stacks of
// the allocation that made each), which PyTorch's snapshot gives each segment as its
// frames.
inline void MempoolAllocator::add_segments(c10::cuda::CUDACachingAllocator::SnapshotInfo& info, const mp_layout& l,
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

}  // namespace
