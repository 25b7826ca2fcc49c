// A block's share of a half's work. A half's kernel runs part blockIdx.x of gridDim.x; the one-shot kernel takes its
// parts from a queue (queue.cuh), so the bodies name their part instead of reading blockIdx / gridDim.
#pragma once

namespace jax_moe::cuda {

struct Part {
  int id;     // this block's part, in [0, count)
  int count;  // parts of the half in this launch
};

__device__ __forceinline__ Part BlockPart() { return {static_cast<int>(blockIdx.x), static_cast<int>(gridDim.x)}; }

}  // namespace jax_moe::cuda
