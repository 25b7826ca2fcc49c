// The same-process shortcut of the "cpu" backend: ranks of one process write each other's host receive buffers
// directly (the send half fills the region in place when the receiver has credit, else the proxy copies it from
// staging later), then publish the round with a release store that the receiver's wait reads.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "cpu/host_buffer.h"
#include "proxy/channel.h"
#include "proxy/lanes.h"

namespace jax_moe::cpu {

// One rank's receive side of one direction: the buffer every sender writes, and what same-process senders and the
// receiver signal each other.
struct Inbox {
  explicit Inbox(const proxy::Lanes& lanes);
  uint8_t* Region(uint64_t round, int64_t sender) const { return recv.data() + lanes.Offset(round, sender); }

  proxy::Lanes lanes;
  HostBuffer recv;                                    // [K lanes][N senders] regions (RegionSlots::EveryRank)
  std::unique_ptr<std::atomic<uint64_t>[]> arrived;   // [K][N]: last round a same-process sender delivered
  std::unique_ptr<std::atomic<uint64_t>[]> released;  // [K]: rounds of each lane this rank finished reading
};

class SameProcessPeers final : public proxy::SameProcess {
 public:
  // peers[p]: rank p's inbox of the same direction, or null when p is in another process.
  SameProcessPeers(int32_t rank, Inbox* mine, std::vector<Inbox*> peers)
      : rank_(rank), mine_(mine), peers_(std::move(peers)) {}

  bool CreditOk(int64_t peer, uint64_t round) const override;
  uint8_t* Region(int64_t peer, uint64_t round) const override { return peers_[peer]->Region(round, rank_); }
  void Deliver(int64_t peer, const uint8_t* src, uint64_t bytes, uint64_t round) override;
  bool Arrived(int64_t sender, uint64_t round) const override;
  void Released(uint64_t round) override;

 private:
  int32_t rank_;
  Inbox* mine_;
  std::vector<Inbox*> peers_;
};

}  // namespace jax_moe::cpu
