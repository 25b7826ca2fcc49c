#include "proxy/host_port.h"

#include "common/error.h"
#include "proxy/engine_pool.h"

namespace jax_moe::proxy {

HostPort::HostPort(const std::string& key, const std::string& provider) {
  fabric::EngineOptions options;
  options.host_memory_only = true;
  engine_ = AcquireEngine(key, provider, options);
  Require(engine_->max_imm() == UINT32_MAX, "the fabric provider carries " + std::to_string(engine_->max_imm()) +
                                                " as its largest immediate; the cpu backend needs 32-bit immediates");
}

std::string HostPort::Address() const { return engine_->Address(); }

std::string HostPort::Register(uint8_t* data, uint64_t bytes) {
  regions_.push_back(engine_->Register(data, bytes));
  return regions_.back()->descriptor().Serialize();
}

std::unique_ptr<Channel> HostPort::NewChannel(const ChannelConfig& config, const std::vector<bool>& remote,
                                              SameProcess* local, Allocate allocate, std::mutex& mu,
                                              std::condition_variable& cv) {
  return std::make_unique<Channel>(config, remote, engine_, local, std::move(allocate), mu, cv);
}

void HostPort::Connect(const std::vector<Channel*>& channels, const std::vector<RemoteEnd>& ends, double timeout_s) {
  Require(!channels.empty() && channels.size() <= regions_.size(), "HostPort: a channel without a registration");
  const std::vector<int32_t>& ranks = channels[0]->remote_ranks();
  Require(ends.size() == ranks.size(), "HostPort: one end per remote rank");
  std::vector<fabric::PeerId> peers;
  std::vector<std::vector<fabric::RegionDescriptor>> regions(channels.size());
  for (size_t i = 0; i < ends.size(); ++i) {
    const RemoteEnd& e = ends[i];
    Require(e.rank == ranks[i] && e.descriptors.size() == channels.size(),
            "HostPort: the ends must follow the remote ranks, with one descriptor per channel");
    peers.push_back(engine_->Connect(e.address, timeout_s));
    for (size_t j = 0; j < channels.size(); ++j) {
      regions[j].push_back(fabric::RegionDescriptor::Parse(e.descriptors[j]));
      Require(regions[j].back().size == regions_[j]->size(),
              "rank " + std::to_string(e.rank) + " registered buffers of another size (configs differ?)");
    }
  }
  for (size_t j = 0; j < channels.size(); ++j) channels[j]->Connect(peers, std::move(regions[j]));
}

void HostPort::WaitSends(double bound_s) { engine_->WaitSends(bound_s); }

}  // namespace jax_moe::proxy
