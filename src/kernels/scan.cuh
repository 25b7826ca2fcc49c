// Block-wide prefix sums: one warp-shuffle scan of a value per thread, and the two shapes built on it (an array in
// shared memory, blockDim.x items at a time; runs of items per thread, for items read from global memory).
#pragma once

namespace jax_moe::cuda {

// The inclusive prefix of v over the warp's lanes, in lane order (every lane of the warp calls it).
__device__ __forceinline__ int WarpInclusiveSum(int v) {
  const int lane = threadIdx.x & 31;
  int inc = v;
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += u;
  }
  return inc;
}

// The exclusive prefix of v over the block's threads, in thread order; *total gets the block's sum (alike in every
// thread). Every thread calls it (barriers); `sums` is shared scratch of one int per warp; blockDim.x is a multiple
// of 32. Ends with a barrier, so `sums` may be reused at once.
__device__ inline int BlockExclusiveSum(int v, int* sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int inc = WarpInclusiveSum(v);
  if (lane == 31) sums[warp] = inc;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    const int c = sums[w];
    before += w < warp ? c : 0;
    all += c;
  }
  __syncthreads();
  *total = all;
  return before + inc - v;
}

// In-place inclusive prefix sum of data[0..n) in shared memory by the whole block (any n). `sums`: one int per warp
// of shared scratch. Ends with a barrier.
__device__ inline void BlockInclusiveScan(int* data, int n, int* sums) {
  int carry = 0;
  for (int base = 0; base < n; base += blockDim.x) {  // each thread reads and writes only its own item
    const int i = base + threadIdx.x;
    const int v = i < n ? data[i] : 0;
    int total = 0;
    const int before = BlockExclusiveSum(v, sums, &total);
    if (i < n) data[i] = carry + before + v;
    carry += total;
  }
  __syncthreads();
}

// The exclusive prefix sum of n items, thread i taking a run of consecutive items so that the result is in item
// order: get(i) reads item i (it is read twice), put(i, prefix) writes its prefix (it may overwrite the item: every
// read of the first pass is before the barrier). Returns the total, alike in every thread; ends with a barrier.
template <class Get, class Put>
__device__ int BlockScanRuns(int n, int* sums, Get get, Put put) {
  const int run = (n + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int i0 = min(n, static_cast<int>(threadIdx.x) * run), i1 = min(n, i0 + run);
  int mine = 0;
  for (int i = i0; i < i1; ++i) mine += get(i);
  int total = 0;
  int next = BlockExclusiveSum(mine, sums, &total);
  for (int i = i0; i < i1; ++i) {
    const int v = get(i);
    put(i, next);
    next += v;
  }
  __syncthreads();
  return total;
}

// BlockScanRuns for one warp, lane j taking a run of consecutive items (no barrier: a warp's lanes alone). Returns
// the total, alike in every lane.
template <class Get, class Put>
__device__ inline int WarpScanRuns(int n, Get get, Put put) {
  const int lane = threadIdx.x & 31;
  const int run = (n + 31) / 32;
  const int i0 = min(n, lane * run), i1 = min(n, i0 + run);
  int mine = 0;
  for (int i = i0; i < i1; ++i) mine += get(i);
  const int inc = WarpInclusiveSum(mine);
  const int total = __shfl_sync(0xffffffffu, inc, 31);
  int next = inc - mine;
  for (int i = i0; i < i1; ++i) {
    const int v = get(i);
    put(i, next);
    next += v;
  }
  return total;
}

}  // namespace jax_moe::cuda
