// Host entry points of the remote-rank kernels (kernels/fabric.cu), called by the halves' launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/grid.h"
#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

// dispatch_send's pack blocks (fabric_pack.cuh), `blocks` after its block 0 (which polls for them): per_rank for each
// remote rank; `fold`: each derives the index in `smem` bytes of its shared memory (decode), else a rank's blocks
// derive it together, their warps' marks in `smem` bytes of it (IndexBitsBytes).
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

// The index's marks in shared memory where a block derives it with lists: 32 bits per local expert and warp.
__host__ __device__ inline size_t IndexBitsBytes(int l) { return sizeof(unsigned) * kWarps * size_t(l); }

// dispatch_send's kernel's static shared memory (dispatch.cu), beside which its pack blocks keep IndexBitsBytes.
size_t PackStaticBytes();

// dispatch_send's expert lists at prefill come from an index of this node's ranks (list_index.cu), not from a scan
// per expert: true where the tokens are more than one block's chunks.
bool ListsIndexed(const KernelArgs& a, int tokens);
// That index, in two launches before dispatch_send's kernel (nothing where ListsIndexed is false).
cudaError_t LaunchListIndex(const KernelArgs& a, int tokens, const int32_t* topk_idx, cudaStream_t stream);

// The index of channel `channel`'s remote rows for combine mode `mode`, before combine_recv's kernel, which reads its
// rows of remote ranks from it.
cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream);

// Shared memory a block deriving the index needs (the index kernel's or dispatch_send's static, whichever is more,
// and 32 bits per local expert and warp): set-up refuses a shape whose need exceeds the GPU's opt-in limit.
size_t IndexSharedBytes(const MoeShape& s);

}  // namespace jax_moe::cuda
