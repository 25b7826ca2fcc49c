#include "fabric/wire.h"

#include "common/bytes.h"
#include "common/error.h"

namespace jax_moe::fabric {
namespace {

constexpr size_t kMaxStr = 4096;

void Seal(ByteWriter& w) { w.Put<uint64_t>(Fnv1a64(w.str().data(), w.str().size())); }

void CheckSeal(ByteReader& r, const void* data, const std::string& what) {
  const size_t body = r.pos();
  uint64_t sum = r.Get<uint64_t>();
  Require(r.ok() && r.AtEnd(), what + "truncated or trailing bytes");
  Require(sum == Fnv1a64(data, body), what + "checksum mismatch (corrupted)");
}

}  // namespace

std::string EngineAddress::Serialize() const {
  ByteWriter w;
  w.Put<uint32_t>(kMagic);
  w.Put<uint16_t>(kVersion);
  w.Put<uint16_t>(static_cast<uint16_t>(nics.size()));
  w.Put<uint64_t>(nonce);
  w.PutBytes(provider);
  for (const auto& a : nics) w.PutBytes(a);
  Seal(w);
  return w.str();
}

EngineAddress EngineAddress::Parse(const std::string& bytes) {
  const std::string what = "invalid engine address: ";
  ByteReader r(bytes);
  Require(r.Get<uint32_t>() == kMagic && r.ok(), what + "bad magic (not a jax_moe engine address)");
  Require(r.Get<uint16_t>() == kVersion, what + "unsupported version");
  uint16_t n = r.Get<uint16_t>();
  Require(n >= 1 && n <= 64, what + "bad NIC count");
  EngineAddress a;
  a.nonce = r.Get<uint64_t>();
  a.provider = r.GetBytes(64);
  for (uint16_t i = 0; i < n; ++i) {
    a.nics.push_back(r.GetBytes(kMaxStr));
    Require(r.ok() && !a.nics.back().empty(), what + "bad NIC address");
  }
  CheckSeal(r, bytes.data(), what);
  return a;
}

std::string Handshake::Serialize() const {
  ByteWriter w;
  w.Put<uint32_t>(kMagic);
  w.Put<uint16_t>(kVersion);
  w.Put<uint8_t>(type);
  w.Put<uint64_t>(sender_nonce);
  w.Put<uint32_t>(your_peer_id);
  w.PutBytes(sender_address);
  w.PutBytes(blob);
  Seal(w);
  return w.str();
}

Handshake Handshake::Parse(const void* data, size_t size) {
  const std::string what = "invalid handshake: ";
  ByteReader r(data, size);
  Require(r.Get<uint32_t>() == kMagic && r.ok(), what + "bad magic");
  Require(r.Get<uint16_t>() == kVersion, what + "unsupported version");
  Handshake h;
  uint8_t t = r.Get<uint8_t>();
  Require(t >= kHello && t <= kVerifyReply, what + "bad type");
  h.type = static_cast<Type>(t);
  h.sender_nonce = r.Get<uint64_t>();
  h.your_peer_id = r.Get<uint32_t>();
  h.sender_address = r.GetBytes(kMaxStr);
  h.blob = r.GetBytes(kMaxStr);
  CheckSeal(r, data, what);
  return h;
}

}  // namespace jax_moe::fabric
