#include "fabric/descriptor.h"

#include "common/bytes.h"
#include "common/error.h"

namespace jax_moe::fabric {

std::string RegionDescriptor::Serialize() const {
  ByteWriter w;
  w.Put<uint32_t>(kMagic);
  w.Put<uint16_t>(kVersion);
  w.Put<uint16_t>(static_cast<uint16_t>(keys.size()));
  w.Put<uint64_t>(owner);
  w.Put<uint64_t>(base);
  w.Put<uint64_t>(size);
  w.Put<uint32_t>(flags);
  for (uint64_t k : keys) w.Put<uint64_t>(k);
  w.Put<uint64_t>(Fnv1a64(w.str().data(), w.str().size()));
  return w.str();
}

RegionDescriptor RegionDescriptor::Parse(const std::string& bytes) {
  const std::string what = "invalid region descriptor: ";
  ByteReader r(bytes);
  Require(r.Get<uint32_t>() == kMagic && r.ok(), what + "bad magic (not a jax_moe descriptor)");
  uint16_t version = r.Get<uint16_t>();
  Require(version == kVersion, what + "unsupported version " + std::to_string(version));
  uint16_t n = r.Get<uint16_t>();
  Require(n >= 1 && n <= kMaxNics, what + "bad NIC count " + std::to_string(n));
  const size_t expected = 4 + 2 + 2 + 8 + 8 + 8 + 4 + 8 * size_t(n) + 8;
  Require(bytes.size() == expected, what + "length " + std::to_string(bytes.size()) + ", expected " +
                                        std::to_string(expected));
  RegionDescriptor d;
  d.owner = r.Get<uint64_t>();
  d.base = r.Get<uint64_t>();
  d.size = r.Get<uint64_t>();
  d.flags = r.Get<uint32_t>();
  for (uint16_t i = 0; i < n; ++i) d.keys.push_back(r.Get<uint64_t>());
  const size_t body = r.pos();
  uint64_t sum = r.Get<uint64_t>();
  Require(r.ok() && r.AtEnd(), what + "truncated");
  Require(sum == Fnv1a64(bytes.data(), body), what + "checksum mismatch (corrupted)");
  Require(d.size > 0, what + "empty region");
  Require(d.base + d.size >= d.base, what + "region wraps the address space");
  Require((d.flags & ~kFlagDevice) == 0, what + "unknown flags");
  return d;
}

}  // namespace jax_moe::fabric
