// Checked CUDA runtime calls and a scoped current device, for the host code of the cuda backend.
#pragma once
#include <cuda_runtime.h>

#include <string>

#include "common/error.h"

namespace jax_moe::cuda {

// Throws jax_moe::Error naming the call; clears the runtime's last error so that later calls are not blamed.
inline void Check(cudaError_t err, const char* call) {
  if (err != cudaSuccess) {
    cudaGetLastError();
    Throw(ErrorCode::kInternal, std::string("jax_moe cuda: ") + call + " failed: " + cudaGetErrorString(err));
  }
}

// Makes `ordinal` current for a scope, restoring the caller's device (Python's thread is shared with JAX).
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    Check(cudaGetDevice(&previous_), "cudaGetDevice");
    Check(cudaSetDevice(ordinal), "cudaSetDevice");
  }
  ~DeviceScope() { cudaSetDevice(previous_); }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace jax_moe::cuda
