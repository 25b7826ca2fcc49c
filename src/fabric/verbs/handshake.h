// The ibverbs connection data exchanged inside the engine handshake (Handshake::blob), and the
// per-NIC public address. Pure encoding: no device calls, unit-tested without an RDMA NIC.
//
// UD address (the engine's public per-NIC address):
//   u32 magic 'JMVU' | u8 gid[16] | u16 lid | u32 ud_qpn | u32 qkey | u8 port | u8 gid_index
// Connect blob (one entry per local NIC, the peer connects NIC i to its NIC i % its count):
//   u32 magic 'JMVC' | u16 version | u16 n | n x { u32 msg_qpn | u32 msg_psn | u32 rma_qpn |
//   u32 rma_psn | u8 mtu } | u64 fnv1a64
// Two RC QPs per peer and NIC: msg (SEND/RECV) and rma (WRITE_WITH_IMM), as in the issue.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace jax_moe::fabric::verbs {

struct UdAddress {
  static constexpr uint32_t kMagic = 0x55564d4a;  // "JMVU"
  std::array<uint8_t, 16> gid{};
  uint16_t lid = 0;
  uint32_t qpn = 0;
  uint32_t qkey = 0;
  uint8_t port = 1;
  uint8_t gid_index = 0;

  std::string Serialize() const;
  static UdAddress Parse(const std::string& bytes);  // throws kInvalidArgument
};

struct RcEndpointInfo {
  uint32_t msg_qpn = 0;
  uint32_t msg_psn = 0;
  uint32_t rma_qpn = 0;
  uint32_t rma_psn = 0;
  uint8_t mtu = 0;  // enum ibv_mtu value
};

struct ConnectBlob {
  static constexpr uint32_t kMagic = 0x43564d4a;  // "JMVC"
  static constexpr uint16_t kVersion = 1;
  std::vector<RcEndpointInfo> nics;

  std::string Serialize() const;
  static ConnectBlob Parse(const std::string& bytes);  // throws kInvalidArgument
};

// QP numbers and PSNs are 24-bit on the wire; anything wider is a forged or corrupted blob.
constexpr uint32_t kMax24 = 0xffffff;

}  // namespace jax_moe::fabric::verbs
