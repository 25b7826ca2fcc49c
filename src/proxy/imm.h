// Immediates of the protocol: what a write means (2 bits), the rank that wrote it (12 bits), the receive lane it is
// about (3 bits) and the Communicator (15 bits). With rank and lane in the value, arrivals and credits are counted
// per peer and lane without blocking.
#pragma once
#include <cstdint>

namespace jax_moe::proxy {

enum class ImmKind : uint32_t { kDispatchData = 0, kCombineData = 1, kDispatchCredit = 2, kCombineCredit = 3 };

constexpr uint32_t kCommIdBits = 15;
constexpr uint32_t kLaneBits = 3;
constexpr uint32_t kRankBits = 12;
constexpr int64_t kMaxRanks = int64_t(1) << kRankBits;
constexpr int64_t kMaxLanes = int64_t(1) << kLaneBits;

constexpr uint32_t MakeImm(ImmKind kind, uint32_t comm_id, uint32_t rank, uint32_t lane) {
  return (static_cast<uint32_t>(kind) << (kCommIdBits + kLaneBits + kRankBits)) |
         ((rank & (kMaxRanks - 1)) << (kCommIdBits + kLaneBits)) | ((lane & (kMaxLanes - 1)) << kCommIdBits) |
         (comm_id & ((1u << kCommIdBits) - 1));
}

}  // namespace jax_moe::proxy
