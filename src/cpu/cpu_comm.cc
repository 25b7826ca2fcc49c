#include "cpu/cpu_comm.h"

#include "common/format.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "cpu/engine_pool.h"
#include "cpu/rank_state.h"
#include "proxy/region_header.h"

namespace jax_moe::cpu {

using proxy::MoeShape;

namespace {

std::atomic<int64_t> live_comms{0};

// Credits still owed to us are waited for at most this long when a CpuComm goes (see Drain).
constexpr double kDrainBoundS = 5.0;

}  // namespace

std::string RankList(const std::vector<int32_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

// --- construction and bootstrap -------------------------------------------------------------------------------------
CpuComm::CpuComm(const CommOptions& options, const std::vector<RankInfo>& table, int32_t process)
    : options_(options), process_(process) {
  const MoeShape& s = options_.shape;
  s.Validate();
  const int64_t n = s.num_ranks, c = s.rows_per_peer();
  Require(options_.timeout_s > 0, "CpuComm: timeout must be positive");
  Require(n <= kMaxRanks, "CpuComm: at most 4096 ranks per group");
  Require(options_.lanes >= 2 && options_.lanes <= kMaxLanes, "CpuComm: lanes must be in [2, 8]");
  table_ = table;  // members_ points into it
  std::map<int32_t, std::vector<const RankInfo*>> groups;
  for (const RankInfo& info : table_) {
    Require(info.rank >= 0 && info.rank < n, "CpuComm: rank out of range in the device table");
    auto& members = groups[info.group];
    members.resize(n, nullptr);
    Require(!members[info.rank], "CpuComm: two devices claim the same rank of a group");
    members[info.rank] = &info;
  }
  for (auto& [g, members] : groups) {
    for (const RankInfo* m : members) Require(m != nullptr, "CpuComm: a group misses a rank");
    members_[g] = members;
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
      d.lanes = options_.lanes;
      d.recv = HostBuffer(d.lanes * n * d.region_bytes);
      d.arrived.reset(new std::atomic<uint64_t>[d.lanes * n]);
      for (int64_t i = 0; i < d.lanes * n; ++i) d.arrived[i].store(0);
      d.released.reset(new std::atomic<uint64_t>[d.lanes]);
      for (int64_t i = 0; i < d.lanes; ++i) d.released[i].store(0);
      d.queue.resize(n);
      d.remote_credits.assign(n * d.lanes, 0);
      d.remote_rounds.assign(n * d.lanes, 0);
    };
    setup(rank->dispatch, "dispatch", ImmKind::kDispatchData, ImmKind::kDispatchCredit, true,
          s.dispatch_row_bytes());
    setup(rank->combine, "combine", ImmKind::kCombineData, ImmKind::kCombineCredit, false, s.combine_row_bytes());
    if (!rank->remote_ranks.empty()) {
      rank->engine = AcquireEngine(rank->info.device_id, options_.provider);
      Require(rank->engine->max_imm() == UINT32_MAX,
              "CpuComm: the fabric provider carries " + std::to_string(rank->engine->max_imm()) +
                  " as its largest immediate; the cpu backend needs 32-bit immediates");
      for (Direction* d : {&rank->dispatch, &rank->combine}) {
        d->recv_mr = rank->engine->Register(d->recv.data(), d->recv.size());
      }
    }
  }
  progress_ = std::thread([this] { ProgressLoop(); });
  live_comms.fetch_add(1);
}

CpuComm::~CpuComm() {
  Drain();
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (progress_.joinable()) progress_.join();
  for (auto& rank : ranks_) {
    if (!rank->engine) continue;
    try {
      rank->engine->WaitSends(1.0);  // in-flight writes read our staging buffers: let them finish first
    } catch (const std::exception&) {
    }
  }
  live_comms.fetch_sub(1);
}

int64_t CpuComm::Live() { return live_comms.load(); }

// Peers send a credit after every round they receive, the last ones possibly after this process is done with the
// Communicator, and our queued regions still need the progress thread. Waits (bounded; not after a failure) until the
// queues are empty and every remote peer gave credit for every round we sent it: then no peer write to this
// Communicator is still on its way, and our engine may close (engine_pool.h) without leaving a peer's write hanging.
void CpuComm::Drain() {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (!failure_.empty()) return;
  }
  const Deadline deadline = Deadline::After(std::min(options_.timeout_s, kDrainBoundS));
  std::unique_lock<std::mutex> lock(mu_);
  try {
    while (!Drained()) {
      if (deadline.Expired()) return;
      {
        std::lock_guard<std::mutex> flock(failure_mu_);
        if (!failure_.empty()) return;
      }
      cv_.wait_for(lock, std::chrono::microseconds(200));
    }
  } catch (const std::exception&) {  // a closed or failed engine: nothing more will come
  }
}

bool CpuComm::Drained() {  // called with mu_ held
  const int64_t n = options_.shape.num_ranks;
  for (auto& rank : ranks_) {
    for (DirectionOf dir : {&Rank::dispatch, &Rank::combine}) {
      Direction& d = (*rank).*dir;
      for (int64_t p = 0; p < n; ++p) {
        if (!d.queue[p].empty()) return false;
        if (rank->local_peer[p]) continue;
        // Rounds send_round + 1 .. send_round + K cover every lane once: each needs the credits of all rounds sent.
        for (int64_t k = 1; k <= d.lanes; ++k) {
          if (!CreditOk(*rank, dir, p, d.send_round + uint64_t(k))) return false;
        }
      }
    }
  }
  return true;
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
    std::vector<fabric::PeerId> peers;
    for (int32_t p : rank->remote_ranks) {
      auto it = by_rank.find({rank->info.group, p});
      Require(it != by_rank.end(), "CpuComm: no endpoint was published for rank " + std::to_string(p));
      peers.push_back(rank->engine->Connect(it->second->address, options_.timeout_s));
      dispatch_regions.push_back(fabric::RegionDescriptor::Parse(it->second->dispatch_region));
      combine_regions.push_back(fabric::RegionDescriptor::Parse(it->second->combine_region));
      Require(dispatch_regions.back().size == rank->dispatch.recv.size() &&
                  combine_regions.back().size == rank->combine.recv.size(),
              "CpuComm: rank " + std::to_string(p) + " registered buffers of another size (configs differ?)");
    }
    std::lock_guard<std::mutex> lock(mu_);
    rank->remote_peers = peers;
    rank->dispatch.group = rank->engine->CreatePeerSet(peers, dispatch_regions);
    rank->combine.group = rank->engine->CreatePeerSet(peers, combine_regions);
    rank->dispatch.remote_regions = std::move(dispatch_regions);
    rank->combine.remote_regions = std::move(combine_regions);
  }
}

uint64_t CpuComm::BytesAllocated() const {
  uint64_t total = 0;
  for (const auto& rank : ranks_) {
    for (const Direction* d : {&rank->dispatch, &rank->combine}) {
      total += d->recv.size();
      for (const auto& st : d->staging) total += st->buf.size();
    }
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
  // The first error's code, so that every rank and every later call report one error the same way.
  if (!failure_.empty()) Throw(failure_code_, "this Communicator failed earlier: " + failure_);
}

void CpuComm::Fail(const std::string& message, ErrorCode code) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) {
      failure_ = message;
      failure_code_ = code;
    }
  }
  cv_.notify_all();
}

void CpuComm::Guard(const std::function<void()>& fn) {
  CheckHealthy();
  try {
    fn();
  } catch (const Error& e) {
    Fail(e.what(), e.code());
    throw;
  } catch (const std::exception& e) {
    Fail(e.what(), ErrorCode::kInternal);
    Throw(ErrorCode::kInternal, e.what());
  }
}

void CpuComm::SetHosts(const std::vector<std::string>& hosts) {
  std::lock_guard<std::mutex> lock(failure_mu_);
  hosts_ = hosts;
}

std::string CpuComm::Name(const Rank& me, int64_t rank) const {
  std::string out = "rank " + std::to_string(rank);
  auto it = members_.find(me.info.group);
  if (it == members_.end() || rank < 0 || rank >= int64_t(it->second.size())) return out;
  const RankInfo& info = *it->second[rank];
  std::lock_guard<std::mutex> lock(failure_mu_);
  const bool host = info.process >= 0 && info.process < int32_t(hosts_.size()) && !hosts_[info.process].empty();
  return out + " (process " + std::to_string(info.process) + (host ? " on host " + hosts_[info.process] : "") +
         ", device " + std::to_string(info.device_id) + ")";
}

// --- receiving ------------------------------------------------------------------------------------------------------------
bool CpuComm::Arrived(Rank& me, DirectionOf dir, uint64_t round, std::vector<int32_t>* missing) {
  Direction& d = me.*dir;
  const int64_t n = options_.shape.num_ranks;
  bool all = true;
  for (int64_t p = 0; p < n; ++p) {
    bool here;
    if (me.local_peer[p]) {
      here = d.arrived[d.Lane(round) * n + p].load(std::memory_order_acquire) >= round;
    } else {
      const int64_t lane = d.Lane(round);
      uint64_t& count = d.remote_rounds[p * d.lanes + lane];
      while (me.engine->TryConsumeImm(MakeImm(d.data_kind, options_.slot, uint32_t(p), uint32_t(lane)), 1)) ++count;
      here = count > d.Earlier(round);
    }
    if (!here) {
      all = false;
      if (!missing) return false;
      missing->push_back(int32_t(p));
    }
  }
  return all;
}

void CpuComm::Receive(Rank& me, DirectionOf dir, const int32_t* ticket, const char* op,
                      const std::function<void()>& finish) {
  Direction& d = me.*dir;
  const uint64_t round = uint32_t(ticket[0]);
  if (uint32_t(ticket[1]) != options_.slot || round == 0 || round > d.send_round) {
    Throw(ErrorCode::kInvalidArgument,
          std::string(op) + ": the handle does not come from this Communicator's send half on this device");
  }
  // Block this device's XLA thread until every sender's region is there: XLA:CPU runs a device's program in one
  // fixed order on every rank, so a receive only waits for sends that come earlier in that order, and sends never
  // block. Every wait is bounded by the timeout and names the ranks that did not answer.
  const Deadline deadline = Deadline::After(options_.timeout_s);
  {
    std::unique_lock<std::mutex> lock(mu_);
    std::vector<int32_t> missing;
    while (!Arrived(me, dir, round, &missing)) {
      CheckHealthy();
      // A sender that failed (a bad expert id) says so in its region: fail now with its error, not at the timeout
      // (other ranks of its process may never send this round).
      for (int64_t p = 0, j = 0; p < options_.shape.num_ranks; ++p) {
        if (j < int64_t(missing.size()) && missing[j] == p) {
          ++j;
          continue;
        }
        std::string failed = SenderFailure(d, options_.shape, options_.slot, round, p, Name(me, p));
        if (!failed.empty()) Throw(ErrorCode::kInvalidArgument, failed);
      }
      if (deadline.Expired()) {
        std::string names;
        for (int32_t p : missing) names += (names.empty() ? "" : ", ") + Name(me, p);
        Throw(ErrorCode::kTimeout,
              std::string(d.name) + " on " + Name(me, me.info.rank) + ": no data from " + names + " within " +
                  Format("%g", options_.timeout_s) + " s (round " + std::to_string(round) +
                  "): its process may have died or stopped calling this Communicator");
      }
      missing.clear();
      cv_.wait_for(lock, me.remote_ranks.empty() ? std::chrono::microseconds(20000) : std::chrono::microseconds(100));
    }
  }
  finish();
  Release(me, dir, round);
}

void CpuComm::Release(Rank& me, DirectionOf dir, uint64_t round) {
  Direction& d = me.*dir;
  d.released[d.Lane(round)].fetch_add(1, std::memory_order_acq_rel);
  if (!me.remote_ranks.empty()) {
    me.engine->Barrier(d.group,
                       MakeImm(d.credit_kind, options_.slot, uint32_t(me.info.rank), uint32_t(d.Lane(round))));
  }
  cv_.notify_all();
}

// Delivers queued regions as receivers give credit (a send half never waits for it).
void CpuComm::ProgressLoop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    bool waiting = false;
    for (auto& rank : ranks_) {
      for (DirectionOf dir : {&Rank::dispatch, &Rank::combine}) {
        try {
          FlushQueues(*rank, dir);
        } catch (const Error& e) {
          Fail(e.what(), e.code());
        }
        for (const auto& q : ((*rank).*dir).queue) waiting |= !q.empty();
      }
    }
    cv_.wait_for(lock, waiting ? std::chrono::microseconds(100) : std::chrono::microseconds(20000));
  }
}

// --- registry ---------------------------------------------------------------------------------------------------------
namespace {
std::mutex registry_mu;
// Never destroyed: CpuComms left at exit must not be torn down by static destructors, after libfabric may have
// finalized; the Python binding's atexit hook calls ReleaseAllComms before that.
std::map<uint32_t, std::shared_ptr<CpuComm>>& Registry() {
  static auto* registry = new std::map<uint32_t, std::shared_ptr<CpuComm>>();
  return *registry;
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
  std::shared_ptr<CpuComm> comm;  // destroyed after the lock is dropped: ~CpuComm joins its progress thread
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = Registry().find(slot);
    if (it == Registry().end()) return;
    comm = std::move(it->second);
    Registry().erase(it);
  }
}

void ReleaseAllComms() {
  std::map<uint32_t, std::shared_ptr<CpuComm>> all;
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    all.swap(Registry());
  }
  // Drains run one after the other, each bounded; then the engines nobody holds any more are closed at once.
  all.clear();
  CloseIdleEngines();
}

}  // namespace jax_moe::cpu
