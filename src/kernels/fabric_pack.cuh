// dispatch_send's part for ranks on other nodes: the remote ranks' regions of the send area (layout in moe_layout.h,
// "ranks on other nodes"), then the bell the host proxy waits on. Run by the blocks after block 0 of dispatch_send's
// one kernel (block 0 polls for them; dispatch.cu), beside the blocks that copy over NVLink, so that neither waits for
// the other.
#pragma once
#include <cstddef>
#include <cstdint>

#include "kernels/copy.cuh"
#include "kernels/fabric_index.cuh"
#include "kernels/fabric_mark.cuh"
#include "kernels/moe_kernels.h"
#include "kernels/scan.cuh"
#include "kernels/sync.cuh"

namespace jax_moe::cuda {

// The block before the pack blocks (block 0 of dispatch_send's launch) that polls the lane's kSent word in host
// memory for them (WaitFabric as part 0) from the launch's start, while they derive the index. Its thread 0 alone
// works.
__device__ inline void DispatchPollBody(const KernelArgs& a, unsigned long long epoch) {
  if (threadIdx.x == 0)
    WaitFabric(a, a.fab[0], proxy::kSent, SlotPredecessor(epoch), kDispatchAck * kWaitStride + FirstRemote(a), 0,
               Part{0, 1});
}

// Ends a step of p's blocks (each block once, every thread): `count` counts the blocks that are done, the last one to
// arrive runs `last()` (every thread of it) and then publishes `epoch` in `*word`; the others wait for that. So every
// one of p's blocks must find room while the others wait: the pack blocks are the launch's first blocks after block 0,
// at most one an SM with it (DispatchPackPlan) in a kernel that fits two, as block 0's poll already needs; a bounded
// wait, should they not. False where the wait timed out or one before it did.
// Every block arrives at every step, also one whose earlier wait failed (`joined` false): so each step's count is
// re-armed in every launch. Such a block arrives with kStepFailed added, so the last block knows from the count alone
// whether every block did its share (a read of the timeout word after the atomic could be stale): if not, it skips
// `last()` and publishes nothing (the waiters give up on the timeout word), since the jobs of a block that did not
// join hold the last call's values.
constexpr unsigned long long kStepFailed = 1ull << 32;  // the count's high half: blocks that arrived without joining
template <typename Last>
__device__ inline bool StepDone(const KernelArgs& a, int p, int per_rank, unsigned long long* count,
                                unsigned long long* word, unsigned long long epoch, bool joined, Last last) {
  __shared__ int is_last, ok;
  volatile int* timed_out = &Local(a)->timed_out;
  __syncthreads();  // the block's stores, then one fence before its arrival (as FinishPart and a grid barrier do)
  if (threadIdx.x == 0) {
    __threadfence();
    const unsigned long long add = joined ? 1ull : kStepFailed + 1ull;
    const unsigned long long now = atomicAdd(count, add) + add;
    is_last = (now & 0xffffffffull) == static_cast<unsigned long long>(per_rank);
    ok = joined && (now >> 32) == 0 && !*timed_out;
  }
  __syncthreads();
  if (is_last) {
    if (threadIdx.x == 0) *count = 0;  // all of p's blocks have arrived: re-armed for the next launch
    if (!ok) return false;
    __threadfence();
    last();
    __syncthreads();
    if (threadIdx.x == 0) {
      __threadfence();
      StoreRelease(word, epoch);
    }
    return true;
  }
  if (threadIdx.x == 0 && ok) {
    const unsigned long long start = GlobalTimer();
    while (LoadAcquire(word) < epoch) {
      if (*timed_out) { ok = 0; break; }  // a wait gave up: the last block publishes nothing
      if (static_cast<long long>(GlobalTimer() - start) > a.timeout_ns) {
        RaiseError(a, kTimeout, kIndexWait * kWaitStride + p);
        *timed_out = 1;
        ok = 0;
        break;
      }
      __nanosleep(64);
    }
    __threadfence();  // what the word says is there is read after it (as a grid barrier does)
  }
  __syncthreads();
  return ok != 0;
}

// p's index in global memory, derived by p's per_rank pack blocks together (prefill: more chunks than a block's warps),
// in two steps that end as StepDone says (the words: MoeLayout::fsync). First block b's warps mark chunks b * kWarps
// + warp, + per_rank * kWarps, ... (a warp's lists bits in `bits`, kWarps x l words of shared memory). Then warp g =
// b * kWarps + warp of p's blocks takes job g, + per_rank * kWarps, ...: job e < l adds up expert e's column of chunks
// (its bases, its total in off[e]), job l the chunks' slots (sbase, the total in off[l + 1]); the last block adds up
// the experts' totals into off. (The first try had the last block of the marks add up every column alone: 23.9 us to
// the index at prefill, against 13 for an index launch before the kernel.) This replaced that launch, which held back
// the NVLink blocks' expert lists though they do not read it. False where a wait timed out or one before it did.
__device__ inline bool DeriveIndex(const KernelArgs& a, const RankIndex& ix, int p, int b, int per_rank, int tokens,
                                   const int32_t* idx, unsigned long long epoch, uint32_t* bits, int* sums) {
  const int l = a.s.local_experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;
  uint32_t* wb = bits + warp * l;
  for (int c = b * kWarps + warp; c < chunks; c += per_rank * kWarps) {  // the same for the whole warp
    MarkChunk(a, p, c, tokens, idx, true, ix.mask + c, wb);
    for (int e = lane; e < l; e += 32) ix.bits[static_cast<size_t>(c) * l + e] = wb[e];
    __syncwarp();  // wb's words are read before the next chunk's MarkChunk clears them
  }
  unsigned long long* sync = reinterpret_cast<unsigned long long*>(a.base + a.lay.fsync) + 4 * p;
  const bool marked = StepDone(a, p, per_rank, sync, sync + 1, epoch, true, [] {});
  for (int job = b * kWarps + warp; marked && job <= l; job += per_rank * kWarps) {  // the same for the whole warp
    if (job < l) {
      const int total = WarpScanRuns(
          chunks, [&](int c) { return Bits<true>(ix.bits + static_cast<size_t>(c) * l + job); },
          [&](int c, int v) { ix.base[static_cast<size_t>(c) * l + job] = v; });
      if (lane == 0) ix.off[job] = total;
    } else {
      const int total = WarpScanRuns(
          chunks, [&](int c) { return Bits<true>(ix.mask + c); }, [&](int c, int v) { ix.sbase[c] = v; });
      if (lane == 0) ix.off[l + 1] = total;
    }
  }
  return StepDone(a, p, per_rank, sync + 2, sync + 3, epoch, marked, [&] {
    const int entries = BlockScanRuns(
        l, sums, [&](int e) { return __ldcg(ix.off + e); }, [&](int e, int v) { ix.off[e] = v; });
    if (threadIdx.x == 0) ix.off[l] = entries;
  });
}

// Pack block `block` of `blocks` (per_rank for each remote rank) serves the i-th remote rank p = RemoteRank(block /
// per_rank) from the dispatch index (with `fold`, its own copy in `own`, FoldBytes of shared memory; else the one p's
// blocks derive together, DeriveIndex, `own` holding IndexBitsBytes for its marks): a warp per token t = (b * kWarps
// + warp) + k * per_rank * kWarps writes its entries into the lists (lane k: entry k) and its record. The last pack
// block rings the bell. `epoch`: this call's.
__device__ inline void DispatchPackBody(const KernelArgs& a, const DispatchSendIo& io, int per_rank, bool fold,
                                        int block, int blocks, unsigned long long epoch, uint32_t* own) {
  __shared__ int sums[kWarps];
  __shared__ int free_ok;
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts, tokens = io.tokens;
  const uint8_t* x = static_cast<const uint8_t*>(io.x);
  const uint8_t* xs = static_cast<const uint8_t*>(io.x_scale);
  const float* w = io.topk_weights;
  const int32_t* idx = io.topk_idx;
  const FabricArgs& fab = a.fab[0];
  const int b = block % per_rank;
  const int p = RemoteRank(a, block / per_rank);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const bool head = block == 0 && threadIdx.x == 0;  // pack block 0's thread 0 stamps the trace
  // The index reads topk_idx only: it is derived before the wait for the lane, which DispatchPollBody's block polls
  // meanwhile (a read of host memory here would hold the index's first barrier for a PCIe round trip).
  RankIndex ix = IndexOf(a, 0, p);
  if (fold && p >= 0) {  // p: the same for the whole block
    const int chunks = (tokens + kIndexChunk - 1) / kIndexChunk;  // <= kWarps
    ix = SharedIndex(own, l);
    if (warp < chunks) MarkChunk(a, p, warp, tokens, idx, true, ix.mask + warp, ix.bits + warp * l);
    __syncthreads();
    IndexPrefixes<false>(a, ix, chunks, true, sums);
  }
  const bool indexed = fold || p < 0 || DeriveIndex(a, ix, p, b, per_rank, tokens, idx, epoch, own, sums);
  if (head) Trace(a, kDispatchSend, epoch, kTraceIndexed);  // thread 0's view (no barrier of its own)
  // The NIC must be done with this lane's previous round before it is rewritten (the proxy's kSent): the poll
  // block's device copy of the host word (a part id other than 0 never reads host memory).
  if (threadIdx.x == 0)
    free_ok = p >= 0 && indexed && WaitFabric(a, fab, proxy::kSent, SlotPredecessor(epoch), kDispatchAck * kWaitStride + p, 0,
                                   Part{block + 1, blocks + 1});
  __syncthreads();
  if (head) Trace(a, kDispatchSend, epoch, kTraceFree);
  if (free_ok) {  // the same for the whole block
    uint8_t* region = SendRegion(fab, a, epoch, p);
    int32_t* list = reinterpret_cast<int32_t*>(region + FabricHeaderBytes(s));
    uint8_t* records = region + FabricRecordsOffset(s);
    for (int t = b * kWarps + warp; t < tokens; t += per_rank * kWarps) {
      const int slot = SlotOf(ix, t);
      if (slot < 0 || slot >= s.max_tokens) continue;  // the same for the whole warp; bounded, whatever the index says
      // Lane k: entry k, if it is the first naming a valid expert and that expert is on p.
      const int g = lane < r ? idx[static_cast<size_t>(t) * r + lane] : -1;
      if (FirstValidEntry(a, g) && g / l == p) {
        const int at = EntryOf(ix, l, t, g - p * l);
        if (at >= 0 && at < s.rows_per_peer()) list[at] = slot * r + lane;  // as the slot's bound
      }
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
  // Every pack block's stores reach host memory before the proxy sees the bell (as FinishPart orders a launch's end).
  // This barrier and fence also order them before the block's arrival (DispatchSendArrive, fenced): no store of the
  // block's data may come after them.
  __syncthreads();
  if (head) Trace(a, kDispatchSend, epoch, kTraceWritten);
  if (threadIdx.x == 0) {
    __threadfence_system();
    LocalSync* ls = Local(a);
    if (atomicAdd(&ls->pack_done, 1u) == static_cast<unsigned>(blocks) - 1) {
      ls->pack_done = 0;
      __threadfence_system();
      Trace(a, kDispatchSend, epoch, kTraceBell);
      if (!*reinterpret_cast<volatile int*>(&ls->timed_out)) StoreReleaseSys(fab.bell + proxy::kRung, epoch);
    }
  }
}

}  // namespace jax_moe::cuda
