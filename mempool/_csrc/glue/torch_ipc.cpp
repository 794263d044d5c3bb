// Other processes and peers: the pool's memory shared and opened through the core's handles
// (Note [Torch allocator glue], mp_torch.h), CUDA IPC handles of PyTorch's own allocator
// opened, peer access to the pool's memory.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

// A handle of the pool's: this tag, a version byte, then the core's handle. PyTorch's own
// start with its version byte and a kind byte ('c', 'e'), or are a bare 64-byte
// cudaIpcMemHandle; none of the core's handles is 62 or 64 bytes long (its header alone
// outgrows them), so the lengths tell the two apart whatever the bytes.
constexpr char kPoolHandleTag = 'M';
constexpr char kPoolHandleVersion = 2;   // moves with the core handle's MP_SHARE_VERSION (core/mp_share.c)

bool is_pool_handle(const std::string& handle) {
  return handle.size() > 2 && handle.size() != CUDA_IPC_HANDLE_SIZE &&
         handle.size() != CUDA_IPC_HANDLE_SIZE + 2 && handle[0] == kPoolHandleTag;
}

// What a share or share_open code means, for the messages below.
const char* share_refusal(int rc) {
  switch (rc) {
    case MP_EUNSUPPORTED:
      return "the pool cannot share its memory with other processes (make the producer's "
             "pool with ipc=True and pool_handle='create', the default), or this process "
             "may not take the producer's descriptors (neither pidfd_getfd, which needs "
             "Linux 5.6+ and ptrace permission over the producer: "
             "/proc/sys/kernel/yama/ptrace_scope, nor the producer's descriptor server, "
             "which answers processes of its own user, allowed it)";
    case MP_EINVAL:
      return "no pool is registered for the device, or the handle is not one a pool of the "
             "same kind made";
    case MP_ENOMEM:
      return "out of memory";
    default:
      return "the driver refused (see the pool's last error)";
  }
}

inline c10::cuda::CUDACachingAllocator::ShareableHandle MempoolAllocator::shareIpcHandle(void* ptr) {
  // What _share_cuda_ asks for a tensor's storage. As PyTorch's allocator, memory the pool
  // did not hand out (DLPack's, another allocator's) is an invalid device pointer.
  void* base = getBaseAllocation(ptr, nullptr);
  uintptr_t p = reinterpret_cast<uintptr_t>(base);
  // Note [Segment kind at run time]: a block of the device's companion pool shares as the
  // device pool's do.
  mp_pool* companion = companion_pool_of_block(p);
  int device = companion ? -1 : api->find_device(p);
  TORCH_CHECK(companion || device >= 0,
              cat("mempool: sharing a CUDA tensor with another process (torch.multiprocessing, "
                  "reduce_tensor) is supported for the device's pool; this one (", ptr,
                  ") belongs to a CUDA graph's or a MemPool's private pool, or was allocated "
                  "while caching was off. Clone it into an ordinary tensor to send it."));
  std::string bytes(512, '\0');
  size_t len = 0, offset = 0;
  auto share = [&] {
    auto* buf = reinterpret_cast<unsigned char*>(&bytes[0]);
    return companion ? api->pool_share(companion, p, buf, bytes.size(), &len, &offset)
                     : api->share(device, p, buf, bytes.size(), &len, &offset);
  };
  int rc = share();
  if (rc == MP_EINVAL && len > bytes.size() && len <= MP_SHARE_HANDLE_MAX) {
    bytes.resize(len);
    rc = share();
  }
  TORCH_CHECK(rc == MP_OK,
              cat("mempool: sharing the CUDA tensor at ", ptr, " with another process "
                  "failed (code ", rc, "): ", share_refusal(rc)));
  bytes.resize(len);
  // The handle names the block's memory (a segment, or a run of pages), so that blocks of
  // one region share PyTorch's cache entry; the offset locates the block in it.
  std::string handle;
  handle.reserve(len + 2);
  handle.push_back(kPoolHandleTag);
  handle.push_back(kPoolHandleVersion);
  handle += bytes;
  return {static_cast<ptrdiff_t>(offset + (reinterpret_cast<uintptr_t>(ptr) - p)),
          std::move(handle)};
}

// A handle of the pool's, opened on the current device's pool (_new_shared_cuda sets the
// sender's device current first). The core counts opens of one handle and maps it once;
// the deleter closes this open.
inline std::shared_ptr<void> MempoolAllocator::open_pool_handle(const std::string& handle) {
  TORCH_CHECK(handle[1] == kPoolHandleVersion,
              cat("mempool: this CUDA IPC handle comes from a mempool of another version "
                  "(handle version ", static_cast<int>(handle[1]), ", this one reads ",
                  static_cast<int>(kPoolHandleVersion), "); run the same mempool in both "
                  "processes"));
  int device = c10::cuda::current_device();
  uintptr_t base = 0;
  size_t nbytes = 0;
  int rc = api->share_open(device, reinterpret_cast<const unsigned char*>(handle.data() + 2),
                           handle.size() - 2, &base, &nbytes);
  TORCH_CHECK(rc == MP_OK,
              cat("mempool: opening a CUDA tensor another process shared failed on device ",
                  device, " (code ", rc, "): ", share_refusal(rc)));
  return std::shared_ptr<void>(reinterpret_cast<void*>(base), [device](void* b) {
    // A deleter must not throw; a pool unregistered meanwhile answers a code, nothing more.
    (void)api->share_close(device, reinterpret_cast<uintptr_t>(b));
  });
}

// The receiving side of torch.multiprocessing. Handles of the pool's (above); else PyTorch
// 2.11's own allocator sends a version byte, a kind byte ('c': a cudaIpcMemHandle follows;
// 'e': its expandable segments' file-descriptor protocol, which only its own allocator can
// open) and the handle; older versions send the 64-byte handle alone. A handle is opened
// once per process (CUDA refuses a second open) and shared by every tensor built from it
// while any lives, as PyTorch does.
inline std::shared_ptr<void> MempoolAllocator::getIpcDevPtr(std::string handle) {
  if (is_pool_handle(handle)) return open_pool_handle(handle);
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

inline void MempoolAllocator::enablePeerAccess(c10::DeviceIndex dev, c10::DeviceIndex dev_to_access) {
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

inline cudaError_t MempoolAllocator::memcpyAsync(void* dst, int dstDevice, const void* src, int srcDevice,
           size_t count, cudaStream_t stream, bool p2p_enabled) {
  if (p2p_enabled || dstDevice == srcDevice)
    return cudaMemcpyAsync(dst, src, count, cudaMemcpyDeviceToDevice, stream);
  return cudaMemcpyPeerAsync(dst, dstDevice, src, srcDevice, count, stream);
}

}  // namespace
