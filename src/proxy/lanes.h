// Where a round lands in a receive buffer: K lanes x S regions, one per sender that writes there (RegionSlots says
// which region is whose). Round k (from 1) of a direction uses lane k % K; before writing round k into a receiver, a
// sender needs the receiver's credit for round k - K (it finished reading that lane). Computed alike by senders,
// receivers and the device side.
#pragma once
#include <cstdint>
#include <vector>

namespace jax_moe::proxy {

struct Lanes {
  int64_t slots = 1;          // S: regions per lane
  int64_t count = 1;          // K
  uint64_t region_bytes = 0;  // one sender's region: header, then rows

  int64_t Lane(uint64_t round) const { return int64_t(round % uint64_t(count)); }
  // Rounds of `round`'s lane before it.
  uint64_t Earlier(uint64_t round) const { return (round - 1) / uint64_t(count); }
  // Byte offset of the region in slot `slot` of `round` in a buffer.
  uint64_t Offset(uint64_t round, int64_t slot) const { return uint64_t(Lane(round) * slots + slot) * region_bytes; }
  uint64_t buffer_bytes() const { return uint64_t(count * slots) * region_bytes; }
};

// Which region of a rank's buffers belongs to which peer. Every rank: slot q is rank q's (the "cpu" backend, whose
// ranks of one process deliver into each other's buffers too). Other nodes only: a rank's buffers hold regions for
// the ranks on other nodes alone, in rank order (the GPU, whose same-node peers go over NVLink), so a receiver's
// slot count and a sender's slot there follow from every rank's node, which every rank knows.
class RegionSlots {
 public:
  static RegionSlots EveryRank(int64_t n) { return RegionSlots(std::vector<int32_t>(size_t(n), 0), false); }
  // node[p]: the node of rank p.
  static RegionSlots OtherNodes(std::vector<int32_t> node) { return RegionSlots(std::move(node), true); }

  int64_t num_ranks() const { return int64_t(node_.size()); }
  // Regions per lane in the buffers of `owner`.
  int64_t Slots(int64_t owner) const { return Slot(owner, num_ranks()); }
  // The slot of `peer`'s region in the buffers of `owner` (peer == num_ranks: the count); -1 where it has none.
  int64_t Slot(int64_t owner, int64_t peer) const {
    if (!other_nodes_) return peer;
    if (peer < num_ranks() && node_[size_t(peer)] == node_[size_t(owner)]) return -1;
    int64_t s = 0;
    for (int64_t r = 0; r < peer; ++r) s += node_[size_t(r)] != node_[size_t(owner)];
    return s;
  }

 private:
  RegionSlots(std::vector<int32_t> node, bool other_nodes) : node_(std::move(node)), other_nodes_(other_nodes) {}
  std::vector<int32_t> node_;
  bool other_nodes_;
};

}  // namespace jax_moe::proxy
