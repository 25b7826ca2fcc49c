#include "fabric/imm_counter.h"

namespace jax_moe::fabric {

void ImmCounter::AddBatch(const Arrival* arrivals, size_t n) {
  if (n == 0) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      Entry& e = entries_[arrivals[i].imm];
      e.total++;
      e.per_peer[arrivals[i].peer]++;
    }
  }
  cv_.notify_all();
}

void ImmCounter::ConsumeLocked(Entry& e, uint64_t count) {
  // Round-robin over sources: one from each peer with a banked immediate, until `count` are taken.
  while (count > 0) {
    for (auto it = e.per_peer.begin(); it != e.per_peer.end() && count > 0;) {
      it->second--;
      e.total--;
      count--;
      it = it->second == 0 ? e.per_peer.erase(it) : std::next(it);
    }
  }
}

bool ImmCounter::Wait(uint32_t imm, uint64_t count, const Deadline& deadline, std::map<uint32_t, uint64_t>* seen) {
  std::unique_lock<std::mutex> lock(mu_);
  waiters_++;
  auto ready = [&] {
    if (shutdown_) return true;
    auto it = entries_.find(imm);
    return count == 0 || (it != entries_.end() && it->second.total >= count);
  };
  bool ok = cv_.wait_until(lock, deadline.at(), ready) && !shutdown_;
  waiters_--;
  auto it = entries_.find(imm);
  if (!ok) {
    if (seen != nullptr) {
      seen->clear();
      if (it != entries_.end()) *seen = it->second.per_peer;
    }
    return false;
  }
  if (count > 0) {
    ConsumeLocked(it->second, count);
    if (it->second.total == 0) entries_.erase(it);
  }
  return true;
}

bool ImmCounter::TryConsume(uint32_t imm, uint64_t count) {
  std::lock_guard<std::mutex> lock(mu_);
  if (shutdown_) return false;
  if (count == 0) return true;
  auto it = entries_.find(imm);
  if (it == entries_.end() || it->second.total < count) return false;
  ConsumeLocked(it->second, count);
  if (it->second.total == 0) entries_.erase(it);
  return true;
}

bool ImmCounter::WaitFrom(uint32_t imm, const std::vector<uint32_t>& peers, uint64_t per_peer,
                          const Deadline& deadline, std::vector<uint32_t>* missing) {
  std::unique_lock<std::mutex> lock(mu_);
  waiters_++;
  auto short_peers = [&](std::vector<uint32_t>* out) {
    auto it = entries_.find(imm);
    bool all = true;
    for (uint32_t p : peers) {
      uint64_t have = 0;
      if (it != entries_.end()) {
        auto pit = it->second.per_peer.find(p);
        if (pit != it->second.per_peer.end()) have = pit->second;
      }
      if (have < per_peer) {
        all = false;
        if (out) out->push_back(p);
      }
    }
    return all;
  };
  bool ok = cv_.wait_until(lock, deadline.at(), [&] { return shutdown_ || short_peers(nullptr); }) && !shutdown_;
  waiters_--;
  if (!ok) {
    if (missing != nullptr) {
      missing->clear();
      short_peers(missing);
    }
    return false;
  }
  if (per_peer > 0 && !peers.empty()) {
    Entry& e = entries_[imm];
    for (uint32_t p : peers) {
      auto pit = e.per_peer.find(p);
      pit->second -= per_peer;
      e.total -= per_peer;
      if (pit->second == 0) e.per_peer.erase(pit);
    }
    if (e.total == 0) entries_.erase(imm);
  }
  return true;
}

uint64_t ImmCounter::Banked(uint32_t imm) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(imm);
  return it == entries_.end() ? 0 : it->second.total;
}

uint64_t ImmCounter::Discard(uint32_t mask, uint32_t value) {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t dropped = 0;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if ((it->first & mask) == value) {
      dropped += it->second.total;
      it = entries_.erase(it);
    } else {
      ++it;
    }
  }
  return dropped;
}

void ImmCounter::Shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    shutdown_ = true;
  }
  cv_.notify_all();
}


}  // namespace jax_moe::fabric
