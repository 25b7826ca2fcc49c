// Host entry points of the dispatch/combine kernels: each enqueues its half on `stream` and returns the launch status.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

// x [T, x_bytes], x_scale [T, scale_bytes] (or null), topk_weights [T, R] (or null), topk_idx [T, R] -> token records
// in the peers' receive areas (the weights travel with them, for CombineMode::kWeighted).
// ticket [4] int32 gets the epoch (it only orders dispatch_recv after this call).
cudaError_t LaunchDispatchSend(const KernelArgs& a, int tokens, const void* x, const void* x_scale,
                               const float* topk_weights, const int32_t* topk_idx, int32_t* ticket,
                               cudaStream_t stream);

// Receive area -> expert_x [M, x_bytes], expert_x_scale [M, scale_bytes] (or
// null), counts [L], route [RouteLength] (route[i] = source rank * max_tokens * R + t * R + k of row i; route[M] = rows
// received; then the block offsets and the per-(sender, entry) row table, see RouteLength). x / x_scale /
// topk_weights [x_tokens, ...] are this rank's dispatch_send inputs: its own tokens are read from them.
// padding: Padding (what the rows after the received ones get).
cudaError_t LaunchDispatchRecv(const KernelArgs& a, int padding, const void* x, const void* x_scale, const float* topk_weights,
                               int x_tokens, void* expert_x, void* expert_x_scale, int32_t* counts, int32_t* route,
                               cudaStream_t stream);

// expert_y [M, hidden] (bf16) -> the token owners' combine areas of `channel`: per (t, k) entry, or per (token, rank)
// summed here (mode: CombineMode).
cudaError_t LaunchCombineSend(const KernelArgs& a, int channel, int mode, const void* expert_y, const int32_t* route,
                              int32_t* ticket, cudaStream_t stream);

// out[t] = sum over sent k of w[t, k] * y(t, k), float32 accumulation, bf16 out [T, hidden]. expert_y is this rank's
// combine_send input: the entries this rank served itself are read from it (they were not copied).
// `mode` must be combine_send's: in the reduced modes a peer on this node sent one summed row per token.
cudaError_t LaunchCombineRecv(const KernelArgs& a, int channel, int mode, int tokens, const float* topk_weights,
                              const int32_t* topk_idx, const void* expert_y, void* out, cudaStream_t stream);

// Blocks and threads per block of the NVLink kernel of each half (the launchers use them; the benchmark reports
// them): how many SMs a half occupies while its data is in flight. Ranks on other nodes add the pack / index kernels.
struct LaunchShape {
  int blocks = 0;
  int threads = 0;
};
LaunchShape DispatchSendShape(const KernelArgs& a, int tokens);
LaunchShape DispatchRecvShape(const KernelArgs& a);
LaunchShape CombineSendShape(const KernelArgs& a, int mode);
LaunchShape CombineRecvShape(const KernelArgs& a, int tokens);

// Reads `bytes` (a multiple of 16) of src once with `blocks` blocks (the benchmark's host-read bandwidth).
cudaError_t LaunchReadFold(const void* src, size_t bytes, unsigned long long* out, int blocks, cudaStream_t stream);

// Writes %globaltimer (ns) into out[0]: a device-side time stamp for benchmarks.
cudaError_t LaunchTimestamp(uint64_t* out, cudaStream_t stream);

}  // namespace jax_moe::cuda
