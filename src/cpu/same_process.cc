#include "cpu/same_process.h"

#include <cstring>

namespace jax_moe::cpu {

Inbox::Inbox(const proxy::Lanes& l) : lanes(l), recv(l.buffer_bytes()) {
  arrived.reset(new std::atomic<uint64_t>[l.count * l.slots]);
  for (int64_t i = 0; i < l.count * l.slots; ++i) arrived[i].store(0);
  released.reset(new std::atomic<uint64_t>[l.count]);
  for (int64_t i = 0; i < l.count; ++i) released[i].store(0);
}

bool SameProcessPeers::CreditOk(int64_t peer, uint64_t round) const {
  const Inbox& q = *peers_[peer];
  return q.released[q.lanes.Lane(round)].load(std::memory_order_acquire) >= q.lanes.Earlier(round);
}

void SameProcessPeers::Deliver(int64_t peer, const uint8_t* src, uint64_t bytes, uint64_t round) {
  Inbox& q = *peers_[peer];
  if (src) std::memcpy(q.Region(round, rank_), src, bytes);
  q.arrived[q.lanes.Lane(round) * q.lanes.slots + rank_].store(round, std::memory_order_release);
}

bool SameProcessPeers::Arrived(int64_t sender, uint64_t round) const {
  return mine_->arrived[mine_->lanes.Lane(round) * mine_->lanes.slots + sender].load(std::memory_order_acquire) >=
         round;
}

void SameProcessPeers::Released(uint64_t round) {
  mine_->released[mine_->lanes.Lane(round)].fetch_add(1, std::memory_order_acq_rel);
}

}  // namespace jax_moe::cpu
