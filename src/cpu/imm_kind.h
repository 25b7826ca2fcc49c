// Immediates of the CPU protocol: what a write means (2 bits) and which Communicator it belongs to (18 bits).
// One TransferEngine serves one device, so the sending peer identifies the sending rank.
#pragma once
#include <cstdint>

namespace jax_moe::cpu {

enum class ImmKind : uint32_t { kDispatchData = 0, kCombineData = 1, kDispatchCredit = 2, kCombineCredit = 3 };

constexpr uint32_t kCommSlotBits = 18;

constexpr uint32_t MakeImm(ImmKind kind, uint32_t comm_slot) {
  return (static_cast<uint32_t>(kind) << kCommSlotBits) | (comm_slot & ((1u << kCommSlotBits) - 1));
}

}  // namespace jax_moe::cpu
