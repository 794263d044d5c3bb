// Other processes and peers: sharing is refused, receiving opens CUDA IPC handles, peer
// access reaches the pool's memory.
// A part of torch_allocator.cpp (torch_allocator.h), compiled inside it.

namespace {

inline c10::cuda::CUDACachingAllocator::ShareableHandle MempoolAllocator::shareIpcHandle(void* ptr) {
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
inline std::shared_ptr<void> MempoolAllocator::getIpcDevPtr(std::string handle) {
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
