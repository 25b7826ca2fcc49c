#include "proxy/region_header.h"

namespace jax_moe::proxy {

std::string CheckHeader(const RegionHeader& h, const MoeShape& s, uint32_t comm_id, uint64_t seq, int32_t sender,
                        bool has_counts) {
  const std::string who = "rank " + std::to_string(sender);
  if (h.magic != kRegionMagic) return who + " sent a region without the jax_moe magic";
  if (h.comm_id != comm_id) return who + " sent a region of another Communicator (id " + std::to_string(h.comm_id) + ")";
  if (h.sender != sender) return who + "'s region claims to come from rank " + std::to_string(h.sender);
  if (h.seq != seq) {
    return who + " sent round " + std::to_string(h.seq) + " where round " + std::to_string(seq) +
           " was expected (ranks called dispatch/combine in different orders)";
  }
  if (h.rows < 0 || h.rows > s.rows_per_peer()) {
    return who + " announced " + std::to_string(h.rows) + " rows, more than the " + std::to_string(s.rows_per_peer()) +
           " a region holds";
  }
  if (has_counts) {
    int64_t total = 0;
    const int32_t* counts = HeaderCounts(&h);
    for (int64_t e = 0; e < s.local_experts; ++e) {
      if (counts[e] < 0) return who + " sent a negative expert count";
      total += counts[e];
    }
    if (total != h.rows) return who + " sent expert counts that do not add up to its row count";
  }
  return {};
}

}  // namespace jax_moe::proxy
