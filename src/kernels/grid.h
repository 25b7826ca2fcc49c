// Launch shapes shared by the dispatch and combine kernels.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace jax_moe::cuda {

constexpr int kThreads = 256;  // threads of a block (combine_recv excepted)
constexpr int kWarps = kThreads / 32;

// Blocks for `work_items` items at `per_block` items a block, at most 2 per SM (grid-stride loops take the rest).
inline int GridFor(long long work_items, int per_block, int num_sms) {
  long long blocks = (work_items + per_block - 1) / per_block;
  if (blocks > 2LL * num_sms) blocks = 2LL * num_sms;
  return blocks < 1 ? 1 : static_cast<int>(blocks);
}

// Lets `kernel` take `smem` dynamic shared bytes (past 48 KiB a kernel must opt in).
template <typename Kernel>
cudaError_t AllowSmem(Kernel kernel, size_t smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
}

}  // namespace jax_moe::cuda
