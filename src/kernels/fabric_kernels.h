// Host entry points of the remote-rank kernels (kernels/fabric.cu), called by the halves' launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

// dispatch_send's pack blocks (fabric_pack.cuh), `blocks` after its block 0 (which polls for them): per_rank for each
// remote rank; `fold`: each derives the index in `smem` bytes of its shared memory (decode), else the index kernel runs first.
struct PackPlan {
  int blocks = 0;  // 0: no remote ranks
  int per_rank = 0;
  int fold = 0;
  size_t smem = 0;
};
PackPlan DispatchPackPlan(const KernelArgs& a, int tokens);

// dispatch_send's blocks before its NVLink blocks: block 0, which polls the lane's kSent word for the pack blocks,
// then the `packs` pack blocks (none without remote ranks).
__host__ __device__ inline int FabricBlocks(int packs) { return packs > 0 ? packs + 1 : 0; }

// The dispatch index for the pack blocks, before dispatch_send's kernel (nothing where they fold it or are none).
cudaError_t LaunchDispatchIndex(const KernelArgs& a, const PackPlan& plan, int tokens, const int32_t* topk_idx,
                                cudaStream_t stream);

// The index of channel `channel`'s remote rows for combine mode `mode`, before combine_recv's kernel, which reads its
// rows of remote ranks from it.
cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream);

// Shared memory a block of the index kernel needs (its static, and 32 bits per local expert and warp): set-up
// refuses a shape whose need exceeds the GPU's opt-in limit.
size_t IndexSharedBytes(const MoeShape& s);

}  // namespace jax_moe::cuda
