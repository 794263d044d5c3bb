// Out of memory: what is tried before a request fails, and the error PyTorch raises, explained
// by the core (Note [One OOM explainer], core/mp_oom.c).
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

// The pools count each refusal as an OOM; PyTorch counts one per request that fails in
// the end (an OOM raised), and a retry after releasing cached memory as a retry. So a
// refusal followed by another try (the retry below, a use_on_oom MemPool) is taken off
// num_ooms in getDeviceStats, and the retry counted.
inline void MempoolAllocator::note_another_try(int device, bool retry) {
  oom_tried_again_[device_slot(device)].fetch_add(1, std::memory_order_relaxed);
  if (retry) oom_retries_[device_slot(device)].fetch_add(1, std::memory_order_relaxed);
}

// The device pool's request again, counted as PyTorch counts it (note_another_try).
inline int MempoolAllocator::try_again(int device, size_t nbytes, cudaStream_t stream, uintptr_t* out, bool retry) {
  note_another_try(device, retry);
  return api->alloc(device, nbytes, reinterpret_cast<uintptr_t>(stream), out);
}

// Note [Free memory callbacks]
// PyTorch's allocator runs every callback of c10's FreeCudaMemoryCallbacksRegistry when its
// cache has no block for a request, and searches again if one freed memory: memory that
// code outside the allocator holds and can let go of. PyTorch's own is CUDA IPC's
// "cuda_ipc_collect": a tensor sent to other processes (shareIpcHandle) keeps its block
// until every consumer has let it go, and the collect frees the blocks whose consumers
// have, as torch.cuda.ipc_collect() does; an extension may register its own. The glue
// cannot tell a miss of the pool from a hit without a call into the core on every
// allocation, so it runs them when the device's pool refuses a request, and tries once
// more when one freed anything: the request is served before it fails. The callbacks free
// through this allocator, and no lock of the glue is held while they run.
inline bool MempoolAllocator::run_free_memory_callbacks() {
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
inline bool MempoolAllocator::release_unused_pools_for_oom(int device) {
  if (capturing()) return false;
  return empty_unused_pools(MempoolId_t{0, 0}, device);
}

// Note [One OOM explainer] (core/mp_oom.c): the pool's explanation of the refusal, from the
// record the core took where its fallback chain gave up, with the rules and words of the
// Pool's own OutOfMemoryError. Asked first, before anything else runs on this thread (an
// OOM observer may allocate). private_id: the private pool that refused, pinned while the
// core reads it (it may be gone: then the device's pool explains).
inline std::string MempoolAllocator::explain_oom(int device, size_t nbytes, cudaStream_t stream,
                                                 int rc, const MempoolId_t* private_id) {
  std::vector<PrivatePool*> pinned;
  if (private_id) pinned = pin_pools(*private_id);
  mp_pool* pool = pinned.empty() ? nullptr : pinned.front()->pool;
  mp_oom rec;
  char text[1024];
  int got = api->oom_message(device, pool, rc, nbytes, reinterpret_cast<uintptr_t>(stream),
                             &rec, text, sizeof text);
  unpin(pinned);
  if (got != MP_OK)
    return cat(fmt_size(nbytes), " refused (code ", rc, "); no mempool pool is registered for "
               "device ", device);
  return text;
}

// private_id: the private pool that refused, or nullptr for the device's pool.
inline void MempoolAllocator::throw_oom(int device, size_t nbytes, cudaStream_t stream, int rc,
                                        const MempoolId_t* private_id) {
  std::string explanation = explain_oom(device, nbytes, stream, rc, private_id);
  mp_torch_figures fig{0, 0, 0, 0, SIZE_MAX, 0, SIZE_MAX};
  (void)api->memory_figures(device, &fig);
  // PyTorch's figures are the device's: its graphs', MemPools' and companion pool's memory
  // counts too, as in memory_allocated() and memory_reserved().
  {
    std::lock_guard<std::mutex> lock(pools_mu_);
    std::vector<mp_pool*> pools = private_pools_locked(device);
    mp_stats s;
    if (api->device_stats(device, pools.data(), pools.size(), &s) == MP_OK) {
      fig.used = static_cast<size_t>(s.allocated_bytes[MP_STAT_ALL].current);
      fig.reserved = static_cast<size_t>(s.reserved_bytes[MP_STAT_ALL].current);
    }
  }
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
  size_t allowed = fig.limit != SIZE_MAX ? fig.limit : total;
  // The profiler's memory timeline marks the OOM ("[OutOfMemory]"), as PyTorch's reports
  // it: the size asked for, then the device's allocated and reserved bytes.
  c10::reportOutOfMemoryToProfiler(
      static_cast<int64_t>(nbytes), fig.used, fig.reserved,
      c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(device)));
  for (auto& observer : observers) observer(device, nbytes, allowed, free_bytes);
  // A limit refuses before the driver is asked, always: what PyTorch's allocator does
  // only with throw_on_cudamalloc_oom set, whose observers hear of it.
  if (rc == MP_ELIMIT) notify_oom_rejection(device, nbytes, fig.reserved, total);
  TORCH_CHECK_WITH(OutOfMemoryError, false,
                   oom_message(device, nbytes, free_bytes, total, fig,
                               private_id != nullptr && !is_companion(*private_id),
                               explanation));
}

// The first sentences are PyTorch's own, in its words and order ("CUDA out of memory.
// Tried to allocate 20.00 MiB. GPU 0 has a total capacity of ..."), since scripts and
// libraries match them: Hugging Face Accelerate's find_executable_batch_size halves the
// batch only for a message holding "CUDA out of memory.", and PyTorch's own tests look for
// "Tried to allocate ... GPU 0 has a total capacity of". So is its refusal of a request
// of 1 EiB or more. The pool's own explanation (explain_oom) follows.
inline std::string MempoolAllocator::oom_message(int device, size_t nbytes, size_t free_bytes,
                                                 size_t total, const mp_torch_figures& fig,
                                                 bool is_private,
                                                 const std::string& explanation) {
  constexpr size_t kOneExaByte = size_t(1) << 60;
  std::string head = nbytes >= kOneExaByte
      ? std::string("CUDA out of memory. Tried to allocate more than 1EB memory. ")
      : cat("CUDA out of memory. Tried to allocate ", fmt_size(nbytes), ". GPU ", device,
            " has a total capacity of ", fmt_size(total), " of which ", fmt_size(free_bytes),
            " is free. ", fig.limit != SIZE_MAX ? fmt_size(fig.limit) + " allowed; " : std::string(),
            "Of the allocated memory ", fmt_size(fig.used), " is allocated by PyTorch, and ",
            fmt_size(fig.reserved > fig.used ? fig.reserved - fig.used : 0),
            " is reserved by PyTorch but unallocated. ");
  return cat(head, "mempool", is_private ? " (a CUDA-graph/MemPool private pool)" : "", ": ",
             explanation);
}

}  // namespace
