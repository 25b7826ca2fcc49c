// The kernels of ranks on other nodes (regions the host proxy moves; layout in moe_layout.h, "ranks on other
// nodes"): the index of where each token and entry goes in a remote rank's region (IndexKernel, once per call),
// dispatch_send's packing of their regions, and combine_recv's row of each entry in the region its expert's rank
// returned. Launched next to the NVLink kernels of the same half, only when the Communicator has remote ranks.
//
// The index, per remote rank p, numbers the tokens with an entry on p in token order (their slots: dispatch sends and
// combine returns them in this order) and p's entries in (local expert, token) order (the lists). Tokens go in chunks
// of 32, a bit each: a chunk's mask says which of its tokens have an entry on p and its per-expert bits which have an
// entry with expert e; the last block adds up the chunks before each chunk. A token's slot is then its chunk's base
// plus the set bits below its own, so every token and entry is placed by one warp with no scan of its own.
#include "kernels/fabric_kernels.h"

#include "kernels/copy.cuh"
#include "kernels/grid.h"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {
namespace {

static_assert(kIndexChunk == 32, "a chunk is one warp's lanes, a bit each in 32-bit masks");

// The i-th remote rank.
__device__ __forceinline__ int RemoteRank(const KernelArgs& a, int i) {
  for (int q = 0; q < a.s.num_ranks; ++q) {
    if (!IsRemote(a, q)) continue;
    if (i-- == 0) return q;
  }
  return -1;
}

// One fabric stream's index (MoeLayout::fmask ... foff) of rank p.
struct RankIndex {
  uint32_t* mask;   // [C]
  int32_t* sbase;   // [C]
  uint32_t* bits;   // [C][l]
  int32_t* base;    // [C][l]
  int32_t* off;     // [l + 2]
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

// The last block's part of IndexKernel for rank p (`chunks` in use): the chunks' slot bases, the experts' chunk
// bases and their offsets (`lists`), and the totals. Reads what the other blocks wrote through L2 (__ldcg).
__device__ void IndexPrefixes(const KernelArgs& a, const RankIndex& ix, int chunks, bool lists, int* sums) {
  const int l = a.s.local_experts, threads = static_cast<int>(blockDim.x);
  int run = (chunks + threads - 1) / threads;
  int c0 = min(chunks, static_cast<int>(threadIdx.x) * run), c1 = min(chunks, c0 + run);
  int mine = 0;
  for (int c = c0; c < c1; ++c) mine += __popc(__ldcg(ix.mask + c));
  int slots = 0;
  int next = BlockExclusiveSum(mine, sums, &slots);
  for (int c = c0; c < c1; ++c) {
    ix.sbase[c] = next;
    next += __popc(__ldcg(ix.mask + c));
  }
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
          n[u] = c0 + u < chunks ? __popc(__ldcg(ix.bits + static_cast<size_t>(c0 + u) * l + e)) : 0;
#pragma unroll
        for (int u = 0; u < kBatch; ++u) {
          if (c0 + u < chunks) ix.base[static_cast<size_t>(c0 + u) * l + e] = acc;
          acc += n[u];
        }
      }
      ix.off[e] = acc;
    }
    __syncthreads();
    run = (l + threads - 1) / threads;
    c0 = min(l, static_cast<int>(threadIdx.x) * run);
    c1 = min(l, c0 + run);
    mine = 0;
    for (int e = c0; e < c1; ++e) mine += ix.off[e];
    int entries = 0;
    next = BlockExclusiveSum(mine, sums, &entries);
    for (int e = c0; e < c1; ++e) {
      const int n = ix.off[e];
      ix.off[e] = next;
      next += n;
    }
    if (threadIdx.x == 0) ix.off[l] = entries;
  }
  if (threadIdx.x == 0) ix.off[l + 1] = slots;
  __syncthreads();
}

// The index of `stream` (0: dispatch_send, 1 + c: combine_recv of channel c) for every remote rank: block (i, b) of
// `per_rank` serves the i-th remote rank p, its warp w chunk 8b + w. Lane j takes token 32c + j: its entries on p
// (bits per k, first occurrences of valid ids like every half) set bit j of the chunk's mask and, with `lists`, of
// the chunk's bits of each expert. The grid's last block then derives the bases (IndexPrefixes). Touches only this
// device's index of `stream`, so it waits on nothing.
__global__ void __launch_bounds__(kThreads)
    IndexKernel(KernelArgs a, int stream, int lists, int per_rank, int tokens, const int32_t* idx) {
  extern __shared__ unsigned warp_bits[];  // [kWarps][l] with lists
  __shared__ int sums[kWarps];
  __shared__ int last;
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int p = RemoteRank(a, blockIdx.x / per_rank);
  const int c = (blockIdx.x % per_rank) * kWarps + warp;
  if (p >= 0 && c < chunks) {  // the same for the whole warp
    const RankIndex ix = IndexOf(a, stream, p);
    const int t = c * kIndexChunk + lane;
    unsigned ks = 0;
    if (t < tokens) {
      for (int k = 0; k < r; ++k) {
        const int g = SentExpert(idx + static_cast<size_t>(t) * r, k, s.num_experts);
        if (g >= 0 && g / l == p) ks |= 1u << k;
      }
    }
    const unsigned m = __ballot_sync(0xffffffffu, ks != 0);
    if (lane == 0) ix.mask[c] = m;
    if (lists) {
      unsigned* wb = warp_bits + warp * l;
      for (int e = lane; e < l; e += 32) wb[e] = 0;
      __syncwarp();
      for (; ks != 0; ks &= ks - 1) atomicOr(&wb[idx[static_cast<size_t>(t) * r + __ffs(ks) - 1] - p * l], 1u << lane);
      __syncwarp();
      for (int e = lane; e < l; e += 32) ix.bits[static_cast<size_t>(c) * l + e] = wb[e];
    }
  }
  // The last block of the grid sees every block's chunks (each thread's fenced before its block arrives).
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    last = atomicAdd(&Local(a)->index_done[stream], 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  if (threadIdx.x == 0) Local(a)->index_done[stream] = 0;  // every block has arrived: re-armed for the next launch
  for (int i = 0; i < a.num_remote; ++i) IndexPrefixes(a, IndexOf(a, stream, RemoteRank(a, i)), chunks, lists, sums);
}

// Token t's place in p's region from the index: its slot, or -1 where p gets none of it.
__device__ __forceinline__ int SlotOf(const RankIndex& ix, int t) {
  const int c = t / kIndexChunk, j = t % kIndexChunk;
  const unsigned m = ix.mask[c];
  return (m >> j) & 1u ? ix.sbase[c] + __popc(m & Below(j)) : -1;
}

// Entry (t, k)'s position among p's entries (the lists' order: local expert e, then token).
__device__ __forceinline__ int EntryOf(const RankIndex& ix, int l, int t, int e) {
  const int c = t / kIndexChunk, j = t % kIndexChunk;
  const size_t at = static_cast<size_t>(c) * l + e;
  return ix.off[e] + ix.base[at] + __popc(ix.bits[at] & Below(j));
}

// Block (i, b) of `per_rank` serves the i-th remote rank p from the dispatch index (IndexKernel, before it in stream
// order): a warp per token t = (b * kWarps + warp) + k * per_rank * kWarps writes its entries into the lists (lane k:
// entry k) and its record. The last block rings the bell.
__global__ void __launch_bounds__(kThreads)
    DispatchPackKernel(KernelArgs a, int per_rank, int tokens, const uint8_t* x, const uint8_t* xs, const float* w,
                       const int32_t* idx) {
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts;
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
    const RankIndex ix = IndexOf(a, 0, p);
    uint8_t* region = SendRegion(fab, a, epoch, p);
    int32_t* list = reinterpret_cast<int32_t*>(region + FabricHeaderBytes(s));
    uint8_t* records = region + FabricRecordsOffset(s);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int t = b * kWarps + warp; t < tokens; t += per_rank * kWarps) {
      const int slot = SlotOf(ix, t);
      if (slot < 0) continue;  // the same for the whole warp
      // Lane k: entry k, if it is the first naming a valid expert and that expert is on p.
      const int g = lane < r ? idx[static_cast<size_t>(t) * r + lane] : -1;
      bool mine = g >= 0 && g < s.num_experts && g / l == p;
      for (int k = 0; k + 1 < r; ++k) {
        const int h = __shfl_sync(0xffffffffu, g, k);
        if (k < lane && h == g) mine = false;
      }
      if (mine) list[EntryOf(ix, l, t, g - p * l)] = slot * r + lane;
      uint8_t* dst = records + static_cast<size_t>(slot) * FabricRecordBytes(s);
      WarpCopy16(dst, x + static_cast<size_t>(t) * s.x_bytes(), s.x_bytes(), lane);
      if (xs) WarpCopy4(dst + s.x_bytes(), xs + static_cast<size_t>(t) * s.scale_bytes(), s.scale_bytes(), lane);
      if (w && lane < r)  // the expert rank weights and sums this token's rows by them (combine kWeighted)
        reinterpret_cast<float*>(dst + s.x_bytes() + s.scale_bytes())[lane] = w[static_cast<size_t>(t) * r + lane];
    }
    if (b == 0) {
      int32_t* counts = proxy::HeaderCounts(reinterpret_cast<proxy::RegionHeader*>(region));
      for (int e = threadIdx.x; e < l; e += blockDim.x) counts[e] = ix.off[e + 1] - ix.off[e];
      if (threadIdx.x == 0) {
        StoreHeader(region, fab, a, epoch, ix.off[l + 1]);
        fab.bytes[(epoch % kFabricLanes) * s.num_ranks + p] = FabricDispatchBytes(s, ix.off[l + 1]);
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

// combine_recv's rows of remote entries, from the index of its channel (IndexKernel, before it): for every entry
// (t, k) whose expert g sits on a remote rank p, the row of p's combine region that holds it, and per p the rows it
// owes. kPerEntry: p returns rows in the order it received them (the lists' order); the reduced modes: one summed row
// per token, at the token's slot, written at each of its entries on p (combine_recv counts the first). A pure function
// of topk_idx, so it holds whatever dispatch came before. A thread per entry.
__global__ void __launch_bounds__(kThreads) CombineRowsKernel(KernelArgs a, int ch, int mode, int tokens, const int32_t* idx) {
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts;
  int32_t* fpos = reinterpret_cast<int32_t*>(a.base + a.lay.fpos) + static_cast<size_t>(ch) * s.entries();
  const long long entries = static_cast<long long>(tokens) * r;
  const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
  for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < entries; i += stride) {
    const int t = static_cast<int>(i / r), k = static_cast<int>(i - static_cast<long long>(t) * r);
    const int g = SentExpert(idx + static_cast<size_t>(t) * r, k, s.num_experts);
    if (g < 0 || !IsRemote(a, g / l)) continue;
    const RankIndex ix = IndexOf(a, 1 + ch, g / l);
    fpos[i] = mode == kPerEntry ? EntryOf(ix, l, t, g % l) : SlotOf(ix, t);
  }
  if (blockIdx.x == 0) {
    int32_t* fexp = reinterpret_cast<int32_t*>(a.base + a.lay.fexp) + ch * s.num_ranks;
    for (int p = threadIdx.x; p < s.num_ranks; p += blockDim.x)
      if (IsRemote(a, p)) fexp[p] = IndexOf(a, 1 + ch, p).off[mode == kPerEntry ? l : l + 1];
  }
}

// Launches IndexKernel for `stream`: a warp per chunk of every remote rank.
cudaError_t LaunchIndex(const KernelArgs& a, int stream, bool lists, int tokens, const int32_t* idx, cudaStream_t cs) {
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  const int per = chunks > kWarps ? (chunks + kWarps - 1) / kWarps : 1;
  const size_t smem = lists ? sizeof(unsigned) * kWarps * a.s.local_experts : 0;
  if (cudaError_t err = AllowSmem(IndexKernel, smem); err != cudaSuccess) return err;
  IndexKernel<<<per * a.num_remote, kThreads, smem, cs>>>(a, stream, lists ? 1 : 0, per, tokens, idx);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchDispatchPack(const KernelArgs& a, int tokens, const void* x, const void* x_scale,
                               const float* topk_weights, const int32_t* topk_idx, cudaStream_t stream) {
  if (cudaError_t err = LaunchIndex(a, 0, true, tokens, topk_idx, stream); err != cudaSuccess) return err;
  // A warp per token, at most 2 blocks per SM in all.
  int per = (tokens + kWarps - 1) / kWarps;
  const int most = 2 * a.num_sms / (a.num_remote > 0 ? a.num_remote : 1);
  per = per > most ? most : per;
  per = per < 1 ? 1 : per;
  DispatchPackKernel<<<per * a.num_remote, kThreads, 0, stream>>>(
      a, per, tokens, static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(x_scale), topk_weights, topk_idx);
  return cudaGetLastError();
}

cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream) {
  if (cudaError_t err = LaunchIndex(a, 1 + channel, mode == kPerEntry, tokens, topk_idx, stream); err != cudaSuccess)
    return err;
  CombineRowsKernel<<<GridFor(static_cast<long long>(tokens) * a.s.experts_per_token, kThreads, a.num_sms), kThreads, 0,
                      stream>>>(a, channel, mode, tokens, topk_idx);
  return cudaGetLastError();
}

}  // namespace jax_moe::cuda
