#include "kernels/cooperative.h"

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

namespace jax_moe::cuda {

int ResidentBlocks(const void* kernel, int threads, size_t smem, int num_sms) {
  using Key = std::tuple<const void*, int, size_t, int>;
  static std::mutex mu;
  static std::vector<std::pair<Key, int>> cache;  // a handful of entries: kernels x shapes in use
  const Key key{kernel, threads, smem, num_sms};
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [k, v] : cache)
    if (k == key) return v;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess) {
    (void)cudaGetLastError();  // a failed query is not the caller's launch error
    per_sm = 0;
  }
  const int blocks = per_sm * num_sms;
  cache.emplace_back(key, blocks);
  return blocks;
}

bool OneKernelAllowed(bool one_kernel) {
  const char* v = std::getenv("JAX_MOE_CUDA_ONE_KERNEL");
  if (v != nullptr && std::strcmp(v, "0") == 0) return false;
  if (v != nullptr && std::strcmp(v, "force") == 0) return true;
  return one_kernel;
}

}  // namespace jax_moe::cuda
