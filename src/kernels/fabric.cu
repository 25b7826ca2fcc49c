// The kernels of ranks on other nodes (regions the host proxy moves; layout in moe_layout.h, "ranks on other
// nodes"): the index of where each token and entry goes in a remote rank's region (derived as fabric_mark.cuh says:
// for combine_recv by IndexKernel, once per call and channel; for dispatch_send by its own pack blocks, each in its
// shared memory at decode, together in global memory beyond; its readers in fabric_index.cuh), and the plan of
// dispatch_send's pack blocks (their body: fabric_pack.cuh, run inside dispatch_send's kernel). combine_recv reads
// its remote rows from its channel's index. Launched next to the NVLink kernels of the same half, only when the
// Communicator has remote ranks.
//
// The index: a chunk of 32 tokens has a mask saying which of its tokens have an entry on p and per-expert bits saying
// which have an entry with expert e; the last block of p's chunks adds up the chunks before each chunk. A token's slot
// is then its chunk's base plus the set bits below its own, so every token and entry is placed by one warp with no
// scan of its own.
#include "kernels/fabric_kernels.h"

#include "kernels/fabric_index.cuh"
#include "kernels/fabric_mark.cuh"
#include "kernels/grid.h"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {
namespace {

// The index of `stream` (0: dispatch_send, 1 + c: combine_recv of channel c) for every remote rank: block (i, b) of
// `per_rank` serves the i-th remote rank p, its warp w marks chunk 8b + w. The last of p's blocks then derives p's
// bases, so the ranks' sums run in parallel. Touches only this device's index of `stream`, so it waits on nothing.
__global__ void __launch_bounds__(kThreads)
    IndexKernel(KernelArgs a, int stream, int lists, int per_rank, int tokens, const int32_t* idx) {
  extern __shared__ unsigned warp_bits[];  // [kWarps][l] with lists
  __shared__ int sums[kWarps];
  __shared__ int last;
  const MoeShape& s = a.s;
  const int l = s.local_experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int p = RemoteRank(a, blockIdx.x / per_rank);  // >= 0: the grid is per_rank blocks per remote rank
  const int c = (blockIdx.x % per_rank) * kWarps + warp;
  const RankIndex ix = IndexOf(a, stream, p);
  if (c < chunks) {  // the same for the whole warp
    unsigned* wb = warp_bits + warp * l;
    MarkChunk(a, p, c, tokens, idx, lists, ix.mask + c, wb);
    if (lists)
      for (int e = lane; e < l; e += 32) ix.bits[static_cast<size_t>(c) * l + e] = wb[e];
  }
  // The last of p's blocks sees all of p's chunks (each thread's fenced before its block arrives).
  unsigned* done = reinterpret_cast<unsigned*>(a.base + a.lay.fdone) + stream * s.num_ranks + p;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(done, 1u) == static_cast<unsigned>(per_rank) - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) *done = 0;  // all of p's blocks have arrived: re-armed for the next launch
  IndexPrefixes<true>(a, ix, chunks, lists, sums);
}

// Launches IndexKernel for `stream`: a warp per chunk of every remote rank.
cudaError_t LaunchIndex(const KernelArgs& a, int stream, bool lists, int tokens, const int32_t* idx, cudaStream_t cs) {
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int per = chunks > kWarps ? (chunks + kWarps - 1) / kWarps : 1;
  const size_t smem = lists ? IndexBitsBytes(a.s.local_experts) : 0;
  if (cudaError_t err = AllowSmem(IndexKernel, smem); err != cudaSuccess) return err;
  IndexKernel<<<per * a.num_remote, kThreads, smem, cs>>>(a, stream, lists ? 1 : 0, per, tokens, idx);
  return cudaGetLastError();
}

}  // namespace

size_t IndexSharedBytes(const MoeShape& s) {
  cudaFuncAttributes attr{};  // its static shared memory shares the opt-in limit with the dynamic bits
  size_t fixed = cudaFuncGetAttributes(&attr, IndexKernel) == cudaSuccess ? attr.sharedSizeBytes : 1024;
  const size_t pack = PackStaticBytes();  // dispatch_send's kernel keeps the same bits where its pack blocks derive
  if (pack > fixed) fixed = pack;
  return fixed + IndexBitsBytes(s.local_experts);
}

PackPlan DispatchPackPlan(const KernelArgs& a, int tokens) {
  PackPlan plan;
  if (a.num_remote <= 0) return plan;
  // At decode an index launch cost what it saved the pack: each pack block derives the index in shared memory
  // instead. That stays under the 48 KiB a launch gets without opting in, beside the kernel's static shared memory.
  // Beyond, a rank's pack blocks derive it together in global memory (DeriveIndex), with their warps' marks in
  // shared memory: an index launch before the kernel held back its NVLink blocks, which do not read it (prefill,
  // 2026-12-07: 13-20 us of dispatch_send's ~100).
  constexpr size_t kFoldMost = 40 * 1024;
  plan.fold = (tokens + kIndexChunk - 1) / kIndexChunk <= kWarps && FoldBytes(a.s.local_experts) <= kFoldMost;
  plan.smem = plan.fold ? FoldBytes(a.s.local_experts) : IndexBitsBytes(a.s.local_experts);
  // A warp per token, at most one block per SM in all with block 0, which polls for them (FabricBlocks): the kernel
  // fits two an SM, so the NVLink blocks launched
  // after them find room beside them rather than wait for them to end (prefill, 2026-12-04: with two pack blocks an
  // SM the two kinds ran one after the other, 64 us).
  int per = (tokens + kWarps - 1) / kWarps;
  const int most = (a.num_sms - 1) / a.num_remote;
  per = per > most ? most : per;
  plan.per_rank = per < 1 ? 1 : per;
  plan.blocks = plan.per_rank * a.num_remote;
  return plan;
}

cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream) {
  return LaunchIndex(a, 1 + channel, mode == kPerEntry, tokens, topk_idx, stream);
}

}  // namespace jax_moe::cuda
