// dispatch_send (plan + push rows to the experts' ranks over NVLink) and dispatch_recv (wait, place rows in the
// contract order: local expert, then source rank, then source token).
#include "kernels/copy.cuh"
#include "kernels/moe_kernels.h"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

inline int GridFor(long long work_items, int per_block, int num_sms) {
  long long blocks = (work_items + per_block - 1) / per_block;
  if (blocks > 2LL * num_sms) blocks = 2LL * num_sms;
  return blocks < 1 ? 1 : static_cast<int>(blocks);
}

// Block g: the tokens that send a row to expert g, in token order -> pos[t * R + k] (rank among them), hist[g].
// Block 0 also flags ids outside [0, E) other than -1 (they are treated as masked).
__global__ void __launch_bounds__(kThreads) PlanKernel(KernelArgs a, int tokens, const int32_t* idx) {
  const int g = blockIdx.x, r = a.s.r, experts = a.s.experts();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int32_t* hist = reinterpret_cast<int32_t*>(a.base + a.lay.hist);
  int32_t* pos = reinterpret_cast<int32_t*>(a.base + a.lay.pos);
  __shared__ int warp_count[kWarps];
  int running = 0;
  for (int base = 0; base < tokens; base += kThreads) {
    const int t = base + threadIdx.x;
    int kf = -1;
    if (t < tokens) {
      const int32_t* row = idx + static_cast<size_t>(t) * r;
      for (int k = 0; k < r; ++k)
        if (row[k] == g) { kf = k; break; }  // the first slot naming g; later repeats are masked
    }
    const unsigned m = __ballot_sync(0xffffffffu, kf >= 0);
    if (lane == 0) warp_count[warp] = __popc(m);
    __syncthreads();
    int before = 0, total = 0;
    for (int w = 0; w < kWarps; ++w) {
      before += w < warp ? warp_count[w] : 0;
      total += warp_count[w];
    }
    if (kf >= 0) pos[static_cast<size_t>(t) * r + kf] = running + before + __popc(m & ((1u << lane) - 1u));
    running += total;
    __syncthreads();
  }
  if (threadIdx.x == 0) hist[g] = running;
  if (g == 0) {
    for (int i = threadIdx.x; i < tokens * r; i += kThreads) {
      const int v = idx[i];
      if (v != -1 && (v < 0 || v >= experts)) RaiseError(a, kBadExpertId, v);
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    DispatchSendKernel(KernelArgs a, int tokens, const uint8_t* x, const uint8_t* xs, const int32_t* idx,
                       int32_t* handle) {
  extern __shared__ int smem[];
  const MoeShape& s = a.s;
  const int experts = s.experts();
  int* incl = smem;               // [E] inclusive prefix of hist over all experts
  int* off = smem + experts;      // [E] first slot of expert g inside its peer's block
  int* warp_sums = off + experts; // [32]
  const int32_t* hist = reinterpret_cast<const int32_t*>(a.base + a.lay.hist);
  const int32_t* pos = reinterpret_cast<const int32_t*>(a.base + a.lay.pos);
  const unsigned long long epoch = Local(a)->epoch[kDispatchSend] + 1;

  for (int i = threadIdx.x; i < experts; i += blockDim.x) incl[i] = hist[i];
  __syncthreads();
  BlockInclusiveScan(incl, experts, warp_sums);
  for (int i = threadIdx.x; i < experts; i += blockDim.x) {
    const int first = (i / s.l) * s.l;
    off[i] = incl[i] - hist[i] - (first > 0 ? incl[first - 1] : 0);
  }
  // The receivers must have consumed the previous epoch before their areas are overwritten.
  if (threadIdx.x < s.n) WaitAtLeast(a, Flags(a.base, a, kDispatchAck) + threadIdx.x, epoch - 1, 100 + threadIdx.x);
  __syncthreads();

  if (blockIdx.x == 0) {
    for (int i = threadIdx.x; i < experts; i += blockDim.x) {
      const int p = i / s.l;
      reinterpret_cast<int32_t*>(Peer(a, p) + a.lay.counts)[s.rank * s.l + (i - p * s.l)] = hist[i];
    }
  }
  const int lane = threadIdx.x & 31;
  const int items = tokens * s.r;
  for (int item = blockIdx.x * kWarps + (threadIdx.x >> 5); item < items; item += gridDim.x * kWarps) {
    const int t = item / s.r, k = item - t * s.r;
    const int g = SentExpert(idx + static_cast<size_t>(t) * s.r, k, experts);
    if (g < 0) continue;
    const int p = g / s.l;
    const size_t rec = static_cast<size_t>(s.rank) * s.c + off[g] + pos[item];
    uint8_t* peer = Peer(a, p);
    uint8_t* dst = peer + a.lay.rows + rec * s.rec_bytes;
    WarpCopy16(dst, x + static_cast<size_t>(t) * s.x_bytes, s.x_bytes, lane);
    if (xs) WarpCopy4(dst + s.x_bytes, xs + static_cast<size_t>(t) * s.scale_bytes, s.scale_bytes, lane);
    if (lane == 0) reinterpret_cast<int32_t*>(peer + a.lay.meta)[rec] = item;
  }
  FinishBlock(a, kDispatchSend, [&](LocalSync* ls) {
    for (int p = 0; p < s.n; ++p) StoreReleaseSys(Flags(Peer(a, p), a, kDispatchFlag) + s.rank, epoch);
    ls->epoch[kDispatchSend] = epoch;
    handle[0] = static_cast<int32_t>(epoch);
    handle[1] = handle[2] = handle[3] = 0;
  });
}

__global__ void __launch_bounds__(kThreads)
    DispatchRecvKernel(KernelArgs a, uint8_t* ox, uint8_t* os, int32_t* ocounts, int32_t* route) {
  extern __shared__ int smem[];
  const MoeShape& s = a.s;
  const int n = s.n, l = s.l, experts = s.experts();
  int* cnt = smem;                   // [n][l] rows from sender s for local expert e
  int* bend = cnt + experts;         // [n][l] inclusive prefix over (s, e) flattened
  int* start = bend + experts;       // [n][l] first expert_x row of block (s, e)
  int* est = start + experts;        // [l] inclusive prefix of per-expert totals
  int* spre = est + l;               // [n + 1] first flattened row of sender s
  int* ok = spre + n + 1;            // [n] sender signalled in time
  int* warp_sums = ok + n;           // [32]
  const unsigned long long epoch = Local(a)->epoch[kDispatchRecv] + 1;

  if (threadIdx.x < n) ok[threadIdx.x] = WaitAtLeast(a, Flags(a.base, a, kDispatchFlag) + threadIdx.x, epoch,
                                                     threadIdx.x);
  __syncthreads();
  const int32_t* counts = reinterpret_cast<const int32_t*>(a.base + a.lay.counts);
  for (int i = threadIdx.x; i < experts; i += blockDim.x) {
    const int v = ok[i / l] ? __ldcg(counts + i) : 0;
    cnt[i] = (v < 0 || v > s.c) ? 0 : v;
  }
  __syncthreads();
  // A sender whose counts add up to more than its area holds is ignored (never read or write out of bounds).
  if (threadIdx.x < n) {
    int sum = 0;
    for (int e = 0; e < l; ++e) sum += cnt[threadIdx.x * l + e];
    if (sum > s.c)
      for (int e = 0; e < l; ++e) cnt[threadIdx.x * l + e] = 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < experts; i += blockDim.x) bend[i] = cnt[i];
  for (int e = threadIdx.x; e < l; e += blockDim.x) {
    int tot = 0;
    for (int q = 0; q < n; ++q) tot += cnt[q * l + e];
    est[e] = tot;
  }
  __syncthreads();
  BlockInclusiveScan(bend, experts, warp_sums);
  BlockInclusiveScan(est, l, warp_sums);
  if (threadIdx.x <= n) spre[threadIdx.x] = threadIdx.x == 0 ? 0 : bend[threadIdx.x * l - 1];
  for (int i = threadIdx.x; i < experts; i += blockDim.x) {
    const int q = i / l, e = i - q * l;
    int at = e > 0 ? est[e - 1] : 0;  // first row of expert e
    for (int p = 0; p < q; ++p) at += cnt[p * l + e];
    start[i] = at;
  }
  __syncthreads();
  const int total = spre[n];
  if (blockIdx.x == 0) {
    for (int e = threadIdx.x; e < l; e += blockDim.x) ocounts[e] = est[e] - (e > 0 ? est[e - 1] : 0);
    if (threadIdx.x == 0) route[s.max_recv_rows()] = total;
  }
  const int lane = threadIdx.x & 31;
  const int32_t* meta = reinterpret_cast<const int32_t*>(a.base + a.lay.meta);
  const long long slots = s.slots();
  const long long rows = s.max_recv_rows();
  const int4 zero = make_int4(0, 0, 0, 0);
  for (long long i = blockIdx.x * kWarps + (threadIdx.x >> 5); i < rows; i += gridDim.x * kWarps) {
    if (i >= total) {  // padding: zeros, like the reference (a NaN left here would poison x * 0 downstream)
      int4* dx = reinterpret_cast<int4*>(ox + i * s.x_bytes);
      for (int v = lane; v < (s.x_bytes >> 4); v += 32) dx[v] = zero;
      if (os) {
        int* ds = reinterpret_cast<int*>(os + i * s.scale_bytes);
        for (int v = lane; v < (s.scale_bytes >> 2); v += 32) ds[v] = 0;
      }
      continue;
    }
    int q = 0;
    while (q + 1 < n && spre[q + 1] <= i) ++q;
    const int j = static_cast<int>(i - spre[q]);
    const int* end = bend + q * l;
    int lo = 0, hi = l - 1;
    while (lo < hi) {  // first expert whose block ends after row j
      const int mid = (lo + hi) >> 1;
      if (end[mid] - spre[q] > j) hi = mid; else lo = mid + 1;
    }
    const int block_start = end[lo] - cnt[q * l + lo] - spre[q];
    const size_t dest = static_cast<size_t>(start[q * l + lo]) + (j - block_start);
    const size_t rec = static_cast<size_t>(q) * s.c + j;
    const uint8_t* src = a.base + a.lay.rows + rec * s.rec_bytes;
    WarpCopy16(ox + dest * s.x_bytes, src, s.x_bytes, lane);
    if (os) WarpCopy4(os + dest * s.scale_bytes, src + s.x_bytes, s.scale_bytes, lane);
    if (lane == 0) route[dest] = static_cast<int32_t>(q * slots + __ldcg(meta + rec));
  }
  FinishBlock(a, kDispatchRecv, [&](LocalSync* ls) {
    ls->epoch[kDispatchRecv] = epoch;
    for (int p = 0; p < n; ++p) StoreReleaseSys(Flags(Peer(a, p), a, kDispatchAck) + s.rank, epoch);
  });
}

}  // namespace

cudaError_t LaunchDispatchSend(const KernelArgs& a, int tokens, const void* x, const void* x_scale,
                               const int32_t* topk_idx, int32_t* handle, cudaStream_t stream) {
  PlanKernel<<<a.s.experts(), kThreads, 0, stream>>>(a, tokens, topk_idx);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  const size_t smem = sizeof(int) * (2 * a.s.experts() + 32);
  const int grid = GridFor(static_cast<long long>(tokens) * a.s.r, kWarps, a.num_sms);
  DispatchSendKernel<<<grid, kThreads, smem, stream>>>(a, tokens, static_cast<const uint8_t*>(x),
                                                      static_cast<const uint8_t*>(x_scale), topk_idx, handle);
  return cudaGetLastError();
}

cudaError_t LaunchDispatchRecv(const KernelArgs& a, void* expert_x, void* expert_x_scale, int32_t* counts,
                               int32_t* route, cudaStream_t stream) {
  const size_t smem = sizeof(int) * (3 * a.s.experts() + a.s.l + 2 * a.s.n + 1 + 32);
  // A warp per expert_x row: the received ones are copied, the padding zeroed.
  const int grid = GridFor(a.s.max_recv_rows(), kWarps * 2, a.num_sms);
  DispatchRecvKernel<<<grid, kThreads, smem, stream>>>(a, static_cast<uint8_t*>(expert_x),
                                                      static_cast<uint8_t*>(expert_x_scale), counts, route);
  return cudaGetLastError();
}

}  // namespace jax_moe::cuda
