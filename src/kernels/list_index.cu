// dispatch_send's expert lists from an index at prefill (more tokens than one block's chunks): where ListExpert gives
// each local expert a block that reads every token's ids for that one expert (O(E_local x T x R) reads, ~30 us at
// 4096 tokens), two short launches index the ranks of this node once and the send kernel's token warps then put each
// entry straight at its place (O(T x R)). The index's masks, bits and bases are the remote ranks' (fabric_index.cuh,
// fabric_mark.cuh), in stream 0's slots of the node's ranks, which the pack blocks (remote ranks only) never touch;
// off[e] holds expert e's count. Kernel boundaries are the barriers: the send kernel's grid may exceed what is
// resident, so none of its blocks may wait for another.
#include "kernels/fabric_kernels.h"

#include "kernels/fabric_index.cuh"
#include "kernels/fabric_mark.cuh"
#include "kernels/grid.h"
#include "kernels/scan.cuh"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {
namespace {

// The i-th rank of this node (NVLink peers and this rank), in rank order.
__device__ __forceinline__ int NodeRank(const KernelArgs& a, int i) {
  for (int q = 0; q < a.s.num_ranks; ++q) {
    if (IsRemote(a, q)) continue;
    if (i-- == 0) return q;
  }
  return -1;
}

// Step 1: block (i, b) of `per` marks chunks 8b + warp of the i-th node rank (its mask, and its experts' bits).
__global__ void __launch_bounds__(kThreads) ListMarkKernel(KernelArgs a, int per, int tokens, const int32_t* idx) {
  extern __shared__ unsigned warp_bits[];  // [kWarps][l]
  const int l = a.s.local_experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int p = NodeRank(a, blockIdx.x / per);
  const int c = (blockIdx.x % per) * kWarps + warp;
  if (p < 0 || c >= chunks) return;  // the same for the whole warp; no barrier below
  const RankIndex ix = IndexOf(a, 0, p);
  unsigned* wb = warp_bits + warp * l;
  MarkChunk(a, p, c, tokens, idx, true, ix.mask + c, wb);
  for (int e = lane; e < l; e += 32) ix.bits[static_cast<size_t>(c) * l + e] = wb[e];
}

// Step 2: warp w of block (i, b) adds up expert j = b * kWarps + w's column of the i-th node rank: its bases (entries
// with j in the chunks before each chunk) and its total in off[j], the expert's count. (An NVLink list is one list
// per expert, so unlike a remote rank's region nothing needs the experts' running offsets, nor the slots.)
__global__ void __launch_bounds__(kThreads) ListSumKernel(KernelArgs a, int per, int tokens) {
  const int l = a.s.local_experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int p = NodeRank(a, blockIdx.x / per);
  const int j = (blockIdx.x % per) * kWarps + warp;
  if (p < 0 || j >= l) return;  // the same for the whole warp; no barrier
  const RankIndex ix = IndexOf(a, 0, p);
  int acc = 0;
  for (int c0 = 0; c0 < chunks; c0 += 32) {  // 32 chunks a step, a lane each, their prefix by shuffles
    const int c = c0 + lane;
    const int v = c < chunks ? __popc(ix.bits[static_cast<size_t>(c) * l + j]) : 0;
    const int inc = WarpInclusiveSum(v);
    if (c < chunks) ix.base[static_cast<size_t>(c) * l + j] = acc + inc - v;
    acc += __shfl_sync(0xffffffffu, inc, 31);
  }
  if (lane == 0) ix.off[j] = acc;
}

}  // namespace

// Beyond one block's chunks, and where a block's marks fit the 48 KiB a launch gets without opting in (up to 1536
// local experts; beyond, ListExpert as at decode). Not with ranks on other nodes: there the pack blocks are the send
// kernel's tail, and the two launches in front of it cost more than the lists save (2026-12-07 evening, one H100:
// prefill dispatch_send 102.2 us with them, 83.3 without; EP1 28.4 against 36.0).
bool ListsIndexed(const KernelArgs& a, int tokens) {
  return a.num_remote == 0 && (tokens + kIndexChunk - 1) / kIndexChunk > kWarps &&
         IndexBitsBytes(a.s.local_experts) <= 48 * 1024;
}

cudaError_t LaunchListIndex(const KernelArgs& a, int tokens, const int32_t* topk_idx, cudaStream_t stream) {
  if (!ListsIndexed(a, tokens)) return cudaSuccess;
  const int node = a.s.num_ranks - a.num_remote;
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int mark = (chunks + kWarps - 1) / kWarps;
  const size_t smem = IndexBitsBytes(a.s.local_experts);
  if (cudaError_t err = AllowSmem(ListMarkKernel, smem); err != cudaSuccess) return err;  // a no-op while <= 48 KiB
  ListMarkKernel<<<mark * node, kThreads, smem, stream>>>(a, mark, tokens, topk_idx);
  if (cudaError_t err = cudaGetLastError(); err != cudaSuccess) return err;
  const int sum = (a.s.local_experts + kWarps - 1) / kWarps;  // a warp per expert column
  ListSumKernel<<<sum * node, kThreads, 0, stream>>>(a, sum, tokens);
  return cudaGetLastError();
}

}  // namespace jax_moe::cuda
