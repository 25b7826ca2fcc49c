// Host entry points of the dispatch/combine kernels: each enqueues its half (or, for the one-shot calls, both halves)
// on `stream` and returns the launch status.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

// dispatch_send: x [T, x_bytes], x_scale [T, scale_bytes] (or null), topk_weights [T, R] (or null), topk_idx [T, R]
// -> token records in the peers' receive areas (the weights travel with them, for CombineMode::kWeighted).
// ticket [4] int32 gets the epoch (it only orders dispatch_recv after this call).
struct DispatchSendIo {
  int tokens = 0;
  const void* x = nullptr;
  const void* x_scale = nullptr;
  const float* topk_weights = nullptr;
  const int32_t* topk_idx = nullptr;
  int32_t* ticket = nullptr;
};

// dispatch_recv: receive area -> expert_x [M, x_bytes], expert_x_scale [M, scale_bytes] (or null), counts [L], route
// [RouteLength] (route[i] = source rank * max_tokens * R + t * R + k of row i; route[M] = rows received; then the
// block offsets and the per-(sender, entry) row table, see RouteLength). x / x_scale / topk_weights [x_tokens, ...]
// are this rank's dispatch_send inputs: its own tokens are read from them. padding: Padding (what the rows after the
// received ones get).
struct DispatchRecvIo {
  int padding = kPadLeave;
  const void* x = nullptr;
  const void* x_scale = nullptr;
  const float* topk_weights = nullptr;
  int x_tokens = 0;
  void* expert_x = nullptr;
  void* expert_x_scale = nullptr;
  int32_t* counts = nullptr;
  int32_t* route = nullptr;
  const int32_t* ticket = nullptr;  // the send's ticket (split calls): its epoch must be the one this receive is due
};

// combine_send: expert_y [M, hidden] (bf16) -> the token owners' combine areas of `channel`: per (t, k) entry, or per
// (token, rank) summed here (mode: CombineMode).
struct CombineSendIo {
  int channel = 0;
  int mode = kPerEntry;
  const void* expert_y = nullptr;
  const int32_t* route = nullptr;
  int32_t* ticket = nullptr;
};

// combine_recv: out[t] = sum over sent k of w[t, k] * y(t, k), float32 accumulation, bf16 out [T, hidden]. expert_y is
// this rank's combine_send input: the entries this rank served itself are read from it (they were not copied).
// `mode` must be combine_send's: in the reduced modes a peer on this node sent one summed row per token.
struct CombineRecvIo {
  int channel = 0;
  int mode = kPerEntry;
  int tokens = 0;
  const float* topk_weights = nullptr;
  const int32_t* topk_idx = nullptr;
  const void* expert_y = nullptr;
  void* out = nullptr;
  const int32_t* ticket = nullptr;  // the send's ticket (split calls): its epoch must be the one this receive is due
};

cudaError_t LaunchDispatchSend(const KernelArgs& a, const DispatchSendIo& io, cudaStream_t stream);
cudaError_t LaunchDispatchRecv(const KernelArgs& a, const DispatchRecvIo& io, cudaStream_t stream);
cudaError_t LaunchCombineSend(const KernelArgs& a, const CombineSendIo& io, cudaStream_t stream);
cudaError_t LaunchCombineRecv(const KernelArgs& a, const CombineRecvIo& io, cudaStream_t stream);

// The one-shot calls: both halves. Where every rank is on this node, one kernel runs both (its blocks take the send's
// parts, then the receive's, from a queue: kernels/queue.cuh), so no kernel boundary lies between the halves (~3.5 us
// on H200); the combine only at decode sizes. Otherwise the two halves' kernels back to back. `send_launched`: the
// two kernels' send was enqueued (a failure after it leaves the round open).
cudaError_t LaunchDispatch(const KernelArgs& a, const DispatchSendIo& send, const DispatchRecvIo& recv,
                           cudaStream_t stream, bool* send_launched);
cudaError_t LaunchCombine(const KernelArgs& a, const CombineSendIo& send, const CombineRecvIo& recv,
                          cudaStream_t stream, bool* send_launched);

// Blocks and threads per block of the kernel of each half (the launchers use them; the benchmark reports them): how
// many SMs a half occupies while its data is in flight. dispatch_send's include the pack blocks of ranks on other
// nodes and the block that polls for them, which derive their index themselves.
struct LaunchShape {
  int blocks = 0;
  int threads = 0;
};
LaunchShape DispatchSendShape(const KernelArgs& a, int tokens);
LaunchShape DispatchRecvShape(const KernelArgs& a);
LaunchShape CombineSendShape(const KernelArgs& a, int mode);
LaunchShape CombineRecvShape(const KernelArgs& a, int tokens);
// The one kernel of a one-shot call (blocks 0 where it is not used: ranks on other nodes, the combine past decode
// sizes, JAX_MOE_CUDA_ONE_KERNEL=0).
LaunchShape DispatchShape(const KernelArgs& a, int tokens);
LaunchShape CombineShape(const KernelArgs& a, int mode, int tokens);

// Reads `bytes` (a multiple of 16) of src once with `blocks` blocks (the benchmark's host-read bandwidth).
cudaError_t LaunchReadFold(const void* src, size_t bytes, unsigned long long* out, int blocks, cudaStream_t stream);

// Writes %globaltimer (ns) into out[0]: a device-side time stamp for benchmarks.
cudaError_t LaunchTimestamp(uint64_t* out, cudaStream_t stream);

}  // namespace jax_moe::cuda
