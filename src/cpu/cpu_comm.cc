#include "cpu/cpu_comm.h"

#include "common/format.h"

#include <algorithm>
#include <chrono>
#include <map>

#include "cpu/rank_state.h"
#include "cpu/same_process.h"
#include "proxy/engine_pool.h"
#include "proxy/imm.h"
#include "proxy/region_header.h"

namespace jax_moe::cpu {

using proxy::MoeShape;

namespace {

std::atomic<int64_t> live_comms{0};

// Credits still owed to us are waited for at most this long when a CpuComm goes (see Drain).
constexpr double kDrainBoundS = 5.0;

}  // namespace

// --- construction and bootstrap -------------------------------------------------------------------------------------
CpuComm::CpuComm(const CommOptions& options, const std::vector<RankInfo>& table, int32_t process)
    : options_(options), process_(process) {
  const MoeShape& s = options_.shape;
  if (*s.Problem()) Throw(ErrorCode::kInvalidArgument, s.Problem());
  const int64_t n = s.num_ranks, c = s.rows_per_peer();
  Require(options_.timeout_s > 0, "CpuComm: timeout must be positive");
  Require(n <= proxy::kMaxRanks, "CpuComm: at most 4096 ranks per group");
  Require(options_.lanes >= 2 && options_.lanes <= proxy::kMaxLanes, "CpuComm: lanes must be in [2, 8]");
  proxy_ = std::make_unique<proxy::Proxy>(options_.timeout_s);
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
  const uint64_t header = proxy::RegionHeaderBytes(s);
  // Inboxes first: every rank's same-process peers point at the others'.
  for (auto& rank : ranks_) {
    const auto& members = groups[rank->info.group];
    rank->local_peer.assign(n, nullptr);
    bool remote = false;
    for (int64_t p = 0; p < n; ++p) {
      if (members[p]->process == process_) {
        rank->local_peer[p] = by_device_.at(members[p]->device_id);
      } else {
        remote = true;
      }
    }
    rank->acc.resize(s.hidden);
    auto setup = [&](Direction& d, const char* name, bool counts, uint64_t row) {
      d.name = name;
      d.has_counts = counts;
      d.header_bytes = header;
      d.row_bytes = row;
      d.inbox = std::make_unique<Inbox>(proxy::Lanes{n, options_.lanes, proxy::AlignUp(header + c * row, 64)});
    };
    setup(rank->dispatch, "dispatch", true, s.dispatch_row_bytes());
    setup(rank->combine, "combine", false, s.combine_row_bytes());
    if (remote) {
      try {
        rank->port = std::make_unique<proxy::HostPort>("cpu:" + std::to_string(rank->info.device_id),
                                                       options_.provider);
      } catch (const Error& e) {
        Throw(e.code(), std::string("CpuComm: ") + e.what());
      }
      for (Direction* d : {&rank->dispatch, &rank->combine}) {  // registered in channel order (Connect)
        d->descriptor = rank->port->Register(d->inbox->recv.data(), d->inbox->recv.size());
      }
    }
  }
  std::vector<proxy::Channel*> channels;
  for (auto& rank : ranks_) {
    std::vector<bool> remote(n);
    for (int64_t p = 0; p < n; ++p) remote[p] = rank->local_peer[p] == nullptr;
    auto open = [&](Direction& d, Direction Rank::*dir, proxy::ImmKind data, proxy::ImmKind credit) {
      std::vector<Inbox*> peers(n, nullptr);
      for (int64_t p = 0; p < n; ++p) {
        if (Rank* q = rank->local_peer[p]) peers[p] = ((*q).*dir).inbox.get();
      }
      d.same_process = std::make_unique<SameProcessPeers>(rank->info.rank, d.inbox.get(), std::move(peers));
      proxy::ChannelConfig config;
      config.name = d.name;
      config.data_kind = data;
      config.credit_kind = credit;
      config.comm_id = options_.comm_id;
      config.rank = rank->info.rank;
      config.lanes = d.inbox->lanes;
      config.slots = proxy::RegionSlots::EveryRank(n);  // same-process senders deliver into the inbox too
      config.header_bytes = d.header_bytes;
      config.row_bytes = d.row_bytes;
      auto allocate = [](uint64_t bytes) {
        auto buf = std::make_shared<HostBuffer>(bytes);
        return proxy::Block{buf->data(), buf->size(), buf};
      };
      d.channel = rank->port ? rank->port->NewChannel(config, remote, d.same_process.get(), allocate, proxy_->mu(),
                                                      proxy_->cv())
                             : std::make_unique<proxy::Channel>(config, remote, nullptr, d.same_process.get(),
                                                                allocate, proxy_->mu(), proxy_->cv());
      channels.push_back(d.channel.get());
    };
    open(rank->dispatch, &Rank::dispatch, proxy::ImmKind::kDispatchData, proxy::ImmKind::kDispatchCredit);
    open(rank->combine, &Rank::combine, proxy::ImmKind::kCombineData, proxy::ImmKind::kCombineCredit);
  }
  proxy_->Start(std::move(channels));
  live_comms.fetch_add(1);
}

// Peers send a credit after every round they receive, the last ones possibly after this process is done with the
// Communicator, and our queued regions still need the progress thread: the proxy drains first (bounded), then stops;
// then in-flight writes, which read our staging buffers, are given a moment to finish. The engines are shared by the
// process's CpuComms and close with the last of them (proxy/engine_pool.h).
CpuComm::~CpuComm() {
  proxy_->Drain(kDrainBoundS);
  proxy_.reset();
  for (auto& rank : ranks_) {
    if (!rank->port) continue;
    try {
      rank->port->WaitSends(1.0);
    } catch (const std::exception&) {
    }
  }
  live_comms.fetch_sub(1);
}

int64_t CpuComm::Live() { return live_comms.load(); }

std::vector<Endpoint> CpuComm::LocalEndpoints() const {
  std::vector<Endpoint> out;
  for (const auto& rank : ranks_) {
    if (!rank->port) continue;
    out.push_back({rank->info.group, rank->info.rank, rank->port->Address(), rank->dispatch.descriptor,
                   rank->combine.descriptor});
  }
  return out;
}

void CpuComm::Connect(const std::vector<Endpoint>& remote) {
  std::map<std::pair<int32_t, int32_t>, const Endpoint*> by_rank;
  for (const Endpoint& e : remote) by_rank[{e.group, e.rank}] = &e;
  for (auto& rank : ranks_) {
    const std::vector<int32_t>& ranks = rank->dispatch.channel->remote_ranks();
    if (ranks.empty()) continue;
    std::vector<proxy::HostPort::RemoteEnd> ends;
    for (int32_t p : ranks) {
      auto it = by_rank.find({rank->info.group, p});
      Require(it != by_rank.end(), "CpuComm: no endpoint was published for rank " + std::to_string(p));
      ends.push_back({p, it->second->address, {it->second->dispatch_region, it->second->combine_region}});
    }
    try {
      rank->port->Connect({rank->dispatch.channel.get(), rank->combine.channel.get()}, ends, options_.timeout_s);
    } catch (const Error& e) {
      Throw(e.code(), std::string("CpuComm: ") + e.what());
    }
  }
}

uint64_t CpuComm::BytesAllocated() const {
  uint64_t total = 0;
  for (const auto& rank : ranks_) {
    for (const Direction* d : {&rank->dispatch, &rank->combine}) total += d->inbox->recv.size() + d->channel->BytesAllocated();
  }
  return total;
}

CpuComm::Rank& CpuComm::RankOf(int64_t device) {
  auto it = by_device_.find(device);
  if (it == by_device_.end()) {
    Throw(ErrorCode::kInvalidArgument,
          "jax_moe cpu backend: device " + std::to_string(device) + " is not part of this Communicator");
  }
  return *it->second;
}

void CpuComm::SetHosts(const std::vector<std::string>& hosts) {
  std::lock_guard<std::mutex> lock(hosts_mu_);
  hosts_ = hosts;
}

std::string CpuComm::Name(const Rank& me, int64_t rank) const {
  std::string out = "rank " + std::to_string(rank);
  auto it = members_.find(me.info.group);
  if (it == members_.end() || rank < 0 || rank >= int64_t(it->second.size())) return out;
  const RankInfo& info = *it->second[rank];
  std::lock_guard<std::mutex> lock(hosts_mu_);
  const bool host = info.process >= 0 && info.process < int32_t(hosts_.size()) && !hosts_[info.process].empty();
  return out + " (process " + std::to_string(info.process) + (host ? " on host " + hosts_[info.process] : "") +
         ", device " + std::to_string(info.device_id) + ")";
}

// --- receiving ------------------------------------------------------------------------------------------------------------
uint64_t CpuComm::TicketRound(const Direction& d, const int32_t* ticket, const char* op) const {
  const uint64_t round = uint32_t(ticket[0]);
  if (uint32_t(ticket[1]) != options_.comm_id || round == 0 || round > d.channel->send_round()) {
    Throw(ErrorCode::kInvalidArgument,
          std::string(op) + ": the handle does not come from this Communicator's send half on this device");
  }
  return round;
}

void CpuComm::Receive(Rank& me, Direction& d, uint64_t round, const std::function<void()>& finish) {
  // A sender that failed (a bad expert id) says so in its region: the wait fails at once with its error, not at the
  // timeout (other ranks of its process may never send this round).
  auto name = [&](int64_t p) { return Name(me, p); };
  proxy_->WaitRound(*d.channel, round, name,
                    [&](int64_t p) { return SenderFailure(d, options_.shape, options_.comm_id, round, p, name); });
  finish();
  d.channel->Release(round);
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
  Registry()[comm->options().comm_id] = std::move(comm);
}

std::shared_ptr<CpuComm> FindComm(uint32_t comm_id) {
  std::lock_guard<std::mutex> lock(registry_mu);
  auto it = Registry().find(comm_id);
  return it == Registry().end() ? nullptr : it->second;
}

void ReleaseComm(uint32_t comm_id) {
  std::shared_ptr<CpuComm> comm;  // destroyed after the lock is dropped: ~CpuComm joins its progress thread
  {
    std::lock_guard<std::mutex> lock(registry_mu);
    auto it = Registry().find(comm_id);
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
  proxy::CloseIdleEngines();
}

}  // namespace jax_moe::cpu
