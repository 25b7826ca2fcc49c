// Internal state of CpuComm's ranks (only src/cpu/*.cc include this).
#pragma once
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "cpu/cpu_comm.h"
#include "cpu/same_process.h"
#include "proxy/channel.h"
#include "proxy/host_port.h"
#include "proxy/routing.h"

namespace jax_moe::cpu {

// One direction (dispatch or combine) of one rank: its receive buffer, and the proxy channel that moves its rounds.
struct CpuComm::Direction {
  const char* name = "";
  bool has_counts = false;  // dispatch regions carry the per-expert counts after the header
  uint64_t header_bytes = 0, row_bytes = 0;
  std::unique_ptr<Inbox> inbox;
  std::string descriptor;  // of the inbox, registered when the rank has peers in other processes
  std::unique_ptr<SameProcessPeers> same_process;
  std::unique_ptr<proxy::Channel> channel;
};

struct CpuComm::Rank {
  RankInfo info{};
  std::vector<Rank*> local_peer;  // [N]: the same-process rank, or nullptr for one in another process
  Direction dispatch, combine;
  // When the rank has peers in other processes. Declared after the directions, so destroyed before them: the inboxes'
  // registrations (held here) go before the inboxes' memory is freed (the channels keep the engine alive).
  std::unique_ptr<proxy::HostPort> port;
  proxy::SendPlan plan;
  std::vector<float> acc;
};

// The error a sender reported in its region of `round` (an expert id out of range on that rank), or "" when none or
// the region is not (yet) a valid one; `name(sender)` names the sender (called only for an error).
std::string SenderFailure(const CpuComm::Direction& d, const proxy::MoeShape& s, uint32_t comm_id, uint64_t round,
                          int64_t sender, const std::function<std::string(int64_t)>& name);

}  // namespace jax_moe::cpu
