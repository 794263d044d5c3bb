// The caller's CUDA device for the torch glue's allocations (Note [The current device]).
#pragma once

#include <c10/cuda/CUDAFunctions.h>

namespace mempool_torch {

// Note [The current device]
// Every allocate() needs the caller's device, as PyTorch's own allocator asks for it:
// c10::cuda::current_device() is cudaGetDevice, the largest piece of an allocate + free
// pair that is not the pool's (bench/torch_allocator_pairs.py,
// its pieces). In a process that sees one device (most single-GPU training, and every
// process started with one CUDA_VISIBLE_DEVICES ordinal) its answer can only be 0: c10's
// count is fixed at its first call, and neither cudaGetDevice nor c10's parked target
// device (MaybeSetDevice, for a device without a context yet) can name another ordinal.
// There the glue answers 0 without asking. With several devices it asks c10 every time:
// a cache keyed on the thread's driver context would disagree with c10 while a guard has
// parked a target device whose context does not exist yet (the current context is then
// another device's). c10's device_count() is 0 when CUDA cannot be initialized; c10 then
// raises its own error.
inline c10::DeviceIndex current_device() {
  static const bool only_one = c10::cuda::device_count() == 1;
  return only_one ? 0 : c10::cuda::current_device();
}

}  // namespace mempool_torch
