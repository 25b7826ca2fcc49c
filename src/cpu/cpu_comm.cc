#include "cpu/cpu_comm.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <map>

#include "common/deadline.h"
#include "common/error.h"
#include "cpu/bf16.h"
#include "cpu/host_buffer.h"
#include "cpu/imm_kind.h"
#include "fabric/transfer_engine.h"
#include "proxy/region_header.h"
#include "proxy/routing.h"

namespace jax_moe::cpu {

using proxy::MoeShape;
using proxy::RegionHeader;

struct CpuComm::Direction {
  const char* name = "";
  ImmKind data_kind{}, credit_kind{};
  bool has_counts = false;
  uint64_t row_bytes = 0, header_bytes = 0, region_bytes = 0;
  HostBuffer recv;   // [2 parities][N senders] regions
  HostBuffer stage;  // [remote peers] regions, packed here before one scatter
  std::unique_ptr<std::atomic<uint64_t>[]> arrived;  // [2][N]: last round a same-process sender completed
  std::atomic<uint64_t> freed{0};                   // last round this rank finished reading
  uint64_t send_round = 0, recv_round = 0;
  std::shared_ptr<fabric::MemoryRegion> recv_mr, stage_mr;
  fabric::GroupId group = 0;
  std::vector<fabric::RegionDescriptor> remote_regions;  // receive buffers of the remote ranks, group order

  uint8_t* Region(int64_t n, uint64_t round, int64_t sender) const {
    return recv.data() + (int64_t(round & 1) * n + sender) * region_bytes;
  }
};

struct CpuComm::Rank {
  RankInfo info{};
  std::vector<Rank*> local_peer;     // [N]: the same-process rank, or nullptr for a remote one
  std::vector<int32_t> remote_ranks;  // ranks of other processes, in peer-group order
  std::vector<int64_t> remote_index;  // [N]: position in remote_ranks, or -1
  std::vector<fabric::PeerId> remote_peers;
  std::shared_ptr<fabric::TransferEngine> engine;
  Direction dispatch, combine;
  std::mutex mu;
  std::condition_variable cv;  // arrivals into, and credits from, this rank
  proxy::SendPlan plan;
  std::vector<uint8_t*> dst;
  std::vector<float> acc;
};

namespace {

constexpr auto kPoll = std::chrono::milliseconds(50);

std::shared_ptr<fabric::TransferEngine> EngineFor(int64_t device, const std::string& provider) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, std::string>, std::weak_ptr<fabric::TransferEngine>> cache;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = cache[{device, provider}];
  if (auto engine = slot.lock()) return engine;
  fabric::EngineOptions options;
  options.provider = provider;
  auto engine = std::make_shared<fabric::TransferEngine>(options);
  slot = engine;
  return engine;
}

std::string RankList(const std::vector<int32_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

void Notify(CpuComm::Rank& rank) {
  { std::lock_guard<std::mutex> lock(rank.mu); }
  rank.cv.notify_all();
}

}  // namespace

// --- construction and bootstrap -------------------------------------------------------------------------------------
CpuComm::CpuComm(const CommOptions& options, const std::vector<RankInfo>& table, int32_t process)
    : options_(options), process_(process) {
  const MoeShape& s = options_.shape;
  s.Validate();
  const int64_t n = s.num_ranks, c = s.rows_per_peer();
  Require(options_.timeout_s > 0, "CpuComm: timeout must be positive");
  std::map<int32_t, std::vector<const RankInfo*>> groups;
  for (const RankInfo& info : table) {
    Require(info.rank >= 0 && info.rank < n, "CpuComm: rank out of range in the device table");
    auto& members = groups[info.group];
    members.resize(n, nullptr);
    Require(!members[info.rank], "CpuComm: two devices claim the same rank of a group");
    members[info.rank] = &info;
  }
  for (auto& [g, members] : groups) {
    for (const RankInfo* m : members) Require(m != nullptr, "CpuComm: a group misses a rank");
  }
  for (const RankInfo& info : table) {
    if (info.process != process_) continue;
    auto rank = std::make_unique<Rank>();
    rank->info = info;
    by_device_[info.device_id] = rank.get();
    ranks_.push_back(std::move(rank));
  }
  Require(!ranks_.empty(), "CpuComm: this process holds no device of the Communicator");
  for (auto& rank : ranks_) {
    const auto& members = groups[rank->info.group];
    rank->local_peer.assign(n, nullptr);
    rank->remote_index.assign(n, -1);
    for (int64_t p = 0; p < n; ++p) {
      if (members[p]->process == process_) {
        rank->local_peer[p] = by_device_.at(members[p]->device_id);
      } else {
        rank->remote_index[p] = int64_t(rank->remote_ranks.size());
        rank->remote_ranks.push_back(int32_t(p));
      }
    }
    rank->dst.resize(n);
    rank->acc.resize(s.hidden);
    const uint64_t header = proxy::RegionHeaderBytes(s);
    auto setup = [&](Direction& d, const char* name, ImmKind data, ImmKind credit, bool counts, uint64_t row) {
      d.name = name;
      d.data_kind = data;
      d.credit_kind = credit;
      d.has_counts = counts;
      d.row_bytes = row;
      d.header_bytes = header;
      d.region_bytes = proxy::AlignUp(header + c * row, 64);
      d.recv = HostBuffer(2 * n * d.region_bytes);
      d.stage = HostBuffer(rank->remote_ranks.size() * d.region_bytes);
      d.arrived.reset(new std::atomic<uint64_t>[2 * n]);
      for (int64_t i = 0; i < 2 * n; ++i) d.arrived[i].store(0);
    };
    setup(rank->dispatch, "dispatch", ImmKind::kDispatchData, ImmKind::kDispatchCredit, true,
          s.dispatch_row_bytes());
    setup(rank->combine, "combine", ImmKind::kCombineData, ImmKind::kCombineCredit, false, s.combine_row_bytes());
    if (!rank->remote_ranks.empty()) {
      rank->engine = EngineFor(rank->info.device_id, options_.provider);
      for (Direction* d : {&rank->dispatch, &rank->combine}) {
        d->recv_mr = rank->engine->Register(d->recv.data(), d->recv.size());
        d->stage_mr = rank->engine->Register(d->stage.data(), d->stage.size());
      }
    }
  }
}

CpuComm::~CpuComm() {
  for (auto& rank : ranks_) {
    if (!rank->engine) continue;
    try {
      rank->engine->WaitSends(1.0);  // let in-flight writes from our staging buffers finish before freeing them
    } catch (const std::exception&) {
    }
  }
}

bool CpuComm::has_remote_peers() const {
  for (const auto& rank : ranks_) {
    if (!rank->remote_ranks.empty()) return true;
  }
  return false;
}

std::vector<Endpoint> CpuComm::LocalEndpoints() const {
  std::vector<Endpoint> out;
  for (const auto& rank : ranks_) {
    if (!rank->engine) continue;
    out.push_back({rank->info.group, rank->info.rank, rank->engine->Address(),
                   rank->dispatch.recv_mr->descriptor().Serialize(), rank->combine.recv_mr->descriptor().Serialize()});
  }
  return out;
}

void CpuComm::Connect(const std::vector<Endpoint>& remote) {
  std::map<std::pair<int32_t, int32_t>, const Endpoint*> by_rank;
  for (const Endpoint& e : remote) by_rank[{e.group, e.rank}] = &e;
  for (auto& rank : ranks_) {
    if (rank->remote_ranks.empty()) continue;
    std::vector<fabric::RegionDescriptor> dispatch_regions, combine_regions;
    rank->remote_peers.clear();
    for (int32_t p : rank->remote_ranks) {
      auto it = by_rank.find({rank->info.group, p});
      Require(it != by_rank.end(), "CpuComm: no endpoint was published for rank " + std::to_string(p));
      rank->remote_peers.push_back(rank->engine->Connect(it->second->address, options_.timeout_s));
      dispatch_regions.push_back(fabric::RegionDescriptor::Parse(it->second->dispatch_region));
      combine_regions.push_back(fabric::RegionDescriptor::Parse(it->second->combine_region));
      Require(dispatch_regions.back().size == rank->dispatch.recv.size() &&
                  combine_regions.back().size == rank->combine.recv.size(),
              "CpuComm: rank " + std::to_string(p) + " registered buffers of another size (configs differ?)");
    }
    rank->dispatch.group = rank->engine->CreatePeerGroup(rank->remote_peers, dispatch_regions);
    rank->combine.group = rank->engine->CreatePeerGroup(rank->remote_peers, combine_regions);
    rank->dispatch.remote_regions = std::move(dispatch_regions);
    rank->combine.remote_regions = std::move(combine_regions);
  }
}

uint64_t CpuComm::BytesAllocated() const {
  uint64_t total = 0;
  for (const auto& rank : ranks_) {
    for (const Direction* d : {&rank->dispatch, &rank->combine}) total += d->recv.size() + d->stage.size();
  }
  return total;
}

// --- failure handling ---------------------------------------------------------------------------------------------------
CpuComm::Rank& CpuComm::RankOf(int64_t device) {
  auto it = by_device_.find(device);
  if (it == by_device_.end()) {
    Throw(ErrorCode::kInvalidArgument,
          "jax_moe cpu backend: device " + std::to_string(device) + " is not part of this Communicator");
  }
  return *it->second;
}

void CpuComm::CheckHealthy() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (!failure_.empty()) Throw(ErrorCode::kPeerFailed, "this Communicator failed earlier: " + failure_);
}

void CpuComm::Fail(const std::string& message) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) failure_ = message;
  }
  for (auto& rank : ranks_) Notify(*rank);
}

template <typename Fn>
void CpuComm::Guard(Fn&& fn) {
  CheckHealthy();
  try {
    fn();
  } catch (const Error& e) {
    Fail(e.what());
    throw;
  } catch (const std::exception& e) {
    Fail(e.what());
    Throw(ErrorCode::kInternal, e.what());
  }
}

// --- the generic send/receive steps of one direction ------------------------------------------------------------------
namespace {

// Waits until `ready()` holds under `owner`'s lock; throws kTimeout with `what()` at the deadline.
template <typename Ready, typename What, typename Healthy>
void WaitOn(CpuComm::Rank& owner, const Deadline& deadline, Ready ready, What what, Healthy healthy) {
  std::unique_lock<std::mutex> lock(owner.mu);
  while (!ready()) {
    healthy();
    if (deadline.Expired()) Throw(ErrorCode::kTimeout, what());
    owner.cv.wait_for(lock, kPoll);
  }
}

// Waits for one immediate `imm` from every rank of other processes. On a timeout the message names every rank
// that is missing (later peers are only polled once the first one is late); a transfer error names its rank.
template <typename What>
void WaitRemote(CpuComm::Rank& me, uint32_t imm, const Deadline& deadline, What what) {
  std::vector<int32_t> missing;
  for (size_t i = 0; i < me.remote_peers.size(); ++i) {
    const double wait_s = missing.empty() ? std::max(0.0, deadline.RemainingSeconds()) : 0.0;
    try {
      me.engine->WaitImmFrom(imm, {me.remote_peers[i]}, wait_s);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kTimeout) {
        Throw(e.code(), what() + RankList({me.remote_ranks[i]}) + " (other process): " + e.what());
      }
      missing.push_back(me.remote_ranks[i]);
    }
  }
  if (!missing.empty()) Throw(ErrorCode::kTimeout, what() + RankList(missing) + " (other processes) in time");
}

}  // namespace


// Waits for the receivers' credits for round - 2, then points rank.dst[p] at the region to fill for every peer p.
static void AcquireRegions(CpuComm::Rank& me, CpuComm::Direction CpuComm::Rank::*dir, uint64_t round,
                           const MoeShape& s, uint32_t slot, const Deadline& deadline,
                           const std::function<void()>& healthy) {
  CpuComm::Direction& d = me.*dir;
  const int64_t n = s.num_ranks;
  if (round > 2) {
    for (int64_t p = 0; p < n; ++p) {
      CpuComm::Rank* q = me.local_peer[p];
      if (!q) continue;
      CpuComm::Direction& qd = (*q).*dir;
      WaitOn(
          *q, deadline, [&] { return qd.freed.load(std::memory_order_acquire) >= round - 2; },
          [&] {
            return std::string(d.name) + " on rank " + std::to_string(me.info.rank) + ": rank " + std::to_string(p) +
                   " did not finish round " + std::to_string(round - 2) + " in time";
          },
          healthy);
    }
    WaitRemote(me, MakeImm(d.credit_kind, slot), deadline, [&] {
      return std::string(d.name) + " on rank " + std::to_string(me.info.rank) + ": no credit for round " +
             std::to_string(round - 2) + " from ranks ";
    });
  }
  if (!me.remote_ranks.empty()) me.engine->WaitSends(std::max(0.0, deadline.RemainingSeconds()));
  for (int64_t p = 0; p < n; ++p) {
    CpuComm::Rank* q = me.local_peer[p];
    me.dst[p] = q ? ((*q).*dir).Region(n, round, me.info.rank) : d.stage.data() + me.remote_index[p] * d.region_bytes;
  }
}

static void WriteHeader(uint8_t* region, const MoeShape& s, uint32_t slot, uint64_t round, int32_t sender,
                        int32_t rows, const int32_t* counts, int32_t error, int64_t error_value) {
  auto* h = reinterpret_cast<RegionHeader*>(region);
  h->magic = proxy::kRegionMagic;
  h->comm = slot;
  h->seq = round;
  h->sender = sender;
  h->error = error;
  h->error_value = error_value;
  h->rows = rows;
  h->pad = 0;
  if (counts) std::memcpy(proxy::HeaderCounts(h), counts, 4 * s.local_experts);
}

// Makes the filled regions visible: a release store for same-process peers, one scatter for the others.
static void Publish(CpuComm::Rank& me, CpuComm::Direction CpuComm::Rank::*dir, uint64_t round, const MoeShape& s,
                    uint32_t slot, const std::vector<int32_t>& rows) {
  CpuComm::Direction& d = me.*dir;
  const int64_t n = s.num_ranks;
  std::vector<uint64_t> src, len, dst;
  for (int64_t p = 0; p < n; ++p) {
    CpuComm::Rank* q = me.local_peer[p];
    if (q) {
      ((*q).*dir).arrived[(round & 1) * n + me.info.rank].store(round, std::memory_order_release);
      Notify(*q);
    } else {
      src.push_back(me.remote_index[p] * d.region_bytes);
      len.push_back(d.header_bytes + uint64_t(rows[p]) * d.row_bytes);
      dst.push_back(((round & 1) * n + me.info.rank) * d.region_bytes);
    }
  }
  if (src.empty()) return;
  const uint32_t imm = MakeImm(d.data_kind, slot);
  try {
    me.engine->Scatter(d.group, *d.stage_mr, src.data(), len.data(), dst.data(), src.size(), imm);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::kPeerFailed) throw;
    // A peer is gone: still deliver to the others, so that they fail naming the right rank instead of timing out
    // on us too, then report the failed peers.
    std::vector<int32_t> failed;
    for (size_t i = 0; i < src.size(); ++i) {
      try {
        me.engine->Write(me.remote_peers[i], *d.stage_mr, src[i], len[i], d.remote_regions[i], dst[i], imm);
      } catch (const Error&) {
        failed.push_back(me.remote_ranks[i]);
      }
    }
    Throw(ErrorCode::kPeerFailed, std::string(d.name) + " on rank " + std::to_string(me.info.rank) +
                                      ": cannot write to ranks " + RankList(failed) + ": " + e.what());
  }
}

// Waits for every sender's region of `round` and checks its header; returns the headers by sender.
static std::vector<const RegionHeader*> AwaitRegions(CpuComm::Rank& me, CpuComm::Direction CpuComm::Rank::*dir,
                                                     uint64_t round, const MoeShape& s, uint32_t slot,
                                                     const Deadline& deadline, const std::function<void()>& healthy) {
  CpuComm::Direction& d = me.*dir;
  const int64_t n = s.num_ranks;
  auto arrived = [&](int64_t p) {
    return d.arrived[(round & 1) * n + p].load(std::memory_order_acquire) >= round;
  };
  WaitOn(
      me, deadline,
      [&] {
        for (int64_t p = 0; p < n; ++p) {
          if (me.local_peer[p] && !arrived(p)) return false;
        }
        return true;
      },
      [&] {
        std::vector<int32_t> missing;
        for (int64_t p = 0; p < n; ++p) {
          if (me.local_peer[p] && !arrived(p)) missing.push_back(int32_t(p));
        }
        return std::string(d.name) + " on rank " + std::to_string(me.info.rank) + ": no data from ranks " +
               RankList(missing) + " within the timeout (round " + std::to_string(round) + ")";
      },
      healthy);
  WaitRemote(me, MakeImm(d.data_kind, slot), deadline, [&] {
    return std::string(d.name) + " on rank " + std::to_string(me.info.rank) + ": no data for round " +
           std::to_string(round) + " from ranks ";
  });
  std::vector<const RegionHeader*> headers(n);
  for (int64_t p = 0; p < n; ++p) {
    headers[p] = reinterpret_cast<const RegionHeader*>(d.Region(n, round, p));
    std::string problem = proxy::CheckHeader(*headers[p], s, slot, round, int32_t(p), d.has_counts);
    if (!problem.empty()) Throw(ErrorCode::kPeerFailed, std::string(d.name) + ": " + problem);
  }
  for (int64_t p = 0; p < n; ++p) {
    if (headers[p]->error == int32_t(proxy::SenderError::kExpertOutOfRange)) {
      Throw(ErrorCode::kInvalidArgument, "dispatch: rank " + std::to_string(p) + " was given expert id " +
                                             std::to_string(headers[p]->error_value) + ", outside [0, " +
                                             std::to_string(s.num_experts) + ")");
    }
  }
  return headers;
}

// Done reading `round`: senders may now reuse its parity.
static void Release(CpuComm::Rank& me, CpuComm::Direction CpuComm::Rank::*dir, uint64_t round, uint32_t slot) {
  CpuComm::Direction& d = me.*dir;
  d.freed.store(round, std::memory_order_release);
  Notify(me);
  if (!me.remote_ranks.empty()) me.engine->Barrier(d.group, MakeImm(d.credit_kind, slot));
}

static uint64_t CheckTicket(const int32_t* ticket, uint64_t round, uint32_t slot, const char* op) {
  if (uint32_t(ticket[1]) != slot || uint32_t(ticket[0]) != uint32_t(round & 0x7fffffff)) {
    Throw(ErrorCode::kInvalidArgument, std::string(op) + ": the handle is of round " + std::to_string(ticket[0]) +
                                           " but round " + std::to_string(round) +
                                           " is next (send and recv halves must alternate)");
  }
  return round;
}

// --- the four halves ------------------------------------------------------------------------------------------------
void CpuComm::DispatchSend(int64_t device, const uint8_t* x, const uint8_t* x_scale, const int32_t* topk_idx,
                           int64_t tokens, int32_t* slot, int32_t* ticket) {
  Guard([&] {
    Rank& me = RankOf(device);
    const MoeShape& s = options_.shape;
    Require(tokens <= s.max_tokens, "dispatch_send: more tokens than max_tokens");
    proxy::ComputeSendPlan(topk_idx, tokens, s, &me.plan);
    Direction& d = me.dispatch;
    const uint64_t round = ++d.send_round;
    const Deadline deadline = Deadline::After(options_.timeout_s);
    AcquireRegions(me, &Rank::dispatch, round, s, options_.slot, deadline, [this] { CheckHealthy(); });
    const int64_t r = s.experts_per_token, c = s.rows_per_peer();
    const uint64_t xb = s.x_bytes(), sb = s.scale_bytes();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t k = 0; k < r; ++k) {
        const int32_t sl = me.plan.slot[t * r + k];
        if (sl < 0) continue;
        uint8_t* row = me.dst[sl / c] + d.header_bytes + uint64_t(sl % c) * d.row_bytes;
        std::memcpy(row, x + t * xb, xb);
        if (sb) std::memcpy(row + xb, x_scale + t * sb, sb);
      }
    }
    const bool bad = me.plan.bad_index >= 0;
    for (int64_t p = 0; p < s.num_ranks; ++p) {
      WriteHeader(me.dst[p], s, options_.slot, round, me.info.rank, me.plan.rows[p], &me.plan.counts[p * s.local_experts],
                  int32_t(bad ? proxy::SenderError::kExpertOutOfRange : proxy::SenderError::kNone), me.plan.bad_value);
    }
    Publish(me, &Rank::dispatch, round, s, options_.slot, me.plan.rows);
    std::copy(me.plan.slot.begin(), me.plan.slot.end(), slot);
    ticket[0] = int32_t(round & 0x7fffffff);
    ticket[1] = int32_t(options_.slot);
    if (bad) {
      const int64_t t = me.plan.bad_index / r, k = me.plan.bad_index % r;
      Throw(ErrorCode::kInvalidArgument, "dispatch_send: expert id " + std::to_string(me.plan.bad_value) +
                                             " at token " + std::to_string(t) + ", k " + std::to_string(k) +
                                             " is outside [0, " + std::to_string(s.num_experts) + ")");
    }
  });
}

void CpuComm::DispatchRecv(int64_t device, const int32_t* ticket, uint8_t* expert_x, uint8_t* expert_x_scale,
                           int32_t* expert_counts, int32_t* dest) {
  Guard([&] {
    Rank& me = RankOf(device);
    const MoeShape& s = options_.shape;
    Direction& d = me.dispatch;
    const uint64_t round = CheckTicket(ticket, d.recv_round + 1, options_.slot, "dispatch_recv");
    ++d.recv_round;
    const Deadline deadline = Deadline::After(options_.timeout_s);
    auto headers = AwaitRegions(me, &Rank::dispatch, round, s, options_.slot, deadline, [this] { CheckHealthy(); });
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
    Release(me, &Rank::dispatch, round, options_.slot);
  });
}

void CpuComm::CombineSend(int64_t device, const uint8_t* expert_y, const int32_t* dest, int32_t* ticket) {
  Guard([&] {
    Rank& me = RankOf(device);
    const MoeShape& s = options_.shape;
    Direction& d = me.combine;
    const uint64_t round = ++d.send_round;
    const Deadline deadline = Deadline::After(options_.timeout_s);
    AcquireRegions(me, &Rank::combine, round, s, options_.slot, deadline, [this] { CheckHealthy(); });
    const int64_t n = s.num_ranks, c = s.rows_per_peer(), m = s.max_recv_rows();
    const uint64_t yb = uint64_t(s.hidden) * s.y_itemsize;
    std::vector<int32_t> rows(n, 0);
    for (int64_t p = 0; p < n; ++p) {
      const int32_t* dp = dest + p * c;
      uint8_t* base = me.dst[p] + d.header_bytes;
      int32_t j = 0;
      for (; j < c && dp[j] >= 0; ++j) {
        Require(dp[j] < m, "combine_send: the dispatch route points outside expert_y");
        std::memcpy(base + j * d.row_bytes, expert_y + int64_t(dp[j]) * yb, yb);
      }
      rows[p] = j;
      WriteHeader(me.dst[p], s, options_.slot, round, me.info.rank, j, nullptr, 0, 0);
    }
    Publish(me, &Rank::combine, round, s, options_.slot, rows);
    ticket[0] = int32_t(round & 0x7fffffff);
    ticket[1] = int32_t(options_.slot);
  });
}

void CpuComm::CombineRecv(int64_t device, const int32_t* ticket, const float* topk_weights, const int32_t* slot,
                          int64_t tokens, uint8_t* out) {
  Guard([&] {
    Rank& me = RankOf(device);
    const MoeShape& s = options_.shape;
    Direction& d = me.combine;
    const uint64_t round = CheckTicket(ticket, d.recv_round + 1, options_.slot, "combine_recv");
    ++d.recv_round;
    const Deadline deadline = Deadline::After(options_.timeout_s);
    auto headers = AwaitRegions(me, &Rank::combine, round, s, options_.slot, deadline, [this] { CheckHealthy(); });
    const int64_t n = s.num_ranks, r = s.experts_per_token, c = s.rows_per_peer(), h = s.hidden;
    auto* o = reinterpret_cast<uint16_t*>(out);
    float* acc = me.acc.data();
    for (int64_t t = 0; t < tokens; ++t) {
      std::fill(acc, acc + h, 0.0f);
      for (int64_t k = 0; k < r; ++k) {
        const int32_t sl = slot[t * r + k];
        if (sl < 0) continue;
        const int64_t p = sl / c, pos = sl % c;
        if (p >= n || pos >= headers[p]->rows) {
          Throw(ErrorCode::kPeerFailed, "combine_recv: rank " + std::to_string(p) + " returned " +
                                            std::to_string(p < n ? headers[p]->rows : 0) + " rows, row " +
                                            std::to_string(pos) + " was expected");
        }
        const auto* y = reinterpret_cast<const uint16_t*>(reinterpret_cast<const uint8_t*>(headers[p]) +
                                                          d.header_bytes + pos * d.row_bytes);
        const float w = topk_weights[t * r + k];
        for (int64_t i = 0; i < h; ++i) acc[i] += w * Bf16ToFloat(y[i]);
      }
      for (int64_t i = 0; i < h; ++i) o[t * h + i] = FloatToBf16(acc[i]);
    }
    Release(me, &Rank::combine, round, options_.slot);
  });
}

// --- registry ---------------------------------------------------------------------------------------------------------
namespace {
std::mutex registry_mu;
std::map<uint32_t, std::shared_ptr<CpuComm>>& Registry() {
  static std::map<uint32_t, std::shared_ptr<CpuComm>> registry;
  return registry;
}
}  // namespace

void RegisterComm(std::shared_ptr<CpuComm> comm) {
  std::lock_guard<std::mutex> lock(registry_mu);
  Registry()[comm->options().slot] = std::move(comm);
}

std::shared_ptr<CpuComm> FindComm(uint32_t slot) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(slot);
  return it == Registry().end() ? nullptr : it->second;
}

void ReleaseComm(uint32_t slot) {
  std::shared_ptr<CpuComm> comm;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = Registry().find(slot);
    if (it == Registry().end()) return;
    comm = std::move(it->second);
    Registry().erase(it);
  }
}

}  // namespace jax_moe::cpu
