// The header at the start of every per-sender region: who wrote it, for which round, and how many rows follow.
// Receivers check everything in it before use: a peer can never make them read or write outside a buffer.
#pragma once
#include <cstdint>
#include <string>

#include "proxy/moe_shape.h"

namespace jax_moe::proxy {

constexpr uint32_t kRegionMagic = 0x4a4d4f45;  // "JMOE"

// Error codes a sender reports to every receiver, so that all ranks fail together instead of timing out.
enum class SenderError : int32_t { kNone = 0, kExpertOutOfRange = 1 };

struct RegionHeader {
  uint32_t magic;
  uint32_t comm_id;     // the Communicator's id
  uint64_t seq;         // round number of this direction (dispatch or combine), from 1
  int32_t sender;       // rank that wrote the region
  int32_t error;        // SenderError
  int64_t error_value;  // e.g. the offending expert id
  int32_t rows;         // rows that follow the header
  int32_t pad;
  // followed by int32 counts[L] (dispatch only), then rows at RegionHeaderBytes()
};
static_assert(sizeof(RegionHeader) == 40, "wire layout");

JAX_MOE_HD inline uint64_t RegionHeaderBytes(const MoeShape& s) {
  return AlignUp(sizeof(RegionHeader) + 4 * uint64_t(s.local_experts), 64);
}

JAX_MOE_HD inline int32_t* HeaderCounts(RegionHeader* h) { return reinterpret_cast<int32_t*>(h + 1); }
JAX_MOE_HD inline const int32_t* HeaderCounts(const RegionHeader* h) { return reinterpret_cast<const int32_t*>(h + 1); }

// Empty string when `h` is a well-formed region of round `seq` from `sender`; else what is wrong.
std::string CheckHeader(const RegionHeader& h, const MoeShape& s, uint32_t comm_id, uint64_t seq, int32_t sender,
                        bool has_counts);

}  // namespace jax_moe::proxy
