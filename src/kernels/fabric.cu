// The kernels of ranks on other nodes (regions the host proxy moves; layout in moe_layout.h, "ranks on other
// nodes"): dispatch_send's index and packing of their regions, and combine_recv's index of where each entry's row
// sits in the region its expert's rank returned. Launched next to the NVLink kernels of the same half, only when the
// Communicator has remote ranks.
#include "kernels/fabric_kernels.h"

#include "kernels/copy.cuh"
#include "kernels/grid.h"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {
namespace {

// The i-th remote rank.
__device__ __forceinline__ int RemoteRank(const KernelArgs& a, int i) {
  for (int q = 0; q < a.s.num_ranks; ++q) {
    if (!IsRemote(a, q)) continue;
    if (i-- == 0) return q;
  }
  return -1;
}

// Entries per local expert of rank p (first occurrences of valid ids, like every half), into cnt[l] (zeroed here),
// and their exclusive prefix into off[l + 1]. Ends with a barrier. Every block of combine_recv's per-entry index runs
// it (rows returned per entry: only on channel 0, which sizes its regions for them).
__device__ void CountEntries(const KernelArgs& a, int p, int tokens, const int32_t* idx, int* cnt, int* off) {
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts;
  for (int e = threadIdx.x; e < l; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  for (long long i = threadIdx.x; i < static_cast<long long>(tokens) * r; i += blockDim.x) {
    const int t = static_cast<int>(i / r), k = static_cast<int>(i - static_cast<long long>(t) * r);
    const int g = SentExpert(idx + static_cast<size_t>(t) * r, k, s.num_experts);
    if (g >= 0 && g / l == p) atomicAdd(&cnt[g - p * l], 1);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    off[0] = 0;
    for (int e = 0; e < l; ++e) off[e + 1] = off[e] + cnt[e];
  }
  __syncthreads();
}

// Calls at(t, kf, i) for every token t naming global expert g (kf: its first entry naming g), i = its position among
// them in token order. Every thread of the block calls it.
template <typename At>
__device__ void ForEachTokenOf(int g, int tokens, int r, const int32_t* idx, int* warp_count, At at) {
  int running = 0;
  for (int base = 0; base < tokens; base += kThreads) {
    const int t = base + threadIdx.x;
    int kf = -1;
    if (t < tokens) {
      const int32_t* row = idx + static_cast<size_t>(t) * r;
      for (int k = r - 1; k >= 0; --k)
        if (row[k] == g) kf = k;
    }
    const int i = BlockRank(kf >= 0, warp_count, running);
    if (kf >= 0) at(t, kf, i);
  }
}

// Threads of the index kernels: one block per remote rank numbers all its tokens with one block-wide scan.
constexpr int kIndexThreads = 1024;

// The exclusive prefix of v over the block's threads, in thread order; *total gets the sum (in every thread). Every
// thread calls it (barriers); `sums` is shared scratch of one int per warp; blockDim.x is a multiple of 32.
__device__ int BlockExclusiveSum(int v, int* sums, int* total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int inc = v;
  for (int d = 1; d < 32; d <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, inc, d);
    if (lane >= d) inc += u;
  }
  if (lane == 31) sums[warp] = inc;
  __syncthreads();
  int before = 0, all = 0;
  for (int w = 0; w < static_cast<int>(blockDim.x >> 5); ++w) {
    const int c = sums[w];
    before += w < warp ? c : 0;
    all += c;
  }
  __syncthreads();  // `sums` may be reused at once
  *total = all;
  return before + inc - v;
}

// Token t's entries on rank p: bit k for each k whose expert is valid, first in t's row and on p (R <= 32).
__device__ __forceinline__ unsigned EntriesOn(const MoeShape& s, int p, const int32_t* row) {
  unsigned ks = 0;
  for (int k = 0; k < s.experts_per_token; ++k) {
    const int g = SentExpert(row, k, s.num_experts);
    if (g >= 0 && g / s.local_experts == p) ks |= 1u << k;
  }
  return ks;
}

// Numbers the tokens with an entry on rank p in token order: their slots in p's region, as dispatch sends them and
// combine returns them (both index kernels below call it, so they agree). Thread i takes the run of tokens
// [i * run, (i + 1) * run), so one block-wide scan numbers them all. Calls at(t, slot, ks) for every t < tokens: slot
// -1 if p gets none of t, ks its entries on p. Every thread of the block calls it; returns the slots.
template <typename At>
__device__ int ForEachSlotOf(const MoeShape& s, int p, int tokens, const int32_t* idx, int* sums, At at) {
  const int r = s.experts_per_token;
  const int run = (tokens + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int t0 = min(tokens, static_cast<int>(threadIdx.x) * run), t1 = min(tokens, t0 + run);
  int mine = 0;
  for (int t = t0; t < t1; ++t) mine += EntriesOn(s, p, idx + static_cast<size_t>(t) * r) != 0;
  int slots = 0;
  int next = BlockExclusiveSum(mine, sums, &slots);
  for (int t = t0; t < t1; ++t) {
    const unsigned ks = EntriesOn(s, p, idx + static_cast<size_t>(t) * r);
    at(t, ks != 0 ? next++ : -1, ks);
  }
  return slots;
}

// dispatch_send's index of the remote rank served by this block, computed once per call (not by every block of the
// pack, which spent 245 us at prefill deriving it 132 times): each token's slot in p's region, and the lists' offsets
// of p's experts (fslot, foff in moe_layout.h). Touches only this device's scratch, so it waits on nothing.
__global__ void __launch_bounds__(kIndexThreads) DispatchIndexKernel(KernelArgs a, int tokens, const int32_t* idx) {
  extern __shared__ int cnt[];  // [l]: entries per local expert of p
  __shared__ int sums[32];
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts;
  const int p = RemoteRank(a, blockIdx.x);
  if (p < 0) return;  // the same for the whole block
  int32_t* slot = reinterpret_cast<int32_t*>(a.base + a.lay.fslot) + static_cast<size_t>(p) * s.max_tokens;
  int32_t* off = reinterpret_cast<int32_t*>(a.base + a.lay.foff) + static_cast<size_t>(p) * (l + 2);
  for (int e = threadIdx.x; e < l; e += blockDim.x) cnt[e] = 0;
  __syncthreads();
  const int slots = ForEachSlotOf(s, p, tokens, idx, sums, [&](int t, int at, unsigned ks) {
    slot[t] = at;
    for (; ks != 0; ks &= ks - 1) atomicAdd(&cnt[idx[static_cast<size_t>(t) * r + __ffs(ks) - 1] - p * l], 1);
  });
  __syncthreads();  // every count in
  const int run = (l + static_cast<int>(blockDim.x) - 1) / static_cast<int>(blockDim.x);
  const int e0 = min(l, static_cast<int>(threadIdx.x) * run), e1 = min(l, e0 + run);
  int mine = 0;
  for (int e = e0; e < e1; ++e) mine += cnt[e];
  int entries = 0;
  int next = BlockExclusiveSum(mine, sums, &entries);
  for (int e = e0; e < e1; ++e) {
    off[e] = next;
    next += cnt[e];
  }
  if (threadIdx.x == 0) {
    off[l] = entries;
    off[l + 1] = slots;
  }
}

// Block (i, b) of `per_rank` serves the i-th remote rank p, from the index DispatchIndexKernel left (stream order makes
// it visible): block b writes the lists of p's experts b, b + per_rank, ... and the records of tokens b * kWarps +
// warp, ... The last block rings the bell.
__global__ void __launch_bounds__(kThreads)
    DispatchPackKernel(KernelArgs a, int per_rank, int tokens, const uint8_t* x, const uint8_t* xs, const float* w,
                       const int32_t* idx) {
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts;
  __shared__ int warp_count[kWarps];
  __shared__ int free_ok;
  const FabricArgs& fab = a.fab[0];
  const unsigned long long epoch = Local(a)->epoch[kDispatchSend] + 1;
  const int b = blockIdx.x % per_rank;
  const int p = RemoteRank(a, blockIdx.x / per_rank);
  // The NIC must be done with this lane's previous round before it is rewritten.
  if (threadIdx.x == 0)
    free_ok = p >= 0 && WaitFabric(a, fab, proxy::kSent, SlotPredecessor(epoch), kDispatchAck * kWaitStride + p, 0,
                                   BlockPart());
  __syncthreads();
  if (free_ok) {  // the same for the whole block
    const int32_t* slot = reinterpret_cast<const int32_t*>(a.base + a.lay.fslot) + static_cast<size_t>(p) * s.max_tokens;
    const int32_t* off = reinterpret_cast<const int32_t*>(a.base + a.lay.foff) + static_cast<size_t>(p) * (l + 2);
    uint8_t* region = SendRegion(fab, a, epoch, p);
    int32_t* list = reinterpret_cast<int32_t*>(region + FabricHeaderBytes(s));
    uint8_t* records = region + FabricRecordsOffset(s);
    for (int e = b; e < l; e += per_rank) {
      int32_t* at = list + off[e];
      ForEachTokenOf(p * l + e, tokens, r, idx, warp_count, [&](int t, int kf, int i) { at[i] = slot[t] * r + kf; });
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = b * kWarps + warp; t < tokens; t += per_rank * kWarps) {
      const int at = slot[t];
      if (at < 0) continue;
      uint8_t* dst = records + static_cast<size_t>(at) * FabricRecordBytes(s);
      WarpCopy16(dst, x + static_cast<size_t>(t) * s.x_bytes(), s.x_bytes(), lane);
      if (xs) WarpCopy4(dst + s.x_bytes(), xs + static_cast<size_t>(t) * s.scale_bytes(), s.scale_bytes(), lane);
      if (w && lane < r)  // the expert rank weights and sums this token's rows by them (combine kWeighted)
        reinterpret_cast<float*>(dst + s.x_bytes() + s.scale_bytes())[lane] = w[static_cast<size_t>(t) * r + lane];
    }
    if (b == 0) {
      int32_t* counts = proxy::HeaderCounts(reinterpret_cast<proxy::RegionHeader*>(region));
      for (int e = threadIdx.x; e < l; e += blockDim.x) counts[e] = off[e + 1] - off[e];
      if (threadIdx.x == 0) {
        StoreHeader(region, fab, a, epoch, off[l + 1]);
        fab.bytes[(epoch % kFabricLanes) * s.num_ranks + p] = FabricDispatchBytes(s, off[l + 1]);
      }
    }
  }
  // Every block's stores reach host memory before the proxy sees the bell (as FinishBlock orders a launch's end).
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    LocalSync* ls = Local(a);
    if (atomicAdd(&ls->pack_done, 1u) == gridDim.x - 1) {
      ls->pack_done = 0;
      __threadfence_system();
      if (!*reinterpret_cast<volatile int*>(&ls->timed_out)) StoreReleaseSys(fab.bell + proxy::kRung, epoch);
    }
  }
}

// combine_recv's index: for every entry whose expert g sits on a remote rank p, the row of p's combine region that
// holds it, and per p the rows it owes. A pure function of topk_idx, so it holds whatever dispatch came before.
// kPerEntry (CombineIndexKernel): p returns rows in the order it received them (local expert, then token); block
// (i, b) of `per_rank` scans the tokens of p's experts b, b + per_rank, ...
__global__ void __launch_bounds__(kThreads)
    CombineIndexKernel(KernelArgs a, int ch, int per_rank, int tokens, const int32_t* idx) {
  extern __shared__ int smem[];
  const MoeShape& s = a.s;
  const int l = s.local_experts, r = s.experts_per_token;
  int* cnt = smem;      // [l]
  int* off = cnt + l;   // [l + 1]
  __shared__ int warp_count[kWarps];
  const int b = blockIdx.x % per_rank;
  const int p = RemoteRank(a, blockIdx.x / per_rank);
  if (p < 0) return;  // the same for the whole block
  int32_t* fpos = reinterpret_cast<int32_t*>(a.base + a.lay.fpos) + static_cast<size_t>(ch) * s.entries();
  int32_t* fexp = reinterpret_cast<int32_t*>(a.base + a.lay.fexp) + ch * s.num_ranks;
  CountEntries(a, p, tokens, idx, cnt, off);
  if (b == 0 && threadIdx.x == 0) fexp[p] = off[l];
  for (int e = b; e < l; e += per_rank) {
    ForEachTokenOf(p * l + e, tokens, r, idx, warp_count, [&](int t, int kf, int i) {
      fpos[static_cast<size_t>(t) * r + kf] = off[e] + i;
    });
  }
}

// The reduced modes (CombineSlotsKernel, a block per remote rank): one summed row per token, at the token's slot in
// the region dispatch sent p (ForEachSlotOf), written at each of its entries on p (combine_recv counts the first).
__global__ void __launch_bounds__(kIndexThreads) CombineSlotsKernel(KernelArgs a, int ch, int tokens, const int32_t* idx) {
  __shared__ int sums[32];
  const MoeShape& s = a.s;
  const int r = s.experts_per_token;
  const int p = RemoteRank(a, blockIdx.x);
  if (p < 0) return;  // the same for the whole block
  int32_t* fpos = reinterpret_cast<int32_t*>(a.base + a.lay.fpos) + static_cast<size_t>(ch) * s.entries();
  int32_t* fexp = reinterpret_cast<int32_t*>(a.base + a.lay.fexp) + ch * s.num_ranks;
  const int slots = ForEachSlotOf(s, p, tokens, idx, sums, [&](int t, int at, unsigned ks) {
    for (; ks != 0; ks &= ks - 1) fpos[static_cast<size_t>(t) * r + __ffs(ks) - 1] = at;
  });
  if (threadIdx.x == 0) fexp[p] = slots;
}

// Blocks per remote rank: enough for its experts' scans and its tokens' copies, at most 2 blocks per SM in all.
int PerRank(const KernelArgs& a, int tokens) {
  int per = (tokens + 2 * kWarps - 1) / (2 * kWarps);
  if (per < a.s.local_experts) per = a.s.local_experts < 32 ? a.s.local_experts : 32;
  const int most = 2 * a.num_sms / (a.num_remote > 0 ? a.num_remote : 1);
  if (per > most) per = most;
  return per < 1 ? 1 : per;
}

}  // namespace

cudaError_t LaunchDispatchPack(const KernelArgs& a, int tokens, const void* x, const void* x_scale,
                               const float* topk_weights, const int32_t* topk_idx, cudaStream_t stream) {
  const size_t smem = sizeof(int) * a.s.local_experts;
  if (cudaError_t err = AllowSmem(DispatchIndexKernel, smem); err != cudaSuccess) return err;
  DispatchIndexKernel<<<a.num_remote, kIndexThreads, smem, stream>>>(a, tokens, topk_idx);
  const int per = PerRank(a, tokens);
  DispatchPackKernel<<<per * a.num_remote, kThreads, 0, stream>>>(
      a, per, tokens, static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(x_scale), topk_weights, topk_idx);
  return cudaGetLastError();
}

cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream) {
  if (mode != kPerEntry) {
    CombineSlotsKernel<<<a.num_remote, kIndexThreads, 0, stream>>>(a, channel, tokens, topk_idx);
    return cudaGetLastError();
  }
  const int per = PerRank(a, tokens);
  const size_t smem = sizeof(int) * (2 * a.s.local_experts + 1);
  if (cudaError_t err = AllowSmem(CombineIndexKernel, smem); err != cudaSuccess) return err;
  CombineIndexKernel<<<per * a.num_remote, kThreads, smem, stream>>>(a, channel, per, tokens, topk_idx);
  return cudaGetLastError();
}

}  // namespace jax_moe::cuda
