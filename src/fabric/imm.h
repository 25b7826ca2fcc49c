// Bit layout of the 32-bit immediate carried by every write (remote CQ data / IBV_WR_RDMA_WRITE_WITH_IMM).
//
//   31            20 19                         0
//  +----------------+----------------------------+
//  |  sender slot   |        user value          |
//  +----------------+----------------------------+
//
// The sender slot is the id the *receiver* gave the sender during the handshake, so a receiver learns
// who wrote without relying on FI_SOURCE (tcp;ofi_rxm does not provide it). The user value is what
// write()/scatter()/barrier() were given and what wait_imm() waits for.
#pragma once
#include <cstdint>

namespace jax_moe::fabric {

constexpr int kImmUserBits = 20;
constexpr uint32_t kMaxUserImm = (1u << kImmUserBits) - 1;  // 1048575
constexpr uint32_t kMaxPeers = 1u << (32 - kImmUserBits);   // 4096 peers per engine

constexpr uint32_t EncodeImm(uint32_t sender_slot, uint32_t user) {
  return (sender_slot << kImmUserBits) | (user & kMaxUserImm);
}
constexpr uint32_t ImmSlot(uint32_t imm) { return imm >> kImmUserBits; }
constexpr uint32_t ImmUser(uint32_t imm) { return imm & kMaxUserImm; }

}  // namespace jax_moe::fabric
