#include "kernels/one_kernel.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <tuple>
#include <vector>

namespace jax_moe::cuda {

int ResidentBlocks(const void* kernel, int threads, size_t smem, int num_sms) {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 0;
  }
  using Key = std::tuple<int, const void*, int, size_t, int>;
  static std::mutex mu;
  static std::vector<std::pair<Key, int>> cache;  // a handful of entries: devices x kernels x shapes in use
  const Key key{device, kernel, threads, smem, num_sms};
  std::lock_guard<std::mutex> lock(mu);
  for (const auto& [k, v] : cache)
    if (k == key) return v;
  int per_sm = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, smem) != cudaSuccess || per_sm <= 0) {
    (void)cudaGetLastError();  // a failed query is not the caller's launch error
    return 0;
  }
  const int blocks = per_sm * num_sms;
  cache.emplace_back(key, blocks);
  return blocks;
}

bool OneKernelAllowed() {
  const char* v = std::getenv("JAX_MOE_CUDA_ONE_KERNEL");
  return v == nullptr || std::strcmp(v, "0") != 0;
}

int OneKernelBlocks(const void* kernel, int threads, size_t smem, int num_sms, int parts) {
  const int fit = ResidentBlocks(kernel, threads, smem, num_sms);
  const int wave = fit > 0 ? fit : num_sms;  // unknown occupancy: one block an SM
  return std::max(1, std::min(parts, wave));
}

}  // namespace jax_moe::cuda
