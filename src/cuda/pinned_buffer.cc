#include "cuda/pinned_buffer.h"

#include <cuda_runtime.h>

#include "cuda/cuda_scope.h"

namespace jax_moe::cuda {

PinnedBuffer::PinnedBuffer(size_t bytes, int node) : pages_(bytes, node), size_(bytes) {
  // Registered rather than cudaHostAlloc'd: the pages were placed on `node` at their first touch, and pinning keeps
  // them there (cudaHostAlloc would place them wherever the driver's own touch happens).
  Check(cudaHostRegister(pages_.data(), pages_.size(), cudaHostRegisterPortable | cudaHostRegisterMapped),
        "cudaHostRegister");
  void* device = nullptr;
  if (cudaError_t err = cudaHostGetDevicePointer(&device, pages_.data(), 0); err != cudaSuccess) {
    cudaHostUnregister(pages_.data());
    Check(err, "cudaHostGetDevicePointer");
  }
  device_ = static_cast<uint8_t*>(device);
}

PinnedBuffer::~PinnedBuffer() { cudaHostUnregister(pages_.data()); }

}  // namespace jax_moe::cuda
