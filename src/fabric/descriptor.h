// A registered region as seen by the peers that write into it. It travels out of band as bytes
// (Serialize/Parse) and is checked on receipt: magic, version, exact length, checksum, sane sizes.
//
// Wire format (little endian):
//   u32 magic 'JMRD' | u16 version | u16 num_nics | u64 owner (engine nonce) | u64 base | u64 size |
//   u32 flags | u64 key[num_nics] | u64 fnv1a64(all previous bytes)
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace jax_moe::fabric {

struct RegionDescriptor {
  static constexpr uint32_t kMagic = 0x44524d4a;  // "JMRD"
  static constexpr uint16_t kVersion = 1;
  static constexpr uint32_t kFlagDevice = 1;  // CUDA device memory
  static constexpr size_t kMaxNics = 64;

  uint64_t owner = 0;  // nonce of the engine that registered it
  uint64_t base = 0;   // virtual address in the owner's process
  uint64_t size = 0;   // bytes
  uint32_t flags = 0;
  std::vector<uint64_t> keys;  // remote key per NIC (domain) of the owner

  std::string Serialize() const;
  // Throws Error(kInvalidArgument) describing what is wrong.
  static RegionDescriptor Parse(const std::string& bytes);

  // True when [offset, offset + length) lies inside the region (overflow-safe).
  bool Contains(uint64_t offset, uint64_t length) const { return offset <= size && length <= size - offset; }
};

}  // namespace jax_moe::fabric
