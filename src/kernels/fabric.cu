// The kernels of ranks on other nodes (regions the host proxy moves; layout in moe_layout.h, "ranks on other
// nodes"): the index of where each token and entry goes in a remote rank's region (IndexKernel, once per call and
// stream; at decode dispatch_send's pack derives it itself; its readers in fabric_index.cuh) and dispatch_send's
// packing of their regions. combine_recv reads its remote rows from
// its channel's index. Launched next to the NVLink kernels of the same half, only when the Communicator has remote
// ranks.
//
// The index: a chunk of 32 tokens has a mask saying which of its tokens have an entry on p and per-expert bits saying
// which have an entry with expert e; the last block of p's chunks adds up the chunks before each chunk. A token's slot
// is then its chunk's base plus the set bits below its own, so every token and entry is placed by one warp with no
// scan of its own.
#include "kernels/fabric_kernels.h"

#include "kernels/copy.cuh"
#include "kernels/fabric_index.cuh"
#include "kernels/grid.h"
#include "kernels/scan.cuh"
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

// A word of the index's masks: through L2 where other blocks wrote it (global memory), else as is (shared memory).
template <bool kGlobal>
__device__ __forceinline__ int Bits(const uint32_t* p) {
  if constexpr (kGlobal) return __popc(__ldcg(p));
  return __popc(*p);
}

// Chunk c of rank p's index, by one warp: lane j takes token 32c + j, whose entries on p (bits per k, first
// occurrences of valid ids like every half) set bit j of *mask and, with `lists`, of bits[e] for each expert e.
__device__ void MarkChunk(const KernelArgs& a, int p, int c, int tokens, const int32_t* idx, bool lists,
                          uint32_t* mask, uint32_t* bits) {
  const int r = a.s.experts_per_token, l = a.s.local_experts, lane = threadIdx.x & 31;
  const int t = c * kIndexChunk + lane;
  unsigned ks = 0;
  if (t < tokens) {
    for (int k = 0; k < r; ++k) {
      const int g = SentExpert(idx + static_cast<size_t>(t) * r, k, a.s.num_experts);
      if (g >= 0 && g / l == p) ks |= 1u << k;
    }
  }
  const unsigned m = __ballot_sync(0xffffffffu, ks != 0);
  if (lane == 0) *mask = m;
  if (!lists) return;
  for (int e = lane; e < l; e += 32) bits[e] = 0;
  __syncwarp();
  for (; ks != 0; ks &= ks - 1) atomicOr(&bits[idx[static_cast<size_t>(t) * r + __ffs(ks) - 1] - p * l], 1u << lane);
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

// IndexKernel's dynamic shared memory with lists: 32 bits per local expert and warp.
size_t IndexBitsBytes(int l) { return sizeof(unsigned) * kWarps * size_t(l); }

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

// Where the tokens fit one block's chunks (decode), each pack block derives its rank's index itself in shared memory
// rather than wait for an index launch: [kWarps] mask, [kWarps] sbase, [kWarps][l] bits, [kWarps][l] base, [l + 2] off.
__host__ __device__ inline size_t FoldBytes(int l) {
  return sizeof(uint32_t) * (2 * kWarps * (1 + size_t(l)) + l + 2);
}

__device__ inline RankIndex SharedIndex(uint32_t* own, int l) {
  int32_t* i = reinterpret_cast<int32_t*>(own);
  return {own, i + kWarps, own + 2 * kWarps, i + 2 * kWarps + kWarps * l, i + 2 * kWarps * (1 + l)};
}

// Block (i, b) of `per_rank` serves the i-th remote rank p from the dispatch index (IndexKernel, before it in stream
// order; with `fold`, its own copy): a warp per token t = (b * kWarps + warp) + k * per_rank * kWarps writes its
// entries into the lists (lane k: entry k) and its record. The last block rings the bell.
__global__ void __launch_bounds__(kThreads)
    DispatchPackKernel(KernelArgs a, int per_rank, int fold, int tokens, const uint8_t* x, const uint8_t* xs,
                       const float* w, const int32_t* idx) {
  extern __shared__ uint32_t own[];  // with `fold`: FoldBytes
  __shared__ int sums[kWarps];
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
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    RankIndex ix = IndexOf(a, 0, p);
    if (fold) {
      const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;  // <= kWarps
      ix = SharedIndex(own, l);
      if (warp < chunks) MarkChunk(a, p, warp, tokens, idx, true, ix.mask + warp, ix.bits + warp * l);
      __syncthreads();
      IndexPrefixes<false>(a, ix, chunks, true, sums);
      __syncthreads();
    }
    uint8_t* region = SendRegion(fab, a, epoch, p);
    int32_t* list = reinterpret_cast<int32_t*>(region + FabricHeaderBytes(s));
    uint8_t* records = region + FabricRecordsOffset(s);
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
  const size_t fixed = cudaFuncGetAttributes(&attr, IndexKernel) == cudaSuccess ? attr.sharedSizeBytes : 1024;
  return fixed + IndexBitsBytes(s.local_experts);
}

cudaError_t LaunchDispatchPack(const KernelArgs& a, int tokens, const void* x, const void* x_scale,
                               const float* topk_weights, const int32_t* topk_idx, cudaStream_t stream) {
  // At decode the index launch cost what it saved the pack: each block derives it in shared memory instead.
  // The fold's shared memory stays under the 48 KiB a launch gets without opting in, beside the kernel's static.
  constexpr size_t kFoldMost = 40 * 1024;
  const bool fold = (tokens + kIndexChunk - 1) / kIndexChunk <= kWarps && FoldBytes(a.s.local_experts) <= kFoldMost;
  if (!fold)
    if (cudaError_t err = LaunchIndex(a, 0, true, tokens, topk_idx, stream); err != cudaSuccess) return err;
  // A warp per token, at most 2 blocks per SM in all.
  int per = (tokens + kWarps - 1) / kWarps;
  const int most = 2 * a.num_sms / (a.num_remote > 0 ? a.num_remote : 1);
  per = per > most ? most : per;
  per = per < 1 ? 1 : per;
  DispatchPackKernel<<<per * a.num_remote, kThreads, fold ? FoldBytes(a.s.local_experts) : 0, stream>>>(
      a, per, fold ? 1 : 0, tokens, static_cast<const uint8_t*>(x), static_cast<const uint8_t*>(x_scale), topk_weights,
      topk_idx);
  return cudaGetLastError();
}

cudaError_t LaunchCombineIndex(const KernelArgs& a, int channel, int mode, int tokens, const int32_t* topk_idx,
                               cudaStream_t stream) {
  return LaunchIndex(a, 1 + channel, mode == kPerEntry, tokens, topk_idx, stream);
}

}  // namespace jax_moe::cuda
