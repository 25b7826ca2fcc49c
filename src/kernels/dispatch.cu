// dispatch_send (push each token once to every rank holding one of its experts, plus per local expert the list of
// its tokens) and dispatch_recv (wait, expand the received tokens into expert_x rows in the contract order: local
// expert, then source rank, then source token). One kernel each, or one for both (the one-shot dispatch, every rank on
// this node): each half is a body run per part, so the one kernel runs the send's parts, then the receive's.
#include "kernels/copy.cuh"
#include "kernels/scan.cuh"
#include "kernels/fabric_kernels.h"
#include "kernels/fabric_pack.cuh"
#include "kernels/grid.h"
#include "kernels/moe_kernels.h"
#include "kernels/one_kernel.h"
#include "kernels/queue.cuh"
#include "kernels/sync.cuh"

#include <algorithm>

namespace jax_moe::cuda {
namespace {

// A block of dispatch_send's launch is done (`part` counts every block of it); the last one raises the NVLink
// receivers' flags, advances the epoch and writes the ticket. `fenced`: as FinishPart.
__device__ void DispatchSendArrive(const KernelArgs& a, const DispatchSendIo& io, Part part, unsigned long long epoch,
                                   bool fenced = false) {
  FinishPart(
      a, part, kDispatchSend,
      [&](LocalSync* ls) {
        RaiseNodeFlags(a, kDispatchFlag, epoch);
        ls->epoch[kDispatchSend] = epoch;
        io.ticket[0] = static_cast<int32_t>(epoch);
        io.ticket[1] = io.ticket[2] = io.ticket[3] = 0;
      },
      fenced);
}

constexpr int kScanTiles = 4;  // tiles of kThreads tokens in one pass of ListExpert beyond one tile: a 16-bit lane of
                               // a 64-bit word counts each (at most kThreads)
static_assert(kScanTiles * 16 <= 64 && kThreads < (1 << 16), "a tile's count fits its 16-bit lane");

// Writes, in token order, t * r + k for each token t whose first entry naming g is k into list; returns how many. Every
// thread of the block calls it (barriers); `counts`: shared scratch of one word per warp. A pass takes Tiles tiles of
// kThreads tokens, a token a thread: the Tiles rows' loads are in flight together (no branch between them: a row past
// the tokens reads token 0's), and one barrier pair counts all tiles, a 16-bit lane of each warp's word per tile. One
// tile a pass waited out a load latency and two barriers 16 times per expert at prefill (4096 tokens); at decode one
// tile covers every token.
template <int Tiles>
__device__ int ListExpert(const int32_t* idx, int tokens, int r, int g, int32_t* list, unsigned long long* counts) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned below = (1u << lane) - 1u;
  int running = 0;
  for (int base = 0; base < tokens; base += kThreads * Tiles) {
    int kf[Tiles];  // the first entry of this thread's token of tile j naming g (later repeats masked), or -1
    unsigned m[Tiles];
    unsigned long long mine = 0;  // this warp's count per tile, a 16-bit lane each
#pragma unroll
    for (int j = 0; j < Tiles; ++j) {
      const int t = base + j * kThreads + static_cast<int>(threadIdx.x);
      const int32_t* row = idx + static_cast<size_t>(t < tokens ? t : 0) * r;
      int f = -1;
#pragma unroll 8
      for (int k = r - 1; k >= 0; --k)
        if (row[k] == g) f = k;
      kf[j] = t < tokens ? f : -1;
      m[j] = __ballot_sync(0xffffffffu, kf[j] >= 0);
      mine |= static_cast<unsigned long long>(__popc(m[j])) << (16 * j);
    }
    if (lane == 0) counts[warp] = mine;
    __syncthreads();
    unsigned long long before = 0, total = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      const unsigned long long c = counts[w];
      before += w < warp ? c : 0;
      total += c;
    }
#pragma unroll
    for (int j = 0; j < Tiles; ++j) {
      if (kf[j] >= 0)
        list[running + static_cast<int>((before >> (16 * j)) & 0xffffu) + __popc(m[j] & below)] =
            (base + j * kThreads + static_cast<int>(threadIdx.x)) * r + kf[j];
      running += static_cast<int>((total >> (16 * j)) & 0xffffu);
    }
    __syncthreads();  // counts is rewritten by the next pass
  }
  return running;
}

// The expert lists of this node's ranks from their index (list_index.cu): a warp per token, lane k its entry k if it is
// the first naming a valid expert and that expert is on this node, at its place in the list; a part per rank writes
// the rank's counts. The same lists ListExpert writes (token order within each expert).
__device__ void IndexedLists(const KernelArgs& a, const int32_t* idx, int tokens, Part part, size_t slot) {
  const MoeShape& s = a.s;
  const int r = s.experts_per_token, l = s.local_experts, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int q = part.id; q < s.num_ranks; q += part.count) {  // the same for the whole block
    if (IsRemote(a, q)) continue;
    const RankIndex ix = IndexOf(a, 0, q);
    int32_t* counts = reinterpret_cast<int32_t*>(Peer(a, q) + a.lay.counts + slot) + a.rank * l;
    for (int e = threadIdx.x; e < l; e += blockDim.x) counts[e] = ix.off[e];
  }
  for (int t = part.id * kWarps + warp; t < tokens; t += part.count * kWarps) {  // the same for the whole warp
    const int g = lane < r ? idx[static_cast<size_t>(t) * r + lane] : -1;
    const bool first = FirstValidEntry(a, g);
    const int q = first ? g / l : 0;
    if (!first || IsRemote(a, q)) continue;
    const int e = g - q * l;
    int32_t* list = reinterpret_cast<int32_t*>(Peer(a, q) + a.lay.list + slot) +
                    (static_cast<size_t>(a.rank) * l + e) * s.max_tokens;
    // Its place in expert e's own list (an NVLink list is one per expert: no expert offset, unlike EntryOf's).
    const RankIndex ix = IndexOf(a, 0, q);
    const size_t at = static_cast<size_t>(t / kIndexChunk) * l + e;
    list[ix.base[at] + __popc(ix.bits[at] & Below(t % kIndexChunk))] = t * r + lane;
  }
}

// dispatch_send. Two independent jobs share the grid, so one launch does both:
//  - per (token, rank) pair, one warp: if any expert of the token lives on that rank, copy the token (its fp8
//    scales, its router weights when given) once into tokens[my_rank][t] there. Over NVLink that is each token once per rank, not once per (t, k).
//  - per global expert g (parts g, g + count, ...): scan the tokens in order; the i-th (t, k) naming g goes to
//    list[my_rank][e][i] on g's rank (e = g's local index), the count to counts[my_rank][e] there. Ranks come from
//    warp ballots, so the order is the tokens' order without sorting.
// Ids outside [0, E) other than -1 are masked and reported (every part checks a share of them: one block alone took
// ~50 us at prefill). `others`: blocks of other work in the same launch (the remote ranks' pack) that arrive at the
// half's end too (DispatchSendArrive), so the epoch advances only after every block of the launch has read it.
// `indexed`: the expert lists from the node's index (list_index.cu, launched before) instead of ListExpert.
__device__ void DispatchSendBody(const KernelArgs& a, const DispatchSendIo& io, Part part, int others = 0,
                                 bool indexed = false) {
  const int tokens = io.tokens;
  const uint8_t* x = static_cast<const uint8_t*>(io.x);
  const uint8_t* xs = static_cast<const uint8_t*>(io.x_scale);
  const float* w = io.topk_weights;
  const int32_t* idx = io.topk_idx;
  const MoeShape& s = a.s;
  const int experts = s.num_experts, r = s.experts_per_token, n = s.num_ranks;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const unsigned long long epoch = Local(a)->epoch[kDispatchSend] + 1;
  const size_t slot = RoundSlot(epoch) * a.lay.dispatch_slot;  // the receivers' areas of this round
  __shared__ unsigned long long scan_counts[kWarps];  // ListExpert's per-warp counts
  TracePart0(a, part, kDispatchSend, epoch, kTraceStart);

  // The receivers must have consumed the last round in this slot before its areas are overwritten.
  if (threadIdx.x < n && !IsRemote(a, threadIdx.x))
    WaitAtLeast(a, Flags(a.base, a, kDispatchAck) + threadIdx.x, SlotPredecessor(epoch),
                kDispatchAck * kWaitStride + threadIdx.x);
  __syncthreads();
  TracePart0(a, part, kDispatchSend, epoch, kTraceWaited);

  for (int i = part.id * kThreads + threadIdx.x; i < tokens * r; i += part.count * kThreads) {
    const int v = idx[i];
    if (v != -1 && (v < 0 || v >= experts)) RaiseError(a, kBadExpertId, v);
  }
  if (part.id == 0) {
    // How many tokens this round has: the receivers' route tables cover those, not max_tokens.
    if (threadIdx.x < n && !IsRemote(a, threadIdx.x))
      reinterpret_cast<int32_t*>(Peer(a, threadIdx.x) + a.lay.sent + slot)[a.rank] = tokens;
  }

  // Copies first: their stores drain over NVLink while the block goes on with the scans. One warp per 4 KiB piece
  // of a (token, rank) pair, in warp-major order so the copies spread over every block (and SM) even when few.
  const int chunks = ChunksOf(s.x_bytes());
  const long long items = static_cast<long long>(tokens) * n * chunks;
  for (long long item = warp * part.count + part.id; item < items; item += part.count * kWarps) {
    const int pair = static_cast<int>(item / chunks);
    const int off = static_cast<int>(item - static_cast<long long>(pair) * chunks) * kChunkBytes;
    const int t = pair / n, p = pair - t * n;
    bool here = false;
    if (lane < r) {
      const int g = idx[static_cast<size_t>(t) * r + lane];
      here = g >= 0 && g < experts && g / s.local_experts == p;
    }
    // Own tokens: dispatch_recv reads them from x; remote ranks': the pack blocks (fabric_pack.cuh).
    if (p == a.rank || IsRemote(a, p) || !__any_sync(0xffffffffu, here)) continue;
    uint8_t* dst = Peer(a, p) + a.lay.tokens + slot + (static_cast<size_t>(a.rank) * s.max_tokens + t) * RecordBytes(s);
    const int bytes = s.x_bytes() - off < kChunkBytes ? s.x_bytes() - off : kChunkBytes;
    WarpCopy16(dst + off, x + static_cast<size_t>(t) * s.x_bytes() + off, bytes, lane);
    if (xs && off == 0) WarpCopy4(dst + s.x_bytes(), xs + static_cast<size_t>(t) * s.scale_bytes(), s.scale_bytes(), lane);
    if (w && off == 0 && lane < r)
      reinterpret_cast<float*>(dst + s.x_bytes() + s.scale_bytes())[lane] = w[static_cast<size_t>(t) * r + lane];
  }

  if (indexed) {
    IndexedLists(a, idx, tokens, part, slot);
    DispatchSendArrive(a, io, Part{part.id, part.count + others}, epoch);
    return;
  }
  for (int g = part.id; g < experts; g += part.count) {
    const int p = g / s.local_experts, e = g - p * s.local_experts;
    if (IsRemote(a, p)) continue;  // the same for the whole block
    uint8_t* peer = Peer(a, p);
    int32_t* list = reinterpret_cast<int32_t*>(peer + a.lay.list + slot) + (static_cast<size_t>(a.rank) * s.local_experts + e) * s.max_tokens;
    const int running = tokens > kThreads ? ListExpert<kScanTiles>(idx, tokens, r, g, list, scan_counts)
                                          : ListExpert<1>(idx, tokens, r, g, list, scan_counts);
    if (threadIdx.x == 0) reinterpret_cast<int32_t*>(peer + a.lay.counts + slot)[a.rank * s.local_experts + e] = running;
  }

  DispatchSendArrive(a, io, Part{part.id, part.count + others}, epoch);
}

// The first indices in list[0, n) (ascending) whose values are >= v0 and >= v1: both searches in lockstep, so their
// dependent loads overlap.
__device__ __forceinline__ void LowerBounds(const int32_t* list, int n, int v0, int v1, int& i0, int& i1) {
  int lo0 = 0, hi0 = n, lo1 = 0, hi1 = n;
  while (lo0 < hi0 || lo1 < hi1) {
    const int m0 = (lo0 + hi0) >> 1, m1 = (lo1 + hi1) >> 1;
    const int a0 = lo0 < hi0 ? __ldcg(list + m0) : 0, a1 = lo1 < hi1 ? __ldcg(list + m1) : 0;
    if (lo0 < hi0) { if (a0 < v0) lo0 = m0 + 1; else hi0 = m0; }
    if (lo1 < hi1) { if (a1 < v1) lo1 = m1 + 1; else hi1 = m1; }
  }
  i0 = lo0;
  i1 = lo1;
}

// One token record into expert_x (and its scales when `sdst`): the scales' loads go first and their stores last, so
// that they wait out a latency with the row's. 8 vectors a lane in flight: 16 (a 7168-byte row in one batch) pushed
// the receive kernel past 128 registers (two blocks an SM) and spilled.
__device__ __forceinline__ void CopyRecord(uint8_t* dst, const uint8_t* src, int bytes, uint8_t* sdst, const uint8_t* ssrc,
                                        int sbytes, int lane) {
  WarpWords4 scale;
  if (sdst) scale.load(ssrc, sbytes, lane);
  WarpCopy16(dst, src, bytes, lane);
  if (sdst) scale.store(sdst, ssrc, sbytes, lane);
}

constexpr int kTableTokens = 64;  // tokens of one route-table job

// dispatch_recv's route table (RouteTableOffset): per (sender q, token t, k) the expert_x row of that entry, -1 where
// none is here, and its router weight, for the reduced combine modes. One job = (q, kTableTokens tokens), on the
// grid's last blocks (the rows start at block 0, so at decode the jobs run beside them, not in front): for each
// local expert, the list entries of those tokens (a binary search: a list is in token order) mark their rows in shared
// memory, then the job writes all its slots, so every slot of a token sent (t < sent[q]) is written each round
// without a grid-wide barrier; jobs past a sender's tokens do nothing (buffers sized for prefill cost nothing more at
// decode). Entries from a peer are bounded (t in the job, k < R, i < the checked count) before they are followed.
// A sender on another node: its region's list (block f from loff[f]) and records, t being the token's slot there.
__device__ void FillRouteTable(const KernelArgs& a, Part part, const int* start, const int* ok, const int* sent,
                               const int32_t* list, const uint8_t* toks, const float* w, int x_tokens, int* tab,
                               int32_t* route, const FabricArgs& fab, unsigned long long epoch, const int* loff) {
  const MoeShape& s = a.s;
  const int n = s.num_ranks, l = s.local_experts, r = s.experts_per_token;
  const int chunks = (s.max_tokens + kTableTokens - 1) / kTableTokens;
  int32_t* rows = route + RouteTableOffset(s);
  float* weights = reinterpret_cast<float*>(route + RouteWeightsOffset(s));
  for (int job = part.count - 1 - part.id; job < n * chunks; job += part.count) {
    const int q = job / chunks, t0 = (job - q * chunks) * kTableTokens;
    if (t0 >= sent[q]) continue;  // the same for the whole block
    const int tn = sent[q] - t0 < kTableTokens ? sent[q] - t0 : kTableTokens;
    for (int j = threadIdx.x; j < kTableTokens * r; j += blockDim.x) tab[j] = -1;
    __syncthreads();
    const bool remote = IsRemote(a, q);
    if (ok[q]) {
      for (int e = threadIdx.x; e < l; e += blockDim.x) {
        const int f = e * n + q, count = start[f + 1] - start[f];
        const int32_t* lst = remote ? reinterpret_cast<const int32_t*>(RecvRegion(fab, a, epoch, q) + FabricHeaderBytes(s)) + loff[f]
                                    : list + (static_cast<size_t>(q) * l + e) * s.max_tokens;
        int lo, hi;
        LowerBounds(lst, count, t0 * r, (t0 + tn) * r, lo, hi);
        for (int i = lo; i < hi; ++i) {
          const int tk = __ldcg(lst + i);
          const int t = tk / r - t0, k = tk - (tk / r) * r;
          if (tk >= 0 && t >= 0 && t < tn) tab[t * r + k] = start[f] + i;
        }
      }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < tn * r; j += blockDim.x) {
      const int row = tab[j], t = t0 + j / r, k = j - (j / r) * r;
      float wt = 0.f;
      if (row >= 0 && w && q == a.rank) {
        wt = t < x_tokens ? w[static_cast<size_t>(t) * r + k] : 0.f;
      } else if (row >= 0 && w) {  // the record was written this round: the token has a row here
        const uint8_t* rec = remote ? RecvRegion(fab, a, epoch, q) + FabricRecordsOffset(s) + static_cast<size_t>(t) * FabricRecordBytes(s)
                                    : toks + (static_cast<size_t>(q) * s.max_tokens + t) * RecordBytes(s);
        wt = __ldcg(reinterpret_cast<const float*>(rec + s.x_bytes() + s.scale_bytes()) + k);
      }
      const size_t at = (static_cast<size_t>(q) * s.max_tokens + t0) * r + j;
      rows[at] = row;
      weights[at] = wt;
    }
    __syncthreads();
  }
}

// dispatch_recv. Every block waits for the senders, then lays out the contract order in shared memory: block
// f = e * n + s (local expert e, sender s) starts at start[f]. One warp per expert_x row: rows below the total are
// copied from the sender's token (row and scales in one batch of loads). The padding rows after them are left as they are (kPadLeave: the contract leaves
// them unspecified, and writing them was half of this kernel's HBM traffic at decode), zeroed (kPadZero:
// MoEConfig.zero_padding) or filled with NaN (kPadPoison, tests). Rows below the total whose entry is bad are zeroed.
// Counts and list entries come from peers: anything out of range is dropped, never followed, and reported
// (kBadPeerData).
__device__ void DispatchRecvBody(const KernelArgs& a, const DispatchRecvIo& io, Part part) {
  const int padding = io.padding, x_tokens = io.x_tokens;
  const uint8_t* x = static_cast<const uint8_t*>(io.x);
  const uint8_t* xs = static_cast<const uint8_t*>(io.x_scale);
  const float* w = io.topk_weights;
  uint8_t* ox = static_cast<uint8_t*>(io.expert_x);
  uint8_t* os = static_cast<uint8_t*>(io.expert_x_scale);
  int32_t* ocounts = io.counts;
  int32_t* route = io.route;
  extern __shared__ int smem[];
  const MoeShape& s = a.s;
  const int n = s.num_ranks, l = s.local_experts, blocks = s.num_experts;
  int* start = smem;                // [blocks + 1]: exclusive prefix of the rows of block f, in (e, s) order
  int* ok = start + blocks + 1;     // [n] sender signalled in time
  int* warp_sums = ok + n;          // [32]
  int* loff = warp_sums + 32;       // [blocks]: remote senders only: where block f's entries start in q's list
  int* frows = loff + blocks;       // [n]: remote senders only: token records in q's region
  int* sent = frows + n;            // [n]: tokens each sender dispatched (checked); a remote one: its region's slots
  int* tab = sent + n;              // [kTableTokens * R]: the rows of one route-table job's entries
  __shared__ int fab_ok;
  const unsigned long long epoch = Local(a)->epoch[kDispatchRecv] + 1;
  const uint8_t* area = a.base + RoundSlot(epoch) * a.lay.dispatch_slot;  // this round's slot of the dispatch fields
  const FabricArgs& fab = a.fab[0];
  TracePart0(a, part, kDispatchRecv, epoch, kTraceStart);
  CheckTicket(a, io.ticket, epoch, 0, part);

  if (threadIdx.x < n && !IsRemote(a, threadIdx.x))
    ok[threadIdx.x] = WaitAtLeast(a, Flags(a.base, a, kDispatchFlag) + threadIdx.x, epoch,
                                  kDispatchFlag * kWaitStride + threadIdx.x);
  if (threadIdx.x == 0)
    fab_ok = a.num_remote == 0 ||
             WaitFabric(a, fab, proxy::kArrived, epoch, kDispatchFlag * kWaitStride + FirstRemote(a), 0, part);
  __syncthreads();
  if (threadIdx.x < n && IsRemote(a, threadIdx.x)) {  // the proxy says the region is here: check its header
    const int q = threadIdx.x;
    const proxy::RegionHeader h = LoadHeader(RecvRegion(fab, a, epoch, q));
    ok[q] = fab_ok && HeaderOk(h, fab, epoch, q, s.max_tokens);
    if (fab_ok && !ok[q]) RaiseError(a, kBadPeerData, q);
    frows[q] = ok[q] ? h.rows : 0;
  }
  if (threadIdx.x < n) {
    const int q = threadIdx.x;
    int v = IsRemote(a, q) ? frows[q] : 0;  // a remote sender: the slots of its region (its header, checked)
    if (ok[q] && !IsRemote(a, q)) {
      v = __ldcg(reinterpret_cast<const int32_t*>(area + a.lay.sent) + q);
      if (v < 0 || v > s.max_tokens || (q == a.rank && v != x_tokens)) {
        RaiseError(a, kBadPeerData, q);
        v = 0;
      }
    }
    sent[q] = v;
  }
  __syncthreads();
  TracePart0(a, part, kDispatchRecv, epoch, kTraceWaited);
  const int32_t* counts = reinterpret_cast<const int32_t*>(area + a.lay.counts);
  for (int f = threadIdx.x; f < blocks; f += blockDim.x) {
    const int e = f / n, q = f - e * n;
    int v = 0;
    if (ok[q]) {
      v = IsRemote(a, q) ? proxy::HeaderCounts(reinterpret_cast<const proxy::RegionHeader*>(RecvRegion(fab, a, epoch, q)))[e]
                         : __ldcg(counts + q * l + e);
    }
    const bool bad = v < 0 || v > s.max_tokens;
    if (bad) RaiseError(a, kBadPeerData, q);
    start[f + 1] = bad ? 0 : v;
  }
  if (threadIdx.x == 0) start[0] = 0;
  __syncthreads();
  // A remote sender's list holds its entries expert after expert: block (e, q) starts after q's earlier experts.
  if (threadIdx.x < n && IsRemote(a, threadIdx.x)) {
    long long at = 0;  // counts are <= max_tokens each: the sum is checked against C below, int64 until then
    for (int e = 0; e < l; ++e) {
      loff[e * n + threadIdx.x] = at > s.rows_per_peer() ? static_cast<int>(s.rows_per_peer()) : static_cast<int>(at);
      at += start[e * n + threadIdx.x + 1];
    }
  }
  // A sender whose counts add up to more than it may send is ignored (never read or write out of bounds).
  if (threadIdx.x < n) {
    long long sum = 0;
    for (int e = 0; e < l; ++e) sum += start[e * n + threadIdx.x + 1];
    if (sum > s.rows_per_peer()) {
      RaiseError(a, kBadPeerData, threadIdx.x);
      for (int e = 0; e < l; ++e) start[e * n + threadIdx.x + 1] = 0;
    }
  }
  __syncthreads();
  BlockInclusiveScan(start + 1, blocks, warp_sums);
  const int total = start[blocks];
  if (part.id == 0) {
    for (int e = threadIdx.x; e < l; e += blockDim.x) ocounts[e] = start[(e + 1) * n] - start[e * n];
    if (threadIdx.x == 0) route[s.max_recv_rows()] = total;
    for (int f = threadIdx.x; f <= blocks; f += blockDim.x) route[s.max_recv_rows() + 1 + f] = start[f];
    if (threadIdx.x < n) route[RouteSentOffset(s) + threadIdx.x] = sent[threadIdx.x];
  }
  const int lane = threadIdx.x & 31;
  const int32_t* list = reinterpret_cast<const int32_t*>(area + a.lay.list);
  const uint8_t* toks = area + a.lay.tokens;
  FillRouteTable(a, part, start, ok, sent, list, toks, w, x_tokens, tab, route, fab, epoch, loff);
  const long long entries = s.entries(), rows = padding == kPadLeave ? total : s.max_recv_rows();
  // Warp w takes rows w, w + W, w + 2W, ... (W warps in the grid), 32 at a time: lane j first finds the source of
  // the j-th (one list load each, all in flight together), then the warp copies or zeroes the 32 rows in turn.
  const long long warps = static_cast<long long>(part.count) * kWarps;
  for (long long base = part.id * kWarps + (threadIdx.x >> 5); base < rows; base += 32 * warps) {
    const long long mine = base + lane * warps;
    int32_t my_tk = -1;
    int my_q = 0;
    if (mine < total) {
      int lo = 0, hi = blocks - 1;
      while (lo < hi) {  // the block holding row `mine`: last f with start[f] <= mine
        const int mid = (lo + hi + 1) >> 1;
        if (start[mid] <= mine) lo = mid; else hi = mid - 1;
      }
      const int e = lo / n;
      my_q = lo - e * n;
      // A list is in token (or slot) order, as its sender scans them, which the route table's searches rely on: an
      // entry not above the one before it is bad data, reported below rather than missed by the table.
      const int32_t* lst =
          IsRemote(a, my_q)
              ? reinterpret_cast<const int32_t*>(RecvRegion(fab, a, epoch, my_q) + FabricHeaderBytes(s)) + loff[lo]
              : list + (static_cast<size_t>(my_q) * l + e) * s.max_tokens;
      lst += mine - start[lo];
      my_tk = __ldcg(lst);
      if (mine > start[lo] && __ldcg(lst - 1) >= my_tk) my_tk = -1;
      // Own tokens are read from dispatch_send's x: one past its rows cannot come from our own send; a token (a
      // remote sender's slot) is below the tokens (slots) its sender said it sent: the route table covers only those.
      if (my_tk < 0 || my_tk >= entries || my_tk / s.experts_per_token >= sent[my_q]) {
        RaiseError(a, kBadPeerData, my_q);
        my_tk = -1;
      }
    }
    for (int j = 0; j < 32; ++j) {
      const long long i = base + j * warps;
      if (i >= rows) break;  // the same for the whole warp
      const int32_t tk = __shfl_sync(0xffffffffu, my_tk, j);
      const int q = __shfl_sync(0xffffffffu, my_q, j);
      if (tk < 0) {
        const int fill = i >= total && padding == kPadPoison ? -1 : 0;  // all ones: NaN in bf16, fp8 e4m3 and f32
        WarpFill16(ox + i * s.x_bytes(), s.x_bytes(), fill, lane);
        if (os)
          for (int v = lane; v < (s.scale_bytes() >> 2); v += 32) reinterpret_cast<int*>(os + i * s.scale_bytes())[v] = fill;
        if (lane == 0 && i < total) route[i] = -1;
        continue;
      }
      const int t = tk / s.experts_per_token;
      // Own tokens were not copied: straight from dispatch_send's input.
      const uint8_t* src =
          q == a.rank      ? x + static_cast<size_t>(t) * s.x_bytes()
          : IsRemote(a, q) ? RecvRegion(fab, a, epoch, q) + FabricRecordsOffset(s) + static_cast<size_t>(t) * FabricRecordBytes(s)
                           : toks + (static_cast<size_t>(q) * s.max_tokens + t) * RecordBytes(s);
      // The scales' loads go first and their stores last, so that they wait out one latency with the row's.
      const uint8_t* src_scale = !os ? nullptr : q == a.rank ? xs + static_cast<size_t>(t) * s.scale_bytes() : src + s.x_bytes();
      CopyRecord(ox + i * s.x_bytes(), src, s.x_bytes(), os ? os + i * s.scale_bytes() : nullptr, src_scale,
                 s.scale_bytes(), lane);
      if (lane == 0) route[i] = static_cast<int32_t>(q * entries + tk);
    }
  }
  FinishPart(a, part, kDispatchRecv, [&](LocalSync* ls) {
    ls->epoch[kDispatchRecv] = epoch;
    RaiseNodeFlags(a, kDispatchAck, epoch);
    if (a.num_remote) StoreReleaseSys(fab.bell + proxy::kRead, epoch);  // the proxy gives the senders credit
  });
}

// dispatch_send's one kernel: with ranks on other nodes its block 0 polls the lane's kSent word (DispatchPollBody)
// for the next `packs` blocks, which fill their regions and ring the proxy's bell (fabric_pack.cuh), and the rest copy
// over NVLink, so none waits for another's launch. The pack blocks wait for block 0, which the hardware dispatches
// first (in practice, not by CUDA's guarantee; were it not resident, their own bounded wait would time out).
__global__ void __launch_bounds__(kThreads, 2)  // two an SM: the pack blocks take one, the NVLink blocks the other
    DispatchSendKernel(KernelArgs a, DispatchSendIo io, int packs, int per_rank, int fold, int lists) {
  extern __shared__ uint32_t own[];  // the pack blocks' index, where they fold it (FoldBytes)
  const int fabric = FabricBlocks(packs);
  const int sends = static_cast<int>(gridDim.x) - fabric;
  const int block = static_cast<int>(blockIdx.x);
  if (block >= fabric) {
    DispatchSendBody(a, io, Part{block - fabric, sends}, fabric, lists != 0);
    return;
  }
  const unsigned long long epoch = Local(a)->epoch[kDispatchSend] + 1;
  if (block == 0) {
    DispatchPollBody(a, epoch);
    DispatchSendArrive(a, io, Part{sends, sends + fabric}, epoch);
    return;
  }
  DispatchPackBody(a, io, per_rank, fold != 0, block - 1, packs, epoch, own);
  DispatchSendArrive(a, io, Part{sends + block, sends + fabric}, epoch, /*fenced=*/true);
}

__global__ void __launch_bounds__(kThreads, 2) DispatchRecvKernel(KernelArgs a, DispatchRecvIo io) {
  DispatchRecvBody(a, io, BlockPart());
}

// The one-shot dispatch where every rank is on this node: the send's parts, then the receive's, from the dispatch
// queue (queue.cuh). The send's last part raises this rank's flags (its own included) as the send kernel's would, and
// the receive's parts wait for them.
__global__ void __launch_bounds__(kThreads, 2)
    DispatchKernel(KernelArgs a, DispatchSendIo send, DispatchRecvIo recv, int sends, int recvs) {
  RunQueued(
      a, 0, sends, recvs, [&](Part p) { DispatchSendBody(a, send, p); }, [&](Part p) { DispatchRecvBody(a, recv, p); });
}

size_t DispatchRecvSmem(const MoeShape& s) {
  return sizeof(int) * (s.num_experts + 1 + s.num_ranks + 32 + s.num_experts + 2 * s.num_ranks +
                        kTableTokens * s.experts_per_token);
}

int TableJobs(const MoeShape& s) { return s.num_ranks * ((s.max_tokens + kTableTokens - 1) / kTableTokens); }

LaunchShape SendShape(const KernelArgs& a, int tokens) {
  // Enough blocks for one per expert scan and for every (token, rank) copy to have its warp, up to 2 per SM.
  int grid = GridFor(static_cast<long long>(tokens) * a.s.num_ranks * ChunksOf(a.s.x_bytes()), kWarps, a.num_sms);
  if (grid < a.s.num_experts) grid = a.s.num_experts < 2 * a.num_sms ? a.s.num_experts : 2 * a.num_sms;
  return {grid, kThreads};
}

LaunchShape RecvShape(const KernelArgs& a) {
  // A warp per expert_x row, and after them a block per route-table job (they start from the grid's end).
  const long long row_blocks = (a.s.max_recv_rows() + kWarps - 1) / kWarps;
  return {GridFor((row_blocks + TableJobs(a.s)) * kWarps, kWarps, a.num_sms), kThreads};
}

// The one kernel of a one-shot dispatch: its blocks (0: two kernels) and how its parts split, computed once a launch.
OnePlan DispatchPlan(const KernelArgs& a, int tokens) {
  // At prefill the lists from the node's index (list_index.cu) need its launches first: two kernels then.
  if (a.num_remote > 0 || !OneKernelAllowed() || ListsIndexed(a, tokens)) return {};
  const int sends = SendShape(a, tokens).blocks, recvs = RecvShape(a).blocks;
  return {OneKernelBlocks(reinterpret_cast<const void*>(DispatchKernel), kThreads, DispatchRecvSmem(a.s), a.num_sms,
                          sends + recvs),
          sends, recvs};
}

}  // namespace

LaunchShape DispatchSendShape(const KernelArgs& a, int tokens) {
  return {FabricBlocks(DispatchPackPlan(a, tokens).blocks) + SendShape(a, tokens).blocks, kThreads};
}
LaunchShape DispatchRecvShape(const KernelArgs& a) { return RecvShape(a); }
size_t PackStaticBytes() {
  cudaFuncAttributes attr{};
  return cudaFuncGetAttributes(&attr, DispatchSendKernel) == cudaSuccess ? attr.sharedSizeBytes : 1024;
}
LaunchShape DispatchShape(const KernelArgs& a, int tokens) { return {DispatchPlan(a, tokens).blocks, kThreads}; }

cudaError_t LaunchDispatchSend(const KernelArgs& a, const DispatchSendIo& io, cudaStream_t stream) {
  const PackPlan pack = DispatchPackPlan(a, io.tokens);
  if (cudaError_t err = LaunchListIndex(a, io.tokens, io.topk_idx, stream); err != cudaSuccess) return err;
  if (cudaError_t err = AllowSmem(DispatchSendKernel, pack.smem); err != cudaSuccess) return err;
  const int grid = FabricBlocks(pack.blocks) + SendShape(a, io.tokens).blocks;
  DispatchSendKernel<<<grid, kThreads, pack.smem, stream>>>(a, io, pack.blocks, pack.per_rank, pack.fold,
                                                            ListsIndexed(a, io.tokens) ? 1 : 0);
  return cudaGetLastError();
}

cudaError_t LaunchDispatchRecv(const KernelArgs& a, const DispatchRecvIo& io, cudaStream_t stream) {
  const size_t smem = DispatchRecvSmem(a.s);
  if (cudaError_t err = AllowSmem(DispatchRecvKernel, smem); err != cudaSuccess) return err;
  DispatchRecvKernel<<<DispatchRecvShape(a).blocks, kThreads, smem, stream>>>(a, io);
  return cudaGetLastError();
}

cudaError_t LaunchDispatch(const KernelArgs& a, const DispatchSendIo& send, const DispatchRecvIo& recv,
                           cudaStream_t stream, bool* send_launched) {
  *send_launched = false;
  if (const OnePlan plan = DispatchPlan(a, send.tokens); plan.blocks > 0) {
    const size_t smem = DispatchRecvSmem(a.s);
    if (cudaError_t err = AllowSmem(DispatchKernel, smem); err != cudaSuccess) return err;
    DispatchKernel<<<plan.blocks, kThreads, smem, stream>>>(a, send, recv, plan.send_parts, plan.recv_parts);
    return cudaGetLastError();
  }
  if (cudaError_t err = LaunchDispatchSend(a, send, stream); err != cudaSuccess) return err;
  *send_launched = true;
  return LaunchDispatchRecv(a, recv, stream);
}

}  // namespace jax_moe::cuda
