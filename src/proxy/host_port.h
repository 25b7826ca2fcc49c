// A host rank's door to the ranks of other processes (the "cpu" backend): its device's shared TransferEngine, the
// registration of its receive buffers, and its channels' connections to the remote ranks, in terms of addresses and
// descriptors as strings, so that the backend above never holds a fabric type (data flows fabric -> proxy -> cpu).
#pragma once
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "proxy/channel.h"

namespace jax_moe::proxy {

class HostPort {
 public:
  // The process's engine for `key` on `provider` (proxy/engine_pool.h), for host memory only: the buffers are host
  // memory, so shm keeps its single-copy path. Refused unless the provider carries 32-bit immediates.
  HostPort(const std::string& key, const std::string& provider);
  HostPort(const HostPort&) = delete;
  HostPort& operator=(const HostPort&) = delete;

  std::string Address() const;
  // Registers [data, data + bytes) for the remote ranks' writes and returns what they need to reach it.
  std::string Register(uint8_t* data, uint64_t bytes);
  // A channel whose ranks in other processes this port serves (the others through `local`).
  std::unique_ptr<Channel> NewChannel(const ChannelConfig& config, const std::vector<bool>& remote, SameProcess* local,
                                      Allocate allocate, std::mutex& mu, std::condition_variable& cv);
  // One remote rank: its engine's address, and one receive-buffer descriptor per channel (in Connect's order).
  struct RemoteEnd {
    int32_t rank = 0;
    std::string address;
    std::vector<std::string> descriptors;
  };
  // Connects `channels` (sharing their remote ranks; registered in the same order as Register was called) to `ends`,
  // one per remote rank in channels[0]->remote_ranks() order. A remote buffer of another size than ours is refused:
  // the "cpu" backend's buffers hold a region per rank (RegionSlots::EveryRank), the same on every rank.
  void Connect(const std::vector<Channel*>& channels, const std::vector<RemoteEnd>& ends, double timeout_s);
  // Waits (at most bound_s) until the engine's writes in flight completed; throws when a peer failed.
  void WaitSends(double bound_s);

 private:
  std::shared_ptr<fabric::TransferEngine> engine_;
  std::vector<std::shared_ptr<fabric::MemoryRegion>> regions_;  // in Register order
};

}  // namespace jax_moe::proxy
