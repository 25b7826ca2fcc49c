// combine_send (expert rows back to the tokens' owners: per (t, k) entry, or per (token, rank) weighted and summed at
// the expert rank, see CombineMode) and combine_recv (wait, float32 weighted sum per token), plus the time-stamp kernel
// of the benchmark. Each half is a body run per part: the one-shot combine (every rank on this node) runs both in one
// kernel.
#include <cuda_bf16.h>

#include "kernels/copy.cuh"
#include "kernels/fabric_index.cuh"
#include "kernels/fabric_kernels.h"
#include "kernels/grid.h"
#include "kernels/moe_kernels.h"
#include "kernels/one_kernel.h"
#include "kernels/queue.cuh"
#include "kernels/sync.cuh"

#include <algorithm>

namespace jax_moe::cuda {
namespace {

// combine_recv: a warp sums a piece of kVecs 16-byte vectors a lane over a token's entries. The one-shot kernel takes 2
// (1 KiB pieces: decode's few tokens keep twice the bytes in flight a warp); the receive kernel alone takes 1 in
// blocks of kRecvThreads at 6 blocks an SM (80 registers a thread), so that more warps hide the latency at prefill.
constexpr int kFusedRecvVecs = 2;
constexpr int kRecvVecs = 1;
constexpr int kRecvThreads = 128;
__host__ __device__ constexpr int PieceVecs(int vecs_a_lane) { return 32 * vecs_a_lane; }
constexpr int kItemPieces = 4;  // pieces of one warp item at most
constexpr int kRecvBlocksPerSm = 6;  // CombineRecvKernel's launch bound

// acc += w * v, v's 8 bf16 widened to float32.
__device__ __forceinline__ void FmaBf16(float (&acc)[8], float w, const int4& v) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    acc[2 * j] = fmaf(w, f.x, acc[2 * j]);
    acc[2 * j + 1] = fmaf(w, f.y, acc[2 * j + 1]);
  }
}

// Eight float32 sums as one 16-byte vector of bf16 (round to nearest even).
__device__ __forceinline__ int4 PackBf16(const float (&acc)[8]) {
  int4 o;
  __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&o);
#pragma unroll
  for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(acc[2 * j], acc[2 * j + 1]);
  return o;
}

// SendSums' pieces: 2 KiB (4 vectors a lane), so that 32 float32 sums a lane keep the kernel at two blocks an SM.
constexpr int kSumVecs = 4, kSumBytes = kSumVecs * 32 * 16;
// Entries of a token whose rows SendSums loads at once in combine_send's own kernel: one at a time waited out a memory
// latency per entry (a token has ~4 entries a rank at top-8 over two ranks, and decode gives each warp about one
// token). The one-shot kernel keeps one: its receive half's registers leave no room for two without spilling.
constexpr int kSumEntries = 2;

// The reduced modes: this rank's own entries only record their rows (combine_recv reads them from expert_y); per
// (token owner q, token t, 2 KiB piece) one warp sums the rows of q's token t held here, weighted by the weights
// dispatch carried (kWeighted) or by 1 (kUnit), in float32, and writes one bf16 row: on this node into q's entry of
// the token's first k here (combine_recv knows it from topk_idx), for q on another node into row t of q's region
// (t is then the token's slot in the region q sent; `fab_free`: that region may be written). Rows come from the
// route table of dispatch_recv, for the tokens each sender dispatched (the route's sent counts: the work follows
// them, not max_tokens); rows at or past `total` (a route not from dispatch_recv) are skipped.
template <int Entries>
__device__ void SendSums(const KernelArgs& a, Part part, int ch, int mode, const uint8_t* y, const int32_t* route,
                         long long total, const FabricArgs& fab, unsigned long long epoch, bool fab_free) {
  const MoeShape& s = a.s;
  const int n = s.num_ranks, r = s.experts_per_token, lane = threadIdx.x & 31;
  const long long entries = s.entries();
  const int32_t* rows = route + RouteTableOffset(s);
  const float* weights = reinterpret_cast<const float*>(route + RouteWeightsOffset(s));
  const int32_t* sent = route + RouteSentOffset(s);
  __shared__ int first_pair[kMaxRanks + 1];  // items by token owner: q's (token, piece) pairs start at first_pair[q]
  if (threadIdx.x == 0) {
    int at = 0;
    for (int q = 0; q < n; ++q) {
      first_pair[q] = at;
      at += q == a.rank || (IsRemote(a, q) && !fab_free) ? 0 : static_cast<int>(ClampTokens(s, sent[q]));
    }
    first_pair[n] = at;
  }
  const int own_tokens = static_cast<int>(ClampTokens(s, sent[a.rank]));
  const size_t slot = RoundSlot(epoch) * a.lay.combine_slot;  // this round's slot of the combine fields
  int32_t* self = reinterpret_cast<int32_t*>(a.base + a.lay.self + slot) + ch * entries;
  const int32_t* own = rows + a.rank * entries;
  // Every entry (one store each): past the tokens sent the table is stale, and combine_recv must find -1 there.
  const long long own_entries = static_cast<long long>(own_tokens) * r;
  for (long long j = static_cast<long long>(part.id) * blockDim.x + threadIdx.x; j < entries;
       j += static_cast<long long>(part.count) * blockDim.x)
    self[j] = j < own_entries && own[j] < total ? own[j] : -1;
  __syncthreads();
  if (part.id == 0 && threadIdx.x == 0 && a.num_remote > 0) Trace(a, kCombineSend + 2 * ch, epoch, kTraceIndexed);
  const int row_bytes = s.combine_row_bytes(), chunks = (row_bytes + kSumBytes - 1) / kSumBytes;
  const long long items = static_cast<long long>(first_pair[n]) * chunks;
  for (long long item = part.id * kWarps + (threadIdx.x >> 5); item < items; item += part.count * kWarps) {
    const int pair = static_cast<int>(item / chunks);
    const int off = static_cast<int>(item - static_cast<long long>(pair) * chunks) * kSumBytes;
    int lo = 0, hi = n - 1;
    while (lo < hi) {  // the owner of `pair`: the last q with first_pair[q] <= pair
      const int mid = (lo + hi + 1) >> 1;
      if (first_pair[mid] <= pair) lo = mid; else hi = mid - 1;
    }
    const int q = lo, t = pair - first_pair[q];
    int row = -1;
    float wt = 0.f;
    if (lane < r) {
      const size_t at = (static_cast<size_t>(q) * s.max_tokens + t) * r + lane;
      row = rows[at];
      wt = mode == kUnit ? 1.f : weights[at];
      if (row >= total) row = -1;
    }
    unsigned m = __ballot_sync(0xffffffffu, row >= 0);
    const bool remote = IsRemote(a, q);
    if (m == 0 && !remote) continue;  // no entry of this token is here (a remote slot always gets its row: zeros)
    const int first = __ffs(m) - 1;
    const int vecs = (row_bytes - off < kSumBytes ? row_bytes - off : kSumBytes) >> 4;
    float acc[kSumVecs][8];
#pragma unroll
    for (int u = 0; u < kSumVecs; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
    while (m) {  // Entries entries at a time, their loads in flight together (m is the same in every lane)
      int i[Entries];
      float wk[Entries];
#pragma unroll
      for (int j = 0; j < Entries; ++j) {
        const int k = __ffs(m) - 1;  // -1 once m is empty (entry 0 always exists: the loop's condition)
        m &= m - 1;
        i[j] = __shfl_sync(0xffffffffu, row, k < 0 ? 0 : k);
        // as combine_recv: a row with weight 0 adds nothing, even a non-finite one
        wk[j] = __shfl_sync(0xffffffffu, wt, k < 0 ? 0 : k);
        if (k < 0) wk[j] = 0.f;
      }
      // A zero weight skips its loads below already; skipping the whole step at one entry a time keeps the one-shot
      // kernel at 0 spills (-Xptxas -v), which the per-load test alone does not.
      if (Entries == 1 && wk[0] == 0.f) continue;
      int4 v[Entries][kSumVecs];
#pragma unroll
      for (int j = 0; j < Entries; ++j) {
        const int4* src = reinterpret_cast<const int4*>(y + static_cast<size_t>(i[j]) * row_bytes + off);
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u)
          if (wk[j] != 0.f && lane + 32 * u < vecs) v[j][u] = LoadCg(src + lane + 32 * u);
      }
#pragma unroll
      for (int j = 0; j < Entries; ++j)
#pragma unroll
        for (int u = 0; u < kSumVecs; ++u)
          if (wk[j] != 0.f && lane + 32 * u < vecs) FmaBf16(acc[u], wk[j], v[j][u]);
    }
    int4* dst = reinterpret_cast<int4*>(
        remote ? SendRegion(fab, a, epoch, q) + FabricHeaderBytes(s) + static_cast<size_t>(t) * row_bytes + off
               : Peer(a, q) + a.lay.comb + slot + (ch * entries + static_cast<long long>(t) * r + first) * row_bytes + off);
#pragma unroll
    for (int u = 0; u < kSumVecs; ++u)
      if (lane + 32 * u < vecs) dst[lane + 32 * u] = PackBf16(acc[u]);
  }
}

// `polled`: block 0 of the launch polls the lane's kSent word in host memory (CombineSendKernel) while this part
// reads the route's prefix, and this part then waits on block 0's device copy of the word only.
template <int SumEntries = 1>
__device__ void CombineSendBody(const KernelArgs& a, const CombineSendIo& io, Part part, bool polled = false) {
  const int ch = io.channel, mode = io.mode;
  const uint8_t* y = static_cast<const uint8_t*>(io.expert_y);
  const int32_t* route = io.route;
  int32_t* ticket = io.ticket;
  extern __shared__ uint8_t smem[];
  const MoeShape& s = a.s;
  const int n = s.num_ranks, blocks = s.num_experts;
  int* sstart = reinterpret_cast<int*>(smem);             // remote ranks only: [blocks + 1] dispatch_recv's prefix of rows per (e, q) block
  int* qoff = sstart + blocks + 1; // [blocks]: where block (e, q)'s rows start in q's combine region
  int* region_rows = qoff + blocks;  // [n]: the rows of remote q's region, for its header once the lane is free
  __shared__ int free_ok;
  const int half = kCombineSend + 2 * ch, flag = kCombineFlag + 2 * ch, ack = kCombineAck + 2 * ch;
  const unsigned long long epoch = Local(a)->epoch[half] + 1;
  const size_t slot = RoundSlot(epoch) * a.lay.combine_slot;  // the token owners' areas of this round
  const FabricArgs& fab = a.fab[1 + ch];
  TracePart0(a, part, half, epoch, kTraceStart);
  // The token owners must have summed the last round in this slot before their combine areas are overwritten.
  if (threadIdx.x < n && !IsRemote(a, threadIdx.x))
    WaitAtLeast(a, Flags(a.base, a, ack) + threadIdx.x, SlotPredecessor(epoch), ack * kWaitStride + threadIdx.x);
  const long long rows = s.max_recv_rows(), entries = s.entries();
  const long long cap = FabricCombineRows(s, ch);  // rows a region of this channel holds
  if (a.num_remote > 0) {
    for (int f = threadIdx.x; f <= blocks; f += blockDim.x) sstart[f] = route[rows + 1 + f];
    __syncthreads();
    if (threadIdx.x < n && IsRemote(a, threadIdx.x)) {
      const int q = threadIdx.x;
      long long at = 0;  // a route not from dispatch_recv may hold anything: 64-bit sums, clamped
      if (mode == kPerEntry) {  // rows go back expert after expert, as q sent them
        for (int e = 0; e < s.local_experts; ++e) {
          const int f = e * n + q;
          const long long c = static_cast<long long>(sstart[f + 1]) - sstart[f];
          qoff[f] = static_cast<int>(at < cap ? at : cap);
          at += c > 0 ? c : 0;
        }
        if (at > cap) at = cap;
      } else {  // one summed row per slot of the region q sent (SendSums)
        at = ClampTokens(s, route[RouteSentOffset(s) + q]);
      }
      region_rows[q] = static_cast<int>(at);
    }
  }
  // The NIC must be done with this lane's previous round before the regions are rewritten (the proxy's kSent). Only
  // part id 0 of WaitFabric reads host memory: block 0 where it polls for the parts (`polled`: they pass id + 1).
  if (threadIdx.x == 0) {
    free_ok = a.num_remote == 0 ||
              WaitFabric(a, fab, proxy::kSent, SlotPredecessor(epoch), ack * kWaitStride + FirstRemote(a), 1 + ch,
                         polled ? Part{part.id + 1, part.count + 1} : part);
    if (part.id == 0 && a.num_remote > 0) Trace(a, half, epoch, kTraceFree);
  }
  __syncthreads();
  if (a.num_remote > 0 && part.id == 0 && free_ok && threadIdx.x < n && IsRemote(a, threadIdx.x)) {
    const int q = threadIdx.x;
    StoreHeader(SendRegion(fab, a, epoch, q), fab, a, epoch, region_rows[q]);
    fab.bytes[(epoch % kFabricLanes) * n + q] = FabricCombineBytes(s, region_rows[q]);
  }
  TracePart0(a, part, half, epoch, kTraceWaited);
  long long total = route[rows];
  total = total < 0 ? 0 : (total > rows ? rows : total);
  const int lane = threadIdx.x & 31;
  const int chunks = ChunksOf(s.combine_row_bytes());
  // Per row in kPerEntry; the reduced modes sum per token below, for every rank.
  const long long items = mode != kPerEntry ? 0 : total * chunks;
  for (long long item = part.id * kWarps + (threadIdx.x >> 5); item < items; item += part.count * kWarps) {
    const long long i = item / chunks;
    const int off = static_cast<int>(item - i * chunks) * kChunkBytes;
    const int from = route[i];
    const int q = static_cast<int>(from / entries);
    if (from < 0 || q >= s.num_ranks) continue;
    const long long tk = from - q * entries;
    if (IsRemote(a, q)) {  // into q's region, at the place of row i among q's rows
      if (!free_ok) continue;
      int lo = 0, hi = blocks - 1;
      while (lo < hi) {  // the block holding row i: last f with sstart[f] <= i
        const int mid = (lo + hi + 1) >> 1;
        if (sstart[mid] <= i) lo = mid; else hi = mid - 1;
      }
      const long long j = qoff[lo] + (i - sstart[lo]);
      if (lo % n != q || j < 0 || j >= cap) continue;  // a route not from dispatch_recv
      const int bytes = s.combine_row_bytes() - off < kChunkBytes ? s.combine_row_bytes() - off : kChunkBytes;
      WarpCopy16(SendRegion(fab, a, epoch, q) + FabricHeaderBytes(s) + j * s.combine_row_bytes() + off,
                 y + i * s.combine_row_bytes() + off, bytes, lane);
      continue;
    }
    if (q == a.rank) {  // this rank's own entry: combine_recv reads the row from expert_y, only its index moves
      if (off == 0 && lane == 0) reinterpret_cast<int32_t*>(a.base + a.lay.self + slot)[ch * entries + tk] = static_cast<int32_t>(i);
      continue;
    }
    const int bytes = s.combine_row_bytes() - off < kChunkBytes ? s.combine_row_bytes() - off : kChunkBytes;
    WarpCopy16(Peer(a, q) + a.lay.comb + slot + (ch * entries + tk) * s.combine_row_bytes() + off, y + i * s.combine_row_bytes() + off, bytes, lane);
  }
  if (mode != kPerEntry) SendSums<SumEntries>(a, part, ch, mode, y, route, total, fab, epoch, a.num_remote > 0 && free_ok);
  FinishPart(a, polled ? Part{part.id, part.count + 1} : part, half, [&](LocalSync* ls) {
    // The bell first: the wire is the longer way.
    if (a.num_remote > 0) Trace(a, half, epoch, kTraceBell);
    if (a.num_remote > 0 && !ls->timed_out) StoreReleaseSys(fab.bell + proxy::kRung, epoch);
    RaiseNodeFlags(a, flag, epoch);
    ls->epoch[half] = epoch;
    ticket[0] = static_cast<int32_t>(epoch);
    ticket[1] = ticket[2] = ticket[3] = 0;
  });
}

// combine_recv. Every block waits for the senders (and checks the regions of ranks on other nodes), then the warps
// take (token, group of pieces) items: lanes k < R resolve entry k (its row: the combine area, expert_y for entries
// served here, a remote region; its weight: 0 for masked entries and repeats, 1 for a peer's summed row at the token's
// first k on that peer), then every lane sums its vectors over the entries with 8 entries' loads in flight. A token's
// pieces are split over as many warps as the grid has per token, so that decode's few tokens still use every warp.
template <int kVecs>
__device__ void CombineRecvBody(const KernelArgs& a, const CombineRecvIo& io, Part part) {
  constexpr int kPieceVecs = PieceVecs(kVecs);
  extern __shared__ uint8_t smem[];
  int* pok = reinterpret_cast<int*>(smem);  // [n] remote rank p's region is valid
  __shared__ int fab_ok;
  const MoeShape& s = a.s;
  const int ch = io.channel, mode = io.mode, tokens = io.tokens;
  const float* w = io.topk_weights;
  const int32_t* idx = io.topk_idx;
  const uint8_t* y = static_cast<const uint8_t*>(io.expert_y);
  uint8_t* out = static_cast<uint8_t*>(io.out);
  const int half = kCombineRecv + 2 * ch, flag = kCombineFlag + 2 * ch, ack = kCombineAck + 2 * ch;
  const unsigned long long epoch = Local(a)->epoch[half] + 1;
  const FabricArgs& fab = a.fab[1 + ch];
  // Rows of remote ranks: per entry, its position among p's entries (the order p received them); in the reduced
  // modes, the token's slot (one summed row per token). From this channel's index (IndexKernel, before this kernel).
  const int owed = mode == kPerEntry ? s.local_experts : s.local_experts + 1;  // off[owed]: the rows p returns
  TracePart0(a, part, half, epoch, kTraceStart);
  CheckTicket(a, io.ticket, epoch, 1 + ch, part);
  if (threadIdx.x < s.num_ranks && !IsRemote(a, threadIdx.x))
    WaitAtLeast(a, Flags(a.base, a, flag) + threadIdx.x, epoch, flag * kWaitStride + threadIdx.x);
  if (threadIdx.x == 0)
    fab_ok = a.num_remote == 0 ||
             WaitFabric(a, fab, proxy::kArrived, epoch, flag * kWaitStride + FirstRemote(a), 1 + ch, part);
  __syncthreads();
  if (threadIdx.x < s.num_ranks && IsRemote(a, threadIdx.x)) {  // the region holds exactly the rows we expect
    const int p = threadIdx.x;
    const proxy::RegionHeader h = LoadHeader(RecvRegion(fab, a, epoch, p));
    pok[p] = fab_ok && HeaderOk(h, fab, epoch, p, FabricCombineRows(s, ch)) &&
             h.rows == IndexOf(a, 1 + ch, p).off[owed];
    if (fab_ok && !pok[p] && part.id == 0) RaiseError(a, kBadPeerData, p);
  }
  __syncthreads();
  TracePart0(a, part, half, epoch, kTraceWaited);
  const int r = s.experts_per_token, l = s.local_experts, lane = threadIdx.x & 31;
  const long long entries = s.entries();
  const size_t slot = RoundSlot(epoch) * a.lay.combine_slot;  // this round's slot of the combine fields
  const uint8_t* comb = a.base + a.lay.comb + slot + static_cast<size_t>(ch) * entries * s.combine_row_bytes();
  const int32_t* self = reinterpret_cast<const int32_t*>(a.base + a.lay.self + slot) + ch * entries;
  const int vecs = s.combine_row_bytes() >> 4;  // 8 bf16 per 16-byte vector
  const int pieces = (vecs + kPieceVecs - 1) / kPieceVecs;
  const int warps = static_cast<int>(part.count * (blockDim.x >> 5));
  // At least enough groups that an item holds kItemPieces pieces or fewer (many small items keep the grid-stride loop
  // balanced at prefill), more where the grid has warps to spare (decode).
  const int groups = max((pieces + kItemPieces - 1) / kItemPieces, min(pieces, tokens > 0 ? warps / tokens : 1));
  const int per_group = (pieces + groups - 1) / groups;
  for (long long item = static_cast<long long>(part.id) * (blockDim.x >> 5) + (threadIdx.x >> 5);
       item < static_cast<long long>(tokens) * groups; item += warps) {
    const int t = static_cast<int>(item / groups);
    const int p0 = static_cast<int>(item - static_cast<long long>(t) * groups) * per_group;
    const int p1 = min(pieces, p0 + per_group);
    if (p0 >= p1) continue;  // the same for the whole warp
    // Lane k < R: entry k. Its weight and served-here row are loaded beside the id, not after it.
    const size_t entry = static_cast<size_t>(t) * r + lane;
    int g = -1;
    float wt = 0.f;
    int32_t i_self = -1;
    if (lane < r) {
      g = idx[entry];
      wt = w[entry];
      i_self = self[entry];
      if (g < 0 || g >= s.num_experts) g = -1;
    }
    // A repeat of an earlier entry's expert is masked (as SentExpert): the lanes holding the same id.
    const unsigned same = __match_any_sync(0xffffffffu, lane < r ? g : -2 - lane);
    if (g >= 0 && (same & ((1u << lane) - 1u))) g = -1;
    const int p = g >= 0 ? g / l : -1;
    const uint8_t* row = comb + entry * s.combine_row_bytes();
    if (g < 0) {
      wt = 0.f;
    } else if (p == a.rank) {
      if (i_self >= 0 && i_self < s.max_recv_rows()) row = y + static_cast<size_t>(i_self) * s.combine_row_bytes(); else wt = 0.f;
    } else if (IsRemote(a, p)) {  // its row in p's region: per entry, or (reduced modes) the token's summed row
      const RankIndex ix = IndexOf(a, 1 + ch, p);
      const int i = mode == kPerEntry ? EntryOf(ix, l, t, g - p * l) : SlotOf(ix, t);
      if (pok[p] && i >= 0 && i < ix.off[owed]) {
        row = RecvRegion(fab, a, epoch, p) + FabricHeaderBytes(s) + static_cast<size_t>(i) * s.combine_row_bytes();
        if (mode != kPerEntry) wt = 1.f;
      } else {
        wt = 0.f;
      }
    } else if (mode != kPerEntry) {
      wt = 1.f;  // the peer sent this token's rows on it as one weighted sum, in the entry of its first k there
    }
    // A peer's sum counts once, at the token's first k there: the lowest lane of the entries on the same peer (sent
    // entries only).
    const unsigned on_p = __match_any_sync(0xffffffffu, g >= 0 ? p : -2 - lane);
    if (g >= 0 && mode != kPerEntry && p != a.rank && (on_p & ((1u << lane) - 1u))) wt = 0.f;
    const unsigned long long row_bits = reinterpret_cast<unsigned long long>(row);
    for (int piece = p0; piece < p1; ++piece) {
      const int c0 = piece * kPieceVecs + lane;
      float acc[kVecs][8];
#pragma unroll
      for (int u = 0; u < kVecs; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.f;
      for (int k0 = 0; k0 < r; k0 += 8) {
        int4 v[8][kVecs];
        float wu[8];
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          const int k = (k0 + u) & 31;
          wu[u] = __shfl_sync(0xffffffffu, wt, k);
          const int4* src = reinterpret_cast<const int4*>(__shfl_sync(0xffffffffu, row_bits, k));
          if (k0 + u >= r) wu[u] = 0.f;
          // Masked entries hold stale rows: never read them into the sum.
#pragma unroll
          for (int q = 0; q < kVecs; ++q)
            if (wu[u] != 0.f && c0 + 32 * q < vecs) v[u][q] = LoadCg(src + c0 + 32 * q);
        }
#pragma unroll
        for (int u = 0; u < 8; ++u) {
          if (wu[u] == 0.f) continue;
#pragma unroll
          for (int q = 0; q < kVecs; ++q)
            if (c0 + 32 * q < vecs) FmaBf16(acc[q], wu[u], v[u][q]);
        }
      }
#pragma unroll
      for (int q = 0; q < kVecs; ++q)
        if (c0 + 32 * q < vecs)
          reinterpret_cast<int4*>(out + static_cast<size_t>(t) * s.combine_row_bytes())[c0 + 32 * q] = PackBf16(acc[q]);
    }
  }
  FinishPart(a, part, half, [&](LocalSync* ls) {
    ls->epoch[half] = epoch;
    RaiseNodeFlags(a, ack, epoch);
    if (a.num_remote > 0) StoreReleaseSys(fab.bell + proxy::kRead, epoch);  // the proxy gives the senders credit
  });
}

// With ranks on other nodes block 0 polls the lane's kSent word for the other blocks (the parts, ids 0..), which
// meanwhile read the route's prefix (a read of host memory in a part would hold its block's next barrier for a PCIe
// round trip). Block 0 arrives too, as the last part id: else a part could run last() and advance the epoch before
// block 0 read it (the parts need not wait for block 0 where an earlier poll already saw the word). Its last() is
// CombineSendBody's, written out again: one helper for both made ptxas spill in this kernel and the one-shot kernel.
__global__ void __launch_bounds__(kThreads) CombineSendKernel(KernelArgs a, CombineSendIo io) {
  if (a.num_remote == 0) {
    CombineSendBody<kSumEntries>(a, io, BlockPart());
    return;
  }
  const int parts = static_cast<int>(gridDim.x) - 1, block = static_cast<int>(blockIdx.x);
  if (block > 0) {
    CombineSendBody<kSumEntries>(a, io, Part{block - 1, parts}, /*polled=*/true);
    return;
  }
  const int ch = io.channel;
  const unsigned long long epoch = Local(a)->epoch[kCombineSend + 2 * ch] + 1;  // as the parts read it
  if (threadIdx.x == 0)
    WaitFabric(a, a.fab[1 + ch], proxy::kSent, SlotPredecessor(epoch),
               (kCombineAck + 2 * ch) * kWaitStride + FirstRemote(a), 1 + ch, Part{0, 1});
  const int half = kCombineSend + 2 * ch, flag = kCombineFlag + 2 * ch;
  FinishPart(a, Part{parts, parts + 1}, half, [&](LocalSync* ls) {
    Trace(a, half, epoch, kTraceBell);
    if (!ls->timed_out) StoreReleaseSys(a.fab[1 + ch].bell + proxy::kRung, epoch);
    RaiseNodeFlags(a, flag, epoch);
    ls->epoch[half] = epoch;
    io.ticket[0] = static_cast<int32_t>(epoch);
    io.ticket[1] = io.ticket[2] = io.ticket[3] = 0;
  });
}

__global__ void __launch_bounds__(kRecvThreads, kRecvBlocksPerSm) CombineRecvKernel(KernelArgs a, CombineRecvIo io) {
  CombineRecvBody<kRecvVecs>(a, io, BlockPart());
}

// The one-shot combine where every rank is on this node: the send's parts, then the receive's, from the channel's
// queue (queue.cuh; see DispatchKernel).
__global__ void __launch_bounds__(kThreads, 2)
    CombineKernel(KernelArgs a, CombineSendIo send, CombineRecvIo recv, int sends, int recvs) {
  RunQueued(
      a, 1 + send.channel, sends, recvs, [&](Part p) { CombineSendBody(a, send, p); },
      [&](Part p) { CombineRecvBody<kFusedRecvVecs>(a, recv, p); });
}

__global__ void TimestampKernel(uint64_t* out) { out[0] = GlobalTimer(); }

// combine_send's blocks (or the one kernel's send parts) when every rank dispatched `tokens` tokens: a warp per 4 KiB
// piece of a row received, or per 2 KiB piece of a (token owner, token) sum. The host knows no peer's tokens, only
// (for the one-shot call) its own; ranks of one program dispatch alike, and any count is correct (the loops stride).
LaunchShape SendShapeFor(const KernelArgs& a, int mode, long long tokens) {
  const long long rows = a.s.max_recv_rows() / a.s.max_tokens * tokens;  // N * min(R, L) rows a token at most
  const long long items = mode == kPerEntry ? rows * ChunksOf(a.s.combine_row_bytes())
                                            : int64_t(a.s.num_ranks) * tokens *
                                                  ((a.s.combine_row_bytes() + kSumBytes - 1) / kSumBytes);
  return {GridFor(items, kWarps, a.num_sms), kThreads};
}

// Warp items of combine_recv: (token, piece) pairs.
long long RecvItems(const KernelArgs& a, int tokens, int vecs_a_lane) {
  const int pieces = ((a.s.combine_row_bytes() >> 4) + PieceVecs(vecs_a_lane) - 1) / PieceVecs(vecs_a_lane);
  return static_cast<long long>(tokens) * pieces;
}

size_t CombineSendSmem(const KernelArgs& a) {
  return a.num_remote > 0 ? sizeof(int) * (2 * a.s.num_experts + 1 + a.s.num_ranks) : 0;
}
size_t CombineRecvSmem(const KernelArgs& a) { return sizeof(int) * a.s.num_ranks; }

// Parts of the one kernel's receive: a warp per (token, piece) item of kFusedRecvVecs, 0 when the one kernel does not
// pay. One pass of a resident grid's warps over the receive work, or the two kernels: past that (prefill) the
// boundary is small beside the sums, which run faster at the receive kernel's occupancy (measured at EP1: 166 against
// 229 us).
int FusedRecvParts(const KernelArgs& a, int tokens) {
  const long long items = RecvItems(a, tokens, kFusedRecvVecs);
  const int fit = ResidentBlocks(reinterpret_cast<const void*>(CombineKernel), kThreads, CombineRecvSmem(a), a.num_sms);
  if (fit <= 0 || items > static_cast<long long>(fit) * kWarps) return 0;
  return static_cast<int>(std::max(1LL, (items + kWarps - 1) / kWarps));
}

// The one kernel of a one-shot combine: its blocks (0: two kernels) and how its parts split, computed once a launch
// (the part counts cost occupancy look-ups under a mutex).
OnePlan CombinePlan(const KernelArgs& a, int mode, int tokens) {
  if (a.num_remote > 0 || !OneKernelAllowed()) return {};
  const int recvs = FusedRecvParts(a, tokens);
  if (recvs == 0) return {};
  const int sends = SendShapeFor(a, mode, tokens).blocks;
  return {OneKernelBlocks(reinterpret_cast<const void*>(CombineKernel), kThreads, CombineRecvSmem(a), a.num_sms,
                          sends + recvs),
          sends, recvs};
}

}  // namespace

LaunchShape CombineSendShape(const KernelArgs& a, int mode) {
  LaunchShape shape = SendShapeFor(a, mode, a.s.max_tokens);
  // block 0 polls the lane for the others (CombineSendKernel): one block more, or at GridFor's bound one part fewer
  if (a.num_remote > 0) shape.blocks = std::min(shape.blocks + 1, std::max(2, 2 * a.num_sms));
  return shape;
}

LaunchShape CombineRecvShape(const KernelArgs& a, int tokens) {
  const long long blocks = (RecvItems(a, tokens, kRecvVecs) + kRecvThreads / 32 - 1) / (kRecvThreads / 32);
  // One resident wave at most: a second, partial wave left a 60 us tail at prefill; grid-stride items take the rest.
  return {static_cast<int>(std::max(1LL, std::min(blocks, static_cast<long long>(kRecvBlocksPerSm) * a.num_sms))),
          kRecvThreads};
}

LaunchShape CombineShape(const KernelArgs& a, int mode, int tokens) { return {CombinePlan(a, mode, tokens).blocks, kThreads}; }

cudaError_t LaunchCombineSend(const KernelArgs& a, const CombineSendIo& io, cudaStream_t stream) {
  const size_t smem = CombineSendSmem(a);
  if (cudaError_t err = AllowSmem(CombineSendKernel, smem); err != cudaSuccess) return err;
  CombineSendKernel<<<CombineSendShape(a, io.mode).blocks, kThreads, smem, stream>>>(a, io);
  return cudaGetLastError();
}

cudaError_t LaunchCombineRecv(const KernelArgs& a, const CombineRecvIo& io, cudaStream_t stream) {
  if (a.num_remote > 0) {  // first: where each remote entry's row will sit
    if (cudaError_t err = LaunchCombineIndex(a, io.channel, io.mode, io.tokens, io.topk_idx, stream); err != cudaSuccess)
      return err;
  }
  CombineRecvKernel<<<CombineRecvShape(a, io.tokens).blocks, kRecvThreads, CombineRecvSmem(a), stream>>>(a, io);
  return cudaGetLastError();
}

cudaError_t LaunchCombine(const KernelArgs& a, const CombineSendIo& send, const CombineRecvIo& recv,
                          cudaStream_t stream, bool* send_launched) {
  *send_launched = false;
  if (const OnePlan plan = CombinePlan(a, send.mode, recv.tokens); plan.blocks > 0) {
    CombineKernel<<<plan.blocks, kThreads, CombineRecvSmem(a), stream>>>(a, send, recv, plan.send_parts, plan.recv_parts);
    return cudaGetLastError();
  }
  if (cudaError_t err = LaunchCombineSend(a, send, stream); err != cudaSuccess) return err;
  *send_launched = true;
  return LaunchCombineRecv(a, recv, stream);
}

cudaError_t LaunchTimestamp(uint64_t* out, cudaStream_t stream) {
  TimestampKernel<<<1, 1, 0, stream>>>(out);
  return cudaGetLastError();
}

}  // namespace jax_moe::cuda
