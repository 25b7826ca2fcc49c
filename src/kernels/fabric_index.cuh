// The remote ranks' index (MoeLayout::fmask ... foff; written by IndexKernel, kernels/fabric.cu, and by dispatch_send's
// pack blocks, fabric_pack.cuh) and its readers: where a token goes among a remote rank p's slots, and an entry among
// p's entries. Per remote rank p, tokens with an entry on p are numbered in token order (their slots: dispatch sends
// and combine returns them in this order), p's entries in (local expert, token) order (the lists). Tokens go in
// chunks of kIndexChunk = 32, a bit each.
#pragma once
#include <cstdint>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {

static_assert(kIndexChunk == 32, "a chunk is one warp's lanes, a bit each in 32-bit masks");

// One fabric stream's index of rank p.
struct RankIndex {
  uint32_t* mask;   // [C] bit j: token 32c + j has an entry on p
  int32_t* sbase;   // [C] p's slots in the chunks before c
  uint32_t* bits;   // [C][l] bit j: token 32c + j has an entry with p's local expert e
  int32_t* base;    // [C][l] entries with p's expert e in the chunks before c
  int32_t* off;     // [l + 2] where expert e's entries start; [l]: p's entries, [l + 1]: p's slots
};

__device__ __forceinline__ RankIndex IndexOf(const KernelArgs& a, int stream, int p) {
  const MoeShape& s = a.s;
  const size_t c = IndexChunks(s), l = s.local_experts;
  const size_t at = static_cast<size_t>(stream) * s.num_ranks + p;
  return {reinterpret_cast<uint32_t*>(a.base + a.lay.fmask) + at * c,
          reinterpret_cast<int32_t*>(a.base + a.lay.fsbase) + at * c,
          reinterpret_cast<uint32_t*>(a.base + a.lay.fbits) + at * c * l,
          reinterpret_cast<int32_t*>(a.base + a.lay.fbase) + at * c * l,
          reinterpret_cast<int32_t*>(a.base + a.lay.foff) + at * (l + 2)};
}

__device__ __forceinline__ unsigned Below(int j) { return (1u << j) - 1u; }  // bits of the lanes before lane j

// Token t's slot among p's, or -1 where p gets none of it.
__device__ __forceinline__ int SlotOf(const RankIndex& ix, int t) {
  const int c = t / kIndexChunk, j = t % kIndexChunk;
  const unsigned m = ix.mask[c];
  return (m >> j) & 1u ? ix.sbase[c] + __popc(m & Below(j)) : -1;
}

// Entry (t, k) with p's local expert e: its position among p's entries.
__device__ __forceinline__ int EntryOf(const RankIndex& ix, int l, int t, int e) {
  const int c = t / kIndexChunk, j = t % kIndexChunk;
  const size_t at = static_cast<size_t>(c) * l + e;
  return ix.off[e] + ix.base[at] + __popc(ix.bits[at] & Below(j));
}

}  // namespace jax_moe::cuda
