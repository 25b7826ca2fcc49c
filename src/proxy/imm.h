// Immediates of the protocol: what a write means (2 bits), the rank that wrote it (12 bits), the receive lane it is
// about (3 bits), which piece of a region it carries (3 bits, proxy/pieces.h) and the Communicator (12 bits). With
// rank, lane and piece in the value, arrivals and credits are counted per peer and lane without blocking.
#pragma once
#include <cstdint>

namespace jax_moe::proxy {

enum class ImmKind : uint32_t { kDispatchData = 0, kCombineData = 1, kDispatchCredit = 2, kCombineCredit = 3 };

constexpr uint32_t kCommIdBits = 12;
constexpr uint32_t kPieceBits = 3;
constexpr uint32_t kLaneBits = 3;
constexpr uint32_t kRankBits = 12;
constexpr int64_t kMaxRanks = int64_t(1) << kRankBits;
constexpr int64_t kMaxLanes = int64_t(1) << kLaneBits;
static_assert(2 + kRankBits + kLaneBits + kPieceBits + kCommIdBits == 32, "an immediate is 32 bits");

// piece: the piece's code (proxy/pieces.h PieceCode; 0 for a region written whole, and for credits).
constexpr uint32_t MakeImm(ImmKind kind, uint32_t comm_id, uint32_t rank, uint32_t lane, uint32_t piece = 0) {
  return (static_cast<uint32_t>(kind) << (kCommIdBits + kPieceBits + kLaneBits + kRankBits)) |
         ((rank & (kMaxRanks - 1)) << (kCommIdBits + kPieceBits + kLaneBits)) |
         ((lane & (kMaxLanes - 1)) << (kCommIdBits + kPieceBits)) |
         ((piece & ((1u << kPieceBits) - 1)) << kCommIdBits) | (comm_id & ((1u << kCommIdBits) - 1));
}

}  // namespace jax_moe::proxy
