// How the remote ranks' index (fabric_index.cuh) is derived from topk_idx: chunks of 32 tokens marked by a warp each,
// then the bases added up by one block. IndexKernel (fabric.cu) does it once per call in global memory for combine_recv;
// dispatch_send's pack blocks (fabric_pack.cuh) at decode each in their own shared memory (`SharedIndex`), beyond
// together in global memory (`DeriveIndex`).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/fabric_index.cuh"
#include "kernels/grid.h"
#include "kernels/moe_layout.h"
#include "kernels/scan.cuh"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {

// The i-th remote rank.
__device__ __forceinline__ int RemoteRank(const KernelArgs& a, int i) {
  for (int q = 0; q < a.s.num_ranks; ++q) {
    if (!IsRemote(a, q)) continue;
    if (i-- == 0) return q;
  }
  return -1;
}

// A word of the index's masks: through L2 where other blocks wrote it (global memory), else as is (shared memory).
template <bool kGlobal>
__device__ __forceinline__ int Bits(const uint32_t* p) {
  if constexpr (kGlobal) return __popc(__ldcg(p));
  return __popc(*p);
}

// Entries of token t on p as bits per k (first occurrences of valid ids, like every half), its ids loaded once and
// compared in registers: kMost (a compile-time bound) >= experts_per_token.
template <int kMost>
__device__ __forceinline__ unsigned EntriesOn(const KernelArgs& a, int p, const int32_t* row) {
  const int r = a.s.experts_per_token, l = a.s.local_experts;
  int ids[kMost];
#pragma unroll
  for (int k = 0; k < kMost; ++k) ids[k] = k < r ? row[k] : -1;
  unsigned ks = 0;
#pragma unroll
  for (int k = 0; k < kMost; ++k) {
    const int g = ids[k];
    bool first = g >= 0 && g < a.s.num_experts && g / l == p;
#pragma unroll
    for (int j = 0; j < k; ++j) first = first && ids[j] != g;
    if (first) ks |= 1u << k;
  }
  return ks;
}

// A warp per token, lane k holding the token's id g of entry k (-1 past r): whether entry k is the first naming a valid
// expert (EntriesOn's rule, a lane per k). Every lane of the warp calls it.
__device__ __forceinline__ bool FirstValidEntry(const KernelArgs& a, int g) {
  const int lane = threadIdx.x & 31;
  bool first = g >= 0 && g < a.s.num_experts;
  for (int k = 0; k + 1 < a.s.experts_per_token; ++k) {
    const int h = __shfl_sync(0xffffffffu, g, k);
    if (k < lane && h == g) first = false;
  }
  return first;
}

// Chunk c of rank p's index, by one warp: lane j takes token 32c + j, whose entries on p set bit j of *mask and, with
// `lists`, of bits[e] for each expert e.
__device__ inline void MarkChunk(const KernelArgs& a, int p, int c, int tokens, const int32_t* idx, bool lists,
                                 uint32_t* mask, uint32_t* bits) {
  const int r = a.s.experts_per_token, l = a.s.local_experts, lane = threadIdx.x & 31;
  const int t = c * kIndexChunk + lane;
  const int32_t* row = idx + static_cast<size_t>(t) * r;
  unsigned ks = 0;
  if (t < tokens) {
    if (r <= 8) {  // top-8 and below (DeepSeek-V3, Kimi-K2): every id in a register
      ks = EntriesOn<8>(a, p, row);
    } else {
      for (int k = 0; k < r; ++k) {
        const int g = SentExpert(row, k, a.s.num_experts);
        if (g >= 0 && g / l == p) ks |= 1u << k;
      }
    }
  }
  const unsigned m = __ballot_sync(0xffffffffu, ks != 0);
  if (lane == 0) *mask = m;
  if (!lists) return;
  for (int e = lane; e < l; e += 32) bits[e] = 0;
  __syncwarp();
  for (; ks != 0; ks &= ks - 1) atomicOr(&bits[row[__ffs(ks) - 1] - p * l], 1u << lane);
  __syncwarp();
}

// The bases of rank p's index once its chunks (`chunks` in use) are marked: the chunks' slot bases, the experts'
// chunk bases and their offsets (`lists`), and the totals. By the whole block (barriers); kGlobal: the index is in
// global memory and other blocks marked its chunks.
template <bool kGlobal>
__device__ void IndexPrefixes(const KernelArgs& a, const RankIndex& ix, int chunks, bool lists, int* sums) {
  const int l = a.s.local_experts, threads = static_cast<int>(blockDim.x);
  const int slots = BlockScanRuns(
      chunks, sums, [&](int c) { return Bits<kGlobal>(ix.mask + c); }, [&](int c, int v) { ix.sbase[c] = v; });
  if (lists) {
    // Each expert's column of chunks, in order, kBatch loads in flight (one at a time, the walk cost an L2 round trip
    // per chunk: ~50 us at prefill); its total goes to off[e] until the scan over experts below.
    constexpr int kBatch = 16;
    for (int e = threadIdx.x; e < l; e += threads) {
      int acc = 0;
      for (int c0 = 0; c0 < chunks; c0 += kBatch) {
        int n[kBatch];
#pragma unroll
        for (int u = 0; u < kBatch; ++u)
          n[u] = c0 + u < chunks ? Bits<kGlobal>(ix.bits + static_cast<size_t>(c0 + u) * l + e) : 0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (c0 + u < chunks) ix.base[static_cast<size_t>(c0 + u) * l + e] = acc;
          acc += n[u];
        }
      }
      ix.off[e] = acc;
    }
    __syncthreads();
    const int entries = BlockScanRuns(l, sums, [&](int e) { return ix.off[e]; }, [&](int e, int v) { ix.off[e] = v; });
    if (threadIdx.x == 0) ix.off[l] = entries;
  }
  if (threadIdx.x == 0) ix.off[l + 1] = slots;
}

// One block's own index in shared memory, where the tokens fit its warps' chunks (decode): [kWarps] mask, [kWarps]
// sbase, [kWarps][l] bits, [kWarps][l] base, [l + 2] off.
__host__ __device__ inline size_t FoldBytes(int l) {
  return sizeof(uint32_t) * (2 * kWarps * (1 + size_t(l)) + l + 2);
}

__device__ inline RankIndex SharedIndex(uint32_t* own, int l) {
  int32_t* i = reinterpret_cast<int32_t*>(own);
  return {own, i + kWarps, own + 2 * kWarps, i + 2 * kWarps + kWarps * l, i + 2 * kWarps * (1 + l)};
}

}  // namespace jax_moe::cuda
