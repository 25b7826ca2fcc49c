// Where a round lands in a receive buffer: K lanes x N per-sender regions. Round k (from 1) of a direction uses lane
// k % K; before writing round k into a receiver, a sender needs the receiver's credit for round k - K (it finished
// reading that lane). Computed alike by senders, receivers and the device side.
#pragma once
#include <cstdint>

namespace jax_moe::proxy {

struct Lanes {
  int64_t num_ranks = 1;      // N: regions per lane, one per sender
  int64_t count = 1;          // K
  uint64_t region_bytes = 0;  // one sender's region: header, then rows

  int64_t Lane(uint64_t round) const { return int64_t(round % uint64_t(count)); }
  // Rounds of `round`'s lane before it.
  uint64_t Earlier(uint64_t round) const { return (round - 1) / uint64_t(count); }
  // Byte offset of `sender`'s region of `round` in the receiver's buffer.
  uint64_t Offset(uint64_t round, int64_t sender) const {
    return uint64_t(Lane(round) * num_ranks + sender) * region_bytes;
  }
  uint64_t buffer_bytes() const { return uint64_t(count * num_ranks) * region_bytes; }
};

}  // namespace jax_moe::proxy
