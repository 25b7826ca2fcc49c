// Shapes, buffer layout and kernel arguments of the CUDA dispatch/combine (shared by host code and kernels).
//
// One device buffer per (Communicator, device), identical layout on every rank, so a peer's address of any field is
// peer_base + the same offset. Receiver-owned areas are written by the senders over NVLink (peer pointers).
#pragma once
#include <cstddef>
#include <cstdint>

#include "proxy/bell.h"
#include "proxy/moe_shape.h"
#include "proxy/region_header.h"

namespace jax_moe::cuda {

// Epoch counters and "last block" counters, one per half. Combine has two channels (areas, flags, epochs): the
// forward combine and the one inside dispatch's gradient, which XLA may schedule in either order relative to each
// other (nothing orders the forward combine_recv, whose output only feeds the loss, before the backward pass).
enum Half { kDispatchSend = 0, kDispatchRecv = 1, kCombineSend = 2, kCombineRecv = 3 };  // + 2 * channel for combine
constexpr int kCombineChannels = 2;
constexpr int kHalves = 4 + 2 * (kCombineChannels - 1);
constexpr int kFlagKinds = 2 + 2 * kCombineChannels;
// Rows of the flag area (combine: + 2 * channel). Peer s writes column s: its epoch when it sent us data (flag) or
// when it finished reading what we sent it (ack).
enum FlagKind { kDispatchFlag = 0, kDispatchAck = 1, kCombineFlag = 2, kCombineAck = 3 };
// A timeout's error detail: which flag (FlagKind) * kWaitStride + the rank that did not write it; or kIndexWait *
// kWaitStride + p: dispatch_send's pack blocks deriving p's index waited for one another (DeriveIndex).
constexpr int kWaitStride = 1024;
constexpr int kIndexWait = kFlagKinds;

// Error codes in the host-mapped error word (reported by the next recv half's handler).
// kBadPeerData: a peer's counts or token lists did not fit this buffer (detail = that rank); its data was dropped.
// kProxyFailed: the host proxy serving this device's remote ranks stopped (detail = stream); its error says why.
// kOutOfOrder: a receive half was given the handle of another round than the one it was due to receive (detail =
// stream): a handle dropped, or rounds received out of send order across programs. The rounds are out of step.
enum ErrorKind { kNoError = 0, kBadExpertId = 1, kTimeout = 2, kBadPeerData = 3, kProxyFailed = 4, kOutOfOrder = 5 };
// An error is ErrorKind << 32 | uint32 detail. The published error word adds its number (1..kErrorSeqMax, wrapping)
// above bit kErrorSeqShift; the host acknowledges a number by writing it into the ack word (see KernelArgs).
constexpr int kErrorSeqShift = 40;
constexpr unsigned long long kErrorSeqMax = (1ull << (64 - kErrorSeqShift)) - 1;
constexpr unsigned long long kErrorBody = (1ull << kErrorSeqShift) - 1;

// Device-side trace (JAX_MOE_CUDA_TRACE=1, for the benchmark): per half and epoch (ring of kTraceRing), the
// %globaltimer at part 0's start, when part 0's waits on peers were over, when part 0's work was done, and when
// the last part finished (just before it signals the peers); part 0 is block 0, but for the send halves with ranks on
// other nodes, whose block 0 polls the host for the others (dispatch_send: the first NVLink block; combine_send: block
// 1). Those halves add the phases of their fabric work: dispatch_send's pack block 0 its index ready (folded alone, or
// derived with the rank's other pack blocks), the lane free (the proxy's kSent seen), its tokens written, then the
// last pack block's bell; combine_send's part 0 the lane free and its sums' tables ready (the self entries written),
// then the last part's bell. Zero where a half has none.
constexpr int kTraceRing = 64;
constexpr int kTracePoints = 8;
enum TracePoint {
  kTraceStart = 0,
  kTraceWaited = 1,
  kTraceWork = 2,
  kTraceEnd = 3,
  kTraceIndexed = 4,
  kTraceFree = 5,
  kTraceWritten = 6,
  kTraceBell = 7,
};

using proxy::MoeShape;
using proxy::AlignUp;

// Rounds of one direction (and combine channel) that may be in flight at once: sent, not yet received. The areas a
// sender writes into (dispatch: counts, sent, list, tokens; combine: comb, self) exist once per slot, and round e uses
// slot e % kRoundSlots, so a sender may write round e + 1 while its receivers still read round e; before writing
// round e it waits for their acknowledgement of round e - kRoundSlots, the last one in that slot. Two: a second
// micro-batch's dispatch can travel while the first's experts run, at twice one round's area memory.
constexpr int kRoundSlots = 2;
JAX_MOE_HD inline int RoundSlot(unsigned long long epoch) { return static_cast<int>(epoch % kRoundSlots); }
// The last round before `epoch` in its slot (0: none yet; epochs are unsigned, so never `epoch - kRoundSlots` as is).
JAX_MOE_HD inline unsigned long long SlotPredecessor(unsigned long long epoch) {
  return epoch > kRoundSlots ? epoch - kRoundSlots : 0;
}

// The remote ranks' index (MoeLayout::fmask ...) takes tokens in chunks of one warp's lanes, a bit each.
constexpr int kIndexChunk = 32;
JAX_MOE_HD inline int IndexChunks(const MoeShape& s) { return (s.max_tokens + kIndexChunk - 1) / kIndexChunk; }
constexpr int kFabricStreams = 1 + kCombineChannels;  // rounds of remote ranks: dispatch, combine channel 0, 1

// Byte offsets of the fields inside one device buffer.
// Dispatch moves each token once per destination rank (not once per (t, k)): sender s writes token t into
// tokens[s][t] of every rank that holds one of its experts, and for each local expert e of that rank the list of
// its tokens in token order, as t * R + k, into list[s][e]. The receiver expands tokens into expert_x rows.
struct MoeLayout {
  size_t flags = 0;   // uint64 [kFlagKinds][n]: dispatch flag, dispatch ack, then per combine channel flag and ack;
                      // peer s writes column [.][s]
  size_t local = 0;   // LocalSync (this device only)
  size_t peers = 0;   // uint8_t* [n]: every peer's buffer base, as this device addresses it
  size_t trace = 0;   // uint64 [kTraceRing][kHalves][kTracePoints] (this device only)
  // One slot's dispatch fields (counts, sent, list, tokens), then the others' at + slot * dispatch_slot.
  size_t counts = 0;  // int32 [n][l]: tokens per local expert from sender s
  size_t sent = 0;    // int32 [n]: tokens sender s dispatched this round (bounds the route table's work)
  size_t list = 0;    // int32 [n][l][max_tokens]: t * R + k on sender s of the i-th token for local expert e
  size_t tokens = 0;  // [n][max_tokens] records of RecordBytes: token t of sender s, its scales, then its R router
                      // weights when dispatch_send was given them (only the tokens sent are written)
  size_t dispatch_slot = 0;  // bytes of one slot's dispatch fields
  // One slot's combine fields (comb, self), then the others' at + slot * combine_slot.
  size_t comb = 0;    // [channels][max_tokens * R] rows of y_bytes: expert outputs returned to this token owner
  size_t self = 0;    // int32 [channels][max_tokens * R]: for entries served by this rank, their expert_y row (this
                      // rank's own rows are not copied: combine_recv reads them from expert_y)
  size_t combine_slot = 0;  // bytes of one slot's combine fields
  // The remote ranks' index, per fabric stream f (0: dispatch_send, 1 + c: combine_recv of channel c), derived from
  // topk_idx once per call (combine: IndexKernel, kernels/fabric.cu; dispatch: its pack blocks, fabric_pack.cuh).
  // At prefill stream 0's slots of this node's ranks hold their index for dispatch_send's expert lists
  // (list_index.cu: masks, bits, bases, and off[e] the count of expert e).
  // Tokens go in chunks of kIndexChunk (C = IndexChunks):
  size_t fmask = 0;   // uint32 [streams][n][C]: bit j of chunk c: token 32c + j has an entry on rank p
  size_t fsbase = 0;  // int32 [streams][n][C]: tokens with an entry on p in the chunks before c (p's slots)
  size_t fbits = 0;   // uint32 [streams][n][C][l]: bit j: token 32c + j has an entry with p's local expert e
  size_t fbase = 0;   // int32 [streams][n][C][l]: entries with p's expert e in the chunks before c
  size_t foff = 0;    // int32 [streams][n][l + 2]: where expert e's entries start among p's; [l]: p's entries,
                      // [l + 1]: p's slots
  size_t fdone = 0;   // uint32 [streams][n]: blocks of the running IndexKernel launch done with p's chunks (the last
                      // one adds them up, then re-arms it)
  size_t fsync = 0;   // uint64 [n][4]: dispatch_send's pack blocks deriving p's index (DeriveIndex): blocks done
                      // marking, the call whose marks are all there, blocks done adding up, the call whose index is
                      // ready
  size_t total = 0;
};

struct LocalSync {
  unsigned long long epoch[kHalves];  // completed calls of each half
  unsigned int done[kHalves];         // blocks finished in the running launch of each half
  int timed_out;                      // a wait timed out: later waits give up at once (device copy of the error)
  unsigned int error_seq;             // number of the last error published to the host (0: none yet)
  unsigned long long error;           // the running launch's first error (kind << 32 | detail), published at its end
  unsigned int pack_done;             // pack blocks finished in the running dispatch_send launch (remote ranks)
  // Per fabric stream, the pump's kSent / kArrived words as block 0 last saw them in host memory: the other blocks
  // wait on this copy, so that one thread per launch polls over PCIe, not one per block (see WaitFabric).
  unsigned long long fab_seen[1 + kCombineChannels][2];
  // The one-shot kernels' part queues, per stream (dispatch, combine channel c at 1 + c): the next part to take, and
  // the blocks done taking (the last one out re-arms both for the next launch). See queue.cuh.
  unsigned int queue[1 + kCombineChannels];
  unsigned int queue_left[1 + kCombineChannels];
};

// An NVLink token record: the row, its fp8 scales, then the token's R router weights (float32), 16-byte aligned. The
// weights let combine_send weight and sum a token's rows at the expert rank (CombineMode::kWeighted).
JAX_MOE_HD inline int RecordBytes(const MoeShape& s) {
  return int(AlignUp(uint64_t(s.x_bytes()) + s.scale_bytes() + 4ull * s.experts_per_token, 16));
}

// How combine_send returns rows. kPerEntry: one row per (t, k), weighted by combine_recv. kWeighted: per token owner
// s and token t, the rows this rank holds are weighted (the weights dispatch_send carried) and summed in float32, and
// one bf16 row goes back, into the entry of the token's first k on this rank; kUnit: the same with unit weights (the
// transpose of dispatch). Ranks on other nodes get the same sums, one row per token in the slot order of dispatch's
// region (see "ranks on other nodes").
enum CombineMode { kPerEntry = 0, kWeighted = 1, kUnit = 2 };

// What dispatch_recv writes into expert_x's padding rows (at or after the rows received): nothing (the contract leaves
// them unspecified), zeros (MoEConfig.zero_padding), or NaN (JAX_MOE_POISON_PADDING=1: tests prove nothing reads them).
enum Padding { kPadLeave = 0, kPadZero = 1, kPadPoison = 2 };

inline MoeLayout MakeLayout(const MoeShape& s) {
  MoeLayout m;
  size_t at = 0;
  auto take = [&](size_t bytes) { size_t here = at; at = AlignUp(at + bytes, 256); return here; };
  m.flags = take(sizeof(unsigned long long) * kFlagKinds * s.num_ranks);
  m.local = take(sizeof(LocalSync));
  m.peers = take(sizeof(void*) * s.num_ranks);
  m.trace = take(sizeof(unsigned long long) * kTraceRing * kHalves * kTracePoints);
  const size_t dispatch_at = at;
  m.counts = take(sizeof(int32_t) * s.num_ranks * s.local_experts);
  m.sent = take(sizeof(int32_t) * s.num_ranks);
  m.list = take(sizeof(int32_t) * size_t(s.num_ranks) * s.local_experts * s.max_tokens);
  m.tokens = take(size_t(RecordBytes(s)) * s.num_ranks * s.max_tokens);
  m.dispatch_slot = at - dispatch_at;
  at += m.dispatch_slot * (kRoundSlots - 1);
  const size_t combine_at = at;
  m.comb = take(size_t(s.combine_row_bytes()) * s.entries() * kCombineChannels);
  m.self = take(sizeof(int32_t) * s.entries() * kCombineChannels);
  m.combine_slot = at - combine_at;
  at += m.combine_slot * (kRoundSlots - 1);
  const size_t chunks = size_t(kFabricStreams) * s.num_ranks * IndexChunks(s);
  m.fmask = take(sizeof(uint32_t) * chunks);
  m.fsbase = take(sizeof(int32_t) * chunks);
  m.fbits = take(sizeof(uint32_t) * chunks * s.local_experts);
  m.fbase = take(sizeof(int32_t) * chunks * s.local_experts);
  m.foff = take(sizeof(int32_t) * kFabricStreams * s.num_ranks * (s.local_experts + 2));
  m.fdone = take(sizeof(uint32_t) * kFabricStreams * s.num_ranks);
  m.fsync = take(sizeof(unsigned long long) * 4 * s.num_ranks);
  m.total = at;
  return m;
}

// route of dispatch_recv (int32): [M] rows' origins, [M] rows received, then [E + 1] the exclusive prefix of the rows
// per (local expert, sender) block, which combine_send needs to pack a remote rank's rows in its order; then [n] the
// tokens each sender on this node dispatched (for senders on other nodes: the slots of their region); then per (sender s, token t, k) the
// expert_x row of entry (t, k) of s ([n][max_tokens][R], -1 where none is here) and its router weight as float32 bits
// (0 where none), which the reduced combine modes sum by. Only the slots of tokens t < sent[s] are written each round:
// the table's work follows the tokens sent, not max_tokens. For a sender on another node, t is the token's slot in
// its region and sent[s] the slots it sent.
JAX_MOE_HD inline int64_t RouteSentOffset(const MoeShape& s) { return s.max_recv_rows() + 2 + s.num_experts; }
JAX_MOE_HD inline int64_t RouteTableOffset(const MoeShape& s) { return RouteSentOffset(s) + s.num_ranks; }
JAX_MOE_HD inline int64_t RouteTableLength(const MoeShape& s) { return int64_t(s.num_ranks) * s.entries(); }
JAX_MOE_HD inline int64_t RouteWeightsOffset(const MoeShape& s) { return RouteTableOffset(s) + RouteTableLength(s); }
JAX_MOE_HD inline int64_t RouteLength(const MoeShape& s) { return RouteWeightsOffset(s) + RouteTableLength(s); }

// --- ranks on other nodes: regions the host proxy moves (src/proxy/pump.h) ------------------------------------------
// Per round stream (dispatch, combine channel 0, 1) a device owns a send area and a receive area in pinned host
// memory mapped into the GPU, [kFabricLanes][num_remote] regions, one per rank on another node in rank order
// (proxy::Lanes, proxy::RegionSlots::OtherNodes: same-node ranks go over NVLink and get none), and the pump's bell and
// byte words. A region starts with a proxy::RegionHeader (dispatch: + the per-local-expert counts), then
//   dispatch: int32 list[C] (entries in (local expert, token) order, each slot * R + k), then the token records, slot
//             after slot (each token once per destination rank, in token order; records as over NVLink, RecordBytes:
//             the row, its scales, its R router weights, so that the expert rank can weight and sum);
//   combine:  kPerEntry: the rows returned to the token owner in the order it sent them (local expert, then token);
//             kWeighted, kUnit: one row per slot, the token's rows held by the expert rank weighted and summed there
//             (as NVLink peers return them), so a token costs one row per remote rank, not one per (t, k).
// Both ends compute every offset alike; the counts and the header's rows say how much is valid.
constexpr int kFabricLanes = kRoundSlots;  // rounds per stream in flight, as on NVLink

JAX_MOE_HD inline uint64_t FabricHeaderBytes(const MoeShape& s) { return proxy::RegionHeaderBytes(s); }
JAX_MOE_HD inline uint64_t FabricRecordsOffset(const MoeShape& s) {
  return FabricHeaderBytes(s) + AlignUp(4 * uint64_t(s.rows_per_peer()), 64);
}
JAX_MOE_HD inline int FabricRecordBytes(const MoeShape& s) { return RecordBytes(s); }
// The bytes a region holds with `slots` token records (dispatch) or `rows` rows (combine): the sender posts them, the
// receiver's proxy checks an arrival against them (DeviceFabric::ArrivedBytes); one formula for both ends.
JAX_MOE_HD inline uint64_t FabricDispatchBytes(const MoeShape& s, int64_t slots) {
  return FabricRecordsOffset(s) + uint64_t(slots) * FabricRecordBytes(s);
}
JAX_MOE_HD inline uint64_t FabricCombineBytes(const MoeShape& s, int64_t rows) {
  return FabricHeaderBytes(s) + uint64_t(rows) * s.combine_row_bytes();
}
JAX_MOE_HD inline uint64_t FabricDispatchRegion(const MoeShape& s) { return AlignUp(FabricDispatchBytes(s, s.max_tokens), 64); }
// The rows a combine region of `channel` holds: rows_per_peer on channel 0 (kPerEntry returns a row per (t, k));
// max_tokens on channel 1, which carries dispatch's transpose, always summed (kUnit: a row per slot), and refuses
// kPerEntry where ranks are on other nodes (ffi/cuda/handlers.cc): its areas shrink by min(R, L).
JAX_MOE_HD inline int64_t FabricCombineRows(const MoeShape& s, int channel) {
  return channel == 1 ? int64_t(s.max_tokens) : s.rows_per_peer();
}
JAX_MOE_HD inline uint64_t FabricCombineRegion(const MoeShape& s, int channel) {
  return AlignUp(FabricCombineBytes(s, FabricCombineRows(s, channel)), 64);
}

// A sent count (tokens a sender dispatched: a route's `sent`, a header's rows) clamped to [0, max_tokens]: routes
// not from dispatch_recv and headers from a faulty peer may hold anything.
JAX_MOE_HD inline int64_t ClampTokens(const MoeShape& s, int64_t v) { return v < 0 ? 0 : (v > s.max_tokens ? s.max_tokens : v); }

struct FabricArgs {
  uint8_t* send = nullptr;               // our regions, rank p's at (lane * num_remote + RemoteSlot(p)) * region
  const uint8_t* recv = nullptr;         // the remote senders' regions, rank q's at the same place for q
  unsigned long long* bell = nullptr;    // proxy::BellWord words (the device writes kRung and kRead)
  unsigned long long* bytes = nullptr;   // [kFabricLanes][N]: bytes of our region for rank p
  unsigned long long region = 0;         // bytes of one region
  unsigned int comm_id = 0;              // the regions' header comm_id (the stream's immediate id)
};

// Ranks of one Communicator at most: one thread of a block waits on each peer's flag.
constexpr int kMaxRanks = 128;

// Everything a kernel needs about its device's group membership; passed by value.
struct KernelArgs {
  MoeShape s;
  int rank = 0;                     // this device's rank
  MoeLayout lay;
  uint8_t* base = nullptr;          // this device's buffer
  // Host-mapped words. Each has one writer, since host and device atomics on mapped memory are not atomic with each
  // other on PCIe hosts: `error` (device) holds the last published error with its number, `error_ack` (host) the
  // number of the last one the host reported. A launch publishes once, at its end, and only when the host has
  // acknowledged the previous one (first error wins), so one error is reported once.
  unsigned long long* error = nullptr;
  const unsigned long long* error_ack = nullptr;
  unsigned long long* timeout = nullptr;  // host-mapped: the first timeout (kind << 32 | detail). Only the device
                                          // writes it and nobody clears it, so a timeout is never lost.
  long long timeout_ns = 0;         // bound of every wait on a peer
  int num_sms = 1;
  int trace = 0;                    // record the device-side trace (see kTraceRing)
  unsigned int remote[kMaxRanks / 32] = {};  // bit p: rank p is on another node (reached through the host proxy)
  int num_remote = 0;
  FabricArgs fab[kFabricStreams];   // dispatch, combine channel 0, 1 (when num_remote > 0)
};

JAX_MOE_HD inline bool IsRemote(const KernelArgs& a, int p) { return (a.remote[p >> 5] >> (p & 31)) & 1u; }

}  // namespace jax_moe::cuda
