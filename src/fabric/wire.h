// Engine addresses and the handshake message, both exchanged as bytes.
//
// Engine address: u32 magic 'JMEA' | u16 version | u16 num_nics | u64 nonce | str provider |
//                 str nic_address[num_nics] | u64 fnv1a64        (str = u16 length + bytes)
// Handshake:      u32 magic 'JMHS' | u16 version | u8 type | u64 sender nonce | u32 your_peer_id |
//                 str sender engine address | str transport blob | u64 fnv1a64
// Hello/Ack: `your_peer_id` is the id the sender gave the receiver; the receiver stamps it into the immediates
// it sends back (imm.h). The transport blob carries backend connection data (verbs: RC QP numbers).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace jax_moe::fabric {

struct EngineAddress {
  static constexpr uint32_t kMagic = 0x41454d4a;  // "JMEA"
  static constexpr uint16_t kVersion = 1;
  uint64_t nonce = 0;
  std::string provider;
  std::vector<std::string> nics;  // raw per-NIC endpoint addresses

  std::string Serialize() const;
  static EngineAddress Parse(const std::string& bytes);  // throws kInvalidArgument
};

struct Handshake {
  static constexpr uint32_t kMagic = 0x53484d4a;  // "JMHS"
  static constexpr uint16_t kVersion = 1;
  // kVerify asks the owner whether a descriptor (in blob) names one of its live regions; the reply
  // echoes the request id in your_peer_id and carries an empty blob (yes) or the reason (no).
  enum Type : uint8_t { kHello = 1, kAck = 2, kVerify = 3, kVerifyReply = 4 };
  Type type = kHello;
  uint64_t sender_nonce = 0;
  uint32_t your_peer_id = 0;
  std::string sender_address;  // serialized EngineAddress
  std::string blob;

  std::string Serialize() const;
  static Handshake Parse(const void* data, size_t size);  // throws kInvalidArgument
};

}  // namespace jax_moe::fabric
