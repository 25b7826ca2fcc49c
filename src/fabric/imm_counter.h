// Counts arrived immediates per (user value, source peer) and lets threads wait for them.
//
// Arrival order is never assumed: counts only grow until a waiter consumes them, so immediates of
// round k+1 that land before round k was waited for stay banked for the next wait. Consumption in
// Wait() takes one immediate from each source in turn (lowest peer id first) so banked surplus of one
// fast peer is not spent before slower peers are drained. WaitFrom() is the exact form: one per named
// peer, which is what a proxy that knows the senders of a round should use.
#pragma once
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/deadline.h"

namespace jax_moe::fabric {

class ImmCounter {
 public:
  struct Arrival {
    uint32_t imm;  // user value
    uint32_t peer;
  };

  // Called by the progress thread with everything one poll produced; wakes waiters once.
  void AddBatch(const Arrival* arrivals, size_t n);
  void Add(uint32_t imm, uint32_t peer) {
    Arrival a{imm, peer};
    AddBatch(&a, 1);
  }

  // Waits until `count` immediates with value `imm` are banked, then consumes them and returns true.
  // On deadline (or Shutdown) returns false and leaves the counts untouched; `*seen` gets the banked
  // count per peer for the error message.
  bool Wait(uint32_t imm, uint64_t count, const Deadline& deadline, std::map<uint32_t, uint64_t>* seen);

  // Waits until every peer in `peers` has `per_peer` banked immediates `imm`; consumes exactly those.
  // On failure `*missing` lists the peers that were short.
  bool WaitFrom(uint32_t imm, const std::vector<uint32_t>& peers, uint64_t per_peer, const Deadline& deadline,
                std::vector<uint32_t>* missing);

  uint64_t Banked(uint32_t imm) const;
  // Drops every banked value v with (v & mask) == value (a gone user's); returns how many immediates.
  uint64_t Discard(uint32_t mask, uint32_t value);
  // Takes `count` banked `imm`s if there are that many; never waits (no condition-variable round trip).
  bool TryConsume(uint32_t imm, uint64_t count);
  // Wakes every waiter; later waits fail immediately.
  void Shutdown();
  // Wakes waiters so they re-check an external condition (e.g. a failed peer); counts unchanged.
  void Poke() { cv_.notify_all(); }
  // Threads blocked in Wait/WaitFrom now (the progress thread spins instead of napping while > 0).
  int waiters() const { return waiters_.load(std::memory_order_relaxed); }

 private:
  struct Entry {
    uint64_t total = 0;
    std::map<uint32_t, uint64_t> per_peer;  // ordered: consumption order is deterministic
  };
  void ConsumeLocked(Entry& e, uint64_t count);

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<uint32_t, Entry> entries_;
  bool shutdown_ = false;
  std::atomic<int> waiters_{0};
};

}  // namespace jax_moe::fabric
