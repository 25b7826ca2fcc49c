// The four halves of CpuComm: what goes into a region, and what comes out of the received ones.
#include <algorithm>
#include <cstring>
#include <functional>
#include <string>

#include "cpu/bf16.h"
#include "cpu/rank_state.h"
#include "proxy/region_header.h"

namespace jax_moe::cpu {

using proxy::MoeShape;
using proxy::RegionHeader;

namespace {

void WriteHeader(uint8_t* region, const MoeShape& s, uint32_t comm_id, uint64_t round, int32_t sender, int32_t rows,
                 const int32_t* counts, int32_t error, int64_t error_value) {
  auto* h = reinterpret_cast<RegionHeader*>(region);
  h->magic = proxy::kRegionMagic;
  h->comm_id = comm_id;
  h->seq = round;
  h->sender = sender;
  h->error = error;
  h->error_value = error_value;
  h->rows = rows;
  h->pad = 0;
  if (counts) std::memcpy(proxy::HeaderCounts(h), counts, 4 * s.local_experts);
}

// Every sender's header of `round`, checked: nothing a peer sends can make us read or write outside a buffer.
std::vector<const RegionHeader*> CheckedHeaders(const CpuComm::Direction& d, const MoeShape& s, uint32_t comm_id,
                                                uint64_t round, const std::function<std::string(int64_t)>& name) {
  const int64_t n = s.num_ranks;
  std::vector<const RegionHeader*> headers(n);
  for (int64_t p = 0; p < n; ++p) {
    headers[p] = reinterpret_cast<const RegionHeader*>(d.inbox->Region(round, p));
    std::string problem = proxy::CheckHeader(*headers[p], s, comm_id, round, int32_t(p), d.has_counts);
    if (!problem.empty()) Throw(ErrorCode::kPeerFailed, std::string(d.name) + ": " + problem);
  }
  for (int64_t p = 0; p < n; ++p) {
    std::string failed = SenderFailure(d, s, comm_id, round, p, name);
    if (!failed.empty()) Throw(ErrorCode::kInvalidArgument, failed);
  }
  return headers;
}

// Rounds run in program order and jax_moe.rounds refuses programs that open more than K at once, so K open rounds
// at a send mean handles that were never received (kept across programs, or dropped): the send would need the
// credit of a lane nobody will ever read.
void CheckLaneFree(const CpuComm::Direction& d, const char* op, const std::function<std::string()>& who) {
  const int64_t lanes = d.channel->lanes().count;
  if (d.channel->send_round() - d.channel->received() < uint64_t(lanes)) return;
  Throw(ErrorCode::kMisuse, std::string(op) + " on " + who() + ": the " + std::to_string(lanes) +
                                " previous rounds of this direction were sent and never received (a handle must "
                                "reach its receive half exactly once); this Communicator cannot go on: build a new "
                                "one");
}

// A handle presented a second time (kept across programs and received again): its lane may hold another round
// by now, and a second credit would let a sender overwrite a lane nobody read.
[[noreturn]] void ReceivedTwice(const CpuComm::Direction& d, uint64_t round, const char* op, const std::string& who) {
  Throw(ErrorCode::kMisuse, std::string(op) + " on " + who + ": round " + std::to_string(round) + " of " + d.name +
                                " was received already (a handle must reach its receive half exactly once); this "
                                "Communicator cannot go on: build a new one");
}

void WriteTicket(int32_t* ticket, uint64_t round, uint32_t comm_id) {
  ticket[0] = int32_t(round & 0x7fffffff);
  ticket[1] = int32_t(comm_id);
}

}  // namespace

std::string SenderFailure(const CpuComm::Direction& d, const MoeShape& s, uint32_t comm_id, uint64_t round,
                          int64_t sender, const std::function<std::string(int64_t)>& name) {
  const auto* h = reinterpret_cast<const RegionHeader*>(d.inbox->Region(round, sender));
  if (!proxy::CheckHeader(*h, s, comm_id, round, int32_t(sender), d.has_counts).empty()) return "";
  if (h->error != int32_t(proxy::SenderError::kExpertOutOfRange)) return "";
  return std::string(d.name) + ": " + name(sender) + " was given expert id " + std::to_string(h->error_value) +
         " in topk_idx, outside [0, " + std::to_string(s.num_experts) + ") and not -1";
}

void CpuComm::DispatchSend(int64_t device, const uint8_t* x, const uint8_t* x_scale, const int32_t* topk_idx,
                           int64_t tokens, bool per_entry, int32_t* position, int32_t* ticket) {
  proxy_->Guard([&] {
    Rank& me = RankOf(device);
    const MoeShape& s = options_.shape;
    Require(tokens <= s.max_tokens, "dispatch_send: more tokens than max_tokens");
    proxy::ComputeSendPlan(topk_idx, tokens, s, &me.plan);
    Direction& d = me.dispatch;
    CheckLaneFree(d, "dispatch_send", [&] { return Name(me, me.info.rank); });
    const uint64_t round = d.channel->NextSendRound();
    const int64_t r = s.experts_per_token, c = s.rows_per_peer();
    const uint64_t xb = s.x_bytes(), sb = s.scale_bytes();
    const bool bad = me.plan.bad_index >= 0;
    d.channel->Send(round, me.plan.rows, [&](const std::vector<uint8_t*>& regions) {
      for (int64_t t = 0; t < tokens; ++t) {
        for (int64_t k = 0; k < r; ++k) {
          const int32_t sl = me.plan.position[t * r + k];
          if (sl < 0) continue;
          uint8_t* row = regions[sl / c] + d.header_bytes + uint64_t(sl % c) * d.row_bytes;
          std::memcpy(row, x + (per_entry ? t * r + k : t) * xb, xb);
          if (sb && !per_entry) std::memcpy(row + xb, x_scale + t * sb, sb);
        }
      }
      for (int64_t p = 0; p < s.num_ranks; ++p) {
        WriteHeader(regions[p], s, options_.comm_id, round, me.info.rank, me.plan.rows[p],
                    &me.plan.counts[p * s.local_experts],
                    int32_t(bad ? proxy::SenderError::kExpertOutOfRange : proxy::SenderError::kNone),
                    me.plan.bad_value);
      }
    });
    std::copy(me.plan.position.begin(), me.plan.position.end(), position);
    WriteTicket(ticket, round, options_.comm_id);
    if (bad) {
      // The region carrying the error must reach the other processes before ours may exit on it: they fail at
      // once with it instead of waiting for the timeout.
      if (me.port) {
        try {
          me.port->WaitSends(std::min(options_.timeout_s, 5.0));
        } catch (const Error&) {  // a peer that is gone as well: the error below is still ours to report
        }
      }
      const int64_t t = me.plan.bad_index / r, k = me.plan.bad_index % r;
      Throw(ErrorCode::kInvalidArgument, "dispatch_send on " + Name(me, me.info.rank) + ": expert id " +
                                             std::to_string(me.plan.bad_value) + " at token " + std::to_string(t) +
                                             ", k " + std::to_string(k) + " is outside [0, " +
                                             std::to_string(s.num_experts) + ") and not -1");
    }
  });
}

void CpuComm::DispatchRecv(int64_t device, const int32_t* ticket, uint8_t* expert_x, uint8_t* expert_x_scale,
                           int32_t* expert_counts, int32_t* dest) {
  proxy_->Guard([&] {
    Rank& me = RankOf(device);
    Direction& d = me.dispatch;
    const uint64_t round = TicketRound(d, ticket, "dispatch_recv");
    if (!d.channel->CountReceived(round)) ReceivedTwice(d, round, "dispatch_recv", Name(me, me.info.rank));
    Receive(me, d, round, [&] {
      const MoeShape& s = options_.shape;
      auto headers = CheckedHeaders(d, s, options_.comm_id, round, [&](int64_t p) { return Name(me, p); });
      const int64_t n = s.num_ranks, l = s.local_experts, c = s.rows_per_peer();
      std::vector<int32_t> counts(n * l);
      for (int64_t p = 0; p < n; ++p) std::memcpy(&counts[p * l], proxy::HeaderCounts(headers[p]), 4 * l);
      proxy::ComputeRecvLayout(counts, s, dest, expert_counts);
      const uint64_t xb = s.x_bytes(), sb = s.scale_bytes();
      int64_t total = 0;
      for (int64_t p = 0; p < n; ++p) {
        const uint8_t* base = reinterpret_cast<const uint8_t*>(headers[p]) + d.header_bytes;
        for (int32_t j = 0; j < headers[p]->rows; ++j) {
          const int64_t row = dest[p * c + j];
          std::memcpy(expert_x + row * xb, base + j * d.row_bytes, xb);
          if (sb) std::memcpy(expert_x_scale + row * sb, base + j * d.row_bytes + xb, sb);
        }
        total += headers[p]->rows;
      }
      const int64_t m = s.max_recv_rows();  // padding rows are zero, as in the reference
      std::memset(expert_x + total * xb, 0, (m - total) * xb);
      if (sb) std::memset(expert_x_scale + total * sb, 0, (m - total) * sb);
    });
  });
}

void CpuComm::CombineSend(int64_t device, const uint8_t* expert_y, const int32_t* dest, int32_t* ticket) {
  proxy_->Guard([&] {
    Rank& me = RankOf(device);
    const MoeShape& s = options_.shape;
    Direction& d = me.combine;
    CheckLaneFree(d, "combine_send", [&] { return Name(me, me.info.rank); });
    const uint64_t round = d.channel->NextSendRound();
    const int64_t n = s.num_ranks, c = s.rows_per_peer(), m = s.max_recv_rows();
    const uint64_t yb = uint64_t(s.hidden) * s.y_itemsize;
    std::vector<int32_t> rows(n, 0);
    for (int64_t p = 0; p < n; ++p) {
      const int32_t* dp = dest + p * c;
      int32_t j = 0;
      while (j < c && dp[j] >= 0) {
        Require(dp[j] < m, "combine_send: the dispatch route points outside expert_y");
        ++j;
      }
      rows[p] = j;
    }
    d.channel->Send(round, rows, [&](const std::vector<uint8_t*>& regions) {
      for (int64_t p = 0; p < n; ++p) {
        uint8_t* base = regions[p] + d.header_bytes;
        for (int32_t j = 0; j < rows[p]; ++j) {
          std::memcpy(base + j * d.row_bytes, expert_y + int64_t(dest[p * c + j]) * yb, yb);
        }
        WriteHeader(regions[p], s, options_.comm_id, round, me.info.rank, rows[p], nullptr, 0, 0);
      }
    });
    WriteTicket(ticket, round, options_.comm_id);
  });
}

void CpuComm::CombineRecv(int64_t device, const int32_t* ticket, const float* topk_weights, const int32_t* position,
                          int64_t tokens, bool reduce, uint8_t* out) {
  proxy_->Guard([&] {
    Rank& me = RankOf(device);
    Direction& d = me.combine;
    const uint64_t round = TicketRound(d, ticket, "combine_recv");
    if (!d.channel->CountReceived(round)) ReceivedTwice(d, round, "combine_recv", Name(me, me.info.rank));
    Receive(me, d, round, [&] {
      const MoeShape& s = options_.shape;
      auto headers = CheckedHeaders(d, s, options_.comm_id, round, [&](int64_t p) { return Name(me, p); });
      const int64_t n = s.num_ranks, r = s.experts_per_token, c = s.rows_per_peer(), h = s.hidden;
      auto* o = reinterpret_cast<uint16_t*>(out);
      float* acc = me.acc.data();
      for (int64_t t = 0; t < tokens; ++t) {
        std::fill(acc, acc + h, 0.0f);
        for (int64_t k = 0; k < r; ++k) {
          const int32_t sl = position[t * r + k];
          if (!reduce && sl < 0) std::fill(o + (t * r + k) * h, o + (t * r + k + 1) * h, uint16_t(0));
          if (sl < 0) continue;
          const int64_t p = sl / c, pos = sl % c;
          if (p >= n || pos >= headers[p]->rows) {
            Throw(ErrorCode::kPeerFailed, "combine_recv: rank " + std::to_string(p) + " returned " +
                                              std::to_string(p < n ? headers[p]->rows : 0) + " rows, row " +
                                              std::to_string(pos) + " was expected");
          }
          const auto* y = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(headers[p]) +
                                                            d.header_bytes + pos * d.row_bytes);
          if (!reduce) {
            std::memcpy(o + (t * r + k) * h, y, h * sizeof(uint16_t));
            continue;
          }
          const float w = topk_weights[t * r + k];
          for (int64_t i = 0; i < h; ++i) acc[i] += w * Bf16ToFloat(y[i]);
        }
        if (!reduce) continue;
        for (int64_t i = 0; i < h; ++i) o[t * h + i] = FloatToBf16(acc[i]);
      }
    });
  });
}

}  // namespace jax_moe::cpu
