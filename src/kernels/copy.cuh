// Warp-cooperative row copies (16-byte vectors, several loads in flight) and zeroing.
#pragma once
#include <cstdint>

namespace jax_moe::cuda {

// L2-only loads: the data may have been written by a peer GPU, so L1 must not serve a stale line.
__device__ __forceinline__ int4 LoadCg(const int4* p) { return __ldcg(p); }

// Copies `bytes` (multiple of 16) from src to dst with the 32 lanes of a warp, kUnroll vectors a lane in flight (4 KiB
// a warp): over NVLink the stores' throughput depends on how many bytes each warp keeps moving. 16 (a 7168-byte fp8
// row in one batch) would save a latency per row but pushed the receive kernel past 128 registers, so it spilled.
__device__ __forceinline__ void WarpCopy16(void* dst, const void* src, int bytes, int lane) {
  constexpr int kUnroll = 8;
  const int4* s = static_cast<const int4*>(src);
  int4* d = static_cast<int4*>(dst);
  const int n = bytes >> 4;
  int i = lane;
  for (; i + (kUnroll - 1) * 32 < n; i += kUnroll * 32) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = LoadCg(s + i + u * 32);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) d[i + u * 32] = v[u];
  }
  // The rest (under kUnroll vectors a lane) in one batch too: loads first, then stores. A load-store loop would
  // wait out one memory latency per vector, since the compiler cannot move a load above a store that may alias it
  // (a 7168-byte row ends in 192 such vectors: 6 round trips a lane).
  int4 v[kUnroll];
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (i + u * 32 < n) v[u] = LoadCg(s + i + u * 32);
#pragma unroll
  for (int u = 0; u < kUnroll; ++u)
    if (i + u * 32 < n) d[i + u * 32] = v[u];
}

// Rows are moved in pieces of kChunkBytes, one warp each: more warps carry NVLink traffic at once than with one warp
// per row (a 14 KiB bf16 row of hidden 7168 is 4 pieces).
constexpr int kChunkBytes = 4096;
__host__ __device__ inline int ChunksOf(int bytes) { return (bytes + kChunkBytes - 1) / kChunkBytes; }

// Fills `bytes` (multiple of 16) with the 32-bit word `word`, with the 32 lanes of a warp.
__device__ __forceinline__ void WarpFill16(void* dst, int bytes, int word, int lane) {
  int4* d = static_cast<int4*>(dst);
  const int4 v = make_int4(word, word, word, word);
  for (int i = lane; i < (bytes >> 4); i += 32) d[i] = v;
}

// A row of 4-byte words (the fp8 scales: 56 floats for hidden 7168) carried by a warp in registers: load() issues
// every load of the first kWords * 32 words, store() writes them (and copies any rest), so a caller can put other
// loads in flight between the two instead of waiting out the scales' latency alone.
struct WarpWords4 {
  static constexpr int kWords = 4;
  int v[kWords];
  __device__ __forceinline__ void load(const void* src, int bytes, int lane) {
    const int* s = static_cast<const int*>(src);
#pragma unroll
    for (int u = 0; u < kWords; ++u)
      if (lane + 32 * u < (bytes >> 2)) v[u] = __ldcg(s + lane + 32 * u);
  }
  __device__ __forceinline__ void store(void* dst, const void* src, int bytes, int lane) const {
    int* d = static_cast<int*>(dst);
#pragma unroll
    for (int u = 0; u < kWords; ++u)
      if (lane + 32 * u < (bytes >> 2)) d[lane + 32 * u] = v[u];
    for (int i = lane + 32 * kWords; i < (bytes >> 2); i += 32) d[i] = __ldcg(static_cast<const int*>(src) + i);
  }
};

// Copies `bytes` (multiple of 4) with 4-byte words, loads before stores.
__device__ __forceinline__ void WarpCopy4(void* dst, const void* src, int bytes, int lane) {
  WarpWords4 w;
  w.load(src, bytes, lane);
  w.store(dst, src, bytes, lane);
}

}  // namespace jax_moe::cuda
