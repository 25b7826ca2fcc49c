// How a write's immediate names its sender. User immediates are full 32-bit values wherever the
// transport can identify the sender another way:
//   - remote CQ data of 8 bytes (tcp, shm): data = sender_peer_id << 32 | user (ImmMode::kWide);
//   - FI_SOURCE (efa): fi_cq_readfrom gives the sender's address (ImmMode::kSource);
//   - verbs RC: the completion's QP number identifies the sender (ImmMode::kSource).
// Only a provider with 4-byte CQ data and no FI_SOURCE falls back to packing both into 32 bits
// (ImmMode::kPacked), which limits user values to 20 bits:
//
//   31            20 19                         0
//  +----------------+----------------------------+
//  | sender peer id |        user value          |
//  +----------------+----------------------------+
//
// The sender peer id is the id the *receiver* gave the sender during the handshake, so a receiver
// learns who wrote without relying on FI_SOURCE (tcp;ofi_rxm does not provide it). The user value is
// what write()/scatter()/barrier() were given and what wait_imm() waits for.
#pragma once
#include <cstdint>

namespace jax_moe::fabric {

enum class ImmMode { kWide, kSource, kPacked };

constexpr int kImmUserBits = 20;
constexpr uint32_t kMaxWideImm = 0xffffffffu;
constexpr uint32_t kMaxPackedImm = (1u << kImmUserBits) - 1;  // 1048575
constexpr uint32_t kMaxPeers = 1u << (32 - kImmUserBits);   // 4096 peers per engine (a peer id fits all modes)
constexpr uint32_t kUnknownPeer = 0xffffffffu;

constexpr uint32_t EncodeImm(uint32_t sender_peer_id, uint32_t user) {
  return (sender_peer_id << kImmUserBits) | (user & kMaxPackedImm);
}
constexpr uint32_t ImmPeerId(uint32_t imm) { return imm >> kImmUserBits; }
constexpr uint32_t ImmUser(uint32_t imm) { return imm & kMaxPackedImm; }

}  // namespace jax_moe::fabric
