// Host entry points of the remote-rank kernels (kernels/fabric.cu), called by the halves' launchers.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

// The regions of dispatch_send's remote ranks into the send area, then the bell (before the NVLink kernel, which
// advances the epoch).
cudaError_t LaunchDispatchPack(const KernelArgs& a, int tokens, const void* x, const void* x_scale,
                               const float* topk_weights, const int32_t* topk_idx, cudaStream_t stream);

// The index of channel `channel`'s remote rows for combine mode `mode`, before combine_recv's kernel, which reads its
// rows of remote ranks from it.
cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream);

// Shared memory a block of the index kernel needs (its static, and 32 bits per local expert and warp): set-up
// refuses a shape whose need exceeds the GPU's opt-in limit.
size_t IndexSharedBytes(const MoeShape& s);

}  // namespace jax_moe::cuda
