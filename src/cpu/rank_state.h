// Internal state of CpuComm's ranks (only src/cpu/*.cc include this).
#pragma once
#include <atomic>
#include <deque>
#include <memory>
#include <vector>

#include "common/deadline.h"
#include "cpu/cpu_comm.h"
#include "cpu/host_buffer.h"
#include "cpu/imm_kind.h"
#include "fabric/transfer_engine.h"
#include "proxy/routing.h"

namespace jax_moe::cpu {

// A send buffer with one region per peer: regions that cannot be delivered yet, and regions written to other
// processes (the NIC reads them after the call returns).
struct Staging {
  HostBuffer buf;
  std::shared_ptr<fabric::MemoryRegion> mr;  // registered when the rank has peers in other processes
  int queued = 0;                            // regions still waiting in a peer queue
  bool remote_pending = false;               // writes from it may still be in flight
};

struct Outgoing {
  uint64_t round;
  Staging* staging;
  uint64_t bytes;
};

struct CpuComm::Direction {
  const char* name = "";
  ImmKind data_kind{}, credit_kind{};
  bool has_counts = false;
  uint64_t row_bytes = 0, header_bytes = 0, region_bytes = 0;
  int64_t lanes = 0;  // K: round k uses lane k % K
  HostBuffer recv;    // [K lanes][N senders] regions
  std::shared_ptr<fabric::MemoryRegion> recv_mr;
  fabric::PeerSetId group = 0;
  std::vector<fabric::RegionDescriptor> remote_regions;  // receive buffers of the remote ranks, peer-set order
  std::unique_ptr<std::atomic<uint64_t>[]> arrived;   // [K][N]: last round a same-process sender delivered
  std::unique_ptr<std::atomic<uint64_t>[]> released;  // [K]: rounds of each lane this rank finished reading
  uint64_t send_round = 0;                            // touched by the rank's own XLA thread only
  uint64_t received = 0;                              // rounds this rank received (same thread)
  // Guarded by CpuComm::mu_:
  std::vector<std::deque<Outgoing>> queue;  // [N] regions waiting for the receiver's credit, in round order
  std::vector<std::unique_ptr<Staging>> staging;
  std::vector<uint64_t> remote_credits;  // [N][K] rounds of a lane a remote receiver released
  std::vector<uint64_t> remote_rounds;   // [N][K] rounds of a lane a remote sender delivered

  int64_t Lane(uint64_t round) const { return int64_t(round % uint64_t(lanes)); }
  // Rounds of `round`'s lane before it (rounds count from 1).
  uint64_t Earlier(uint64_t round) const { return (round - 1) / uint64_t(lanes); }
  uint8_t* Region(int64_t n, uint64_t round, int64_t sender) const {
    return recv.data() + (Lane(round) * n + sender) * region_bytes;
  }
};

struct CpuComm::Rank {
  RankInfo info{};
  std::vector<Rank*> local_peer;       // [N]: the same-process rank, or nullptr for a remote one
  std::vector<int32_t> remote_ranks;   // ranks of other processes, in peer-set order
  std::vector<int64_t> remote_index;   // [N]: position in remote_ranks, or -1
  std::vector<fabric::PeerId> remote_peers;
  std::shared_ptr<fabric::TransferEngine> engine;
  Direction dispatch, combine;
  proxy::SendPlan plan;
  std::vector<float> acc;
};

std::string RankList(const std::vector<int32_t>& ranks);
// The error a sender reported in its region of `round` (an expert id out of range on that rank), or "" when none or
// the region is not (yet) a valid one; `who` names the sender.
std::string SenderFailure(const CpuComm::Direction& d, const proxy::MoeShape& s, uint32_t slot, uint64_t round,
                          int64_t sender, const std::string& who);

}  // namespace jax_moe::cpu
