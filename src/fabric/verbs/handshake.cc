#include "fabric/verbs/handshake.h"

#include "common/bytes.h"
#include "common/error.h"

namespace jax_moe::fabric::verbs {

std::string UdAddress::Serialize() const {
  ByteWriter w;
  w.Put<uint32_t>(kMagic);
  for (uint8_t b : gid) w.Put<uint8_t>(b);
  w.Put<uint16_t>(lid);
  w.Put<uint32_t>(qpn);
  w.Put<uint32_t>(qkey);
  w.Put<uint8_t>(port);
  w.Put<uint8_t>(gid_index);
  return w.str();
}

UdAddress UdAddress::Parse(const std::string& bytes) {
  ByteReader r(bytes);
  Require(r.Get<uint32_t>() == kMagic && r.ok(), "verbs UD address: bad magic");
  UdAddress a;
  for (auto& b : a.gid) b = r.Get<uint8_t>();
  a.lid = r.Get<uint16_t>();
  a.qpn = r.Get<uint32_t>();
  a.qkey = r.Get<uint32_t>();
  a.port = r.Get<uint8_t>();
  a.gid_index = r.Get<uint8_t>();
  Require(r.ok() && r.AtEnd(), "verbs UD address: wrong length");
  Require(a.qpn <= kMax24 && a.qpn != 0, "verbs UD address: bad QP number");
  Require(a.port >= 1, "verbs UD address: bad port");
  return a;
}

std::string ConnectBlob::Serialize() const {
  ByteWriter w;
  w.Put<uint32_t>(kMagic);
  w.Put<uint16_t>(kVersion);
  w.Put<uint16_t>(static_cast<uint16_t>(nics.size()));
  for (const auto& n : nics) {
    w.Put<uint32_t>(n.msg_qpn);
    w.Put<uint32_t>(n.msg_psn);
    w.Put<uint32_t>(n.rma_qpn);
    w.Put<uint32_t>(n.rma_psn);
    w.Put<uint8_t>(n.mtu);
  }
  w.Put<uint64_t>(Fnv1a64(w.str().data(), w.str().size()));
  return w.str();
}

ConnectBlob ConnectBlob::Parse(const std::string& bytes) {
  const std::string what = "verbs connect blob: ";
  ByteReader r(bytes);
  Require(r.Get<uint32_t>() == kMagic && r.ok(), what + "bad magic");
  Require(r.Get<uint16_t>() == kVersion, what + "unsupported version");
  uint16_t n = r.Get<uint16_t>();
  Require(n >= 1 && n <= 64, what + "bad NIC count");
  ConnectBlob b;
  for (uint16_t i = 0; i < n; ++i) {
    RcEndpointInfo e;
    e.msg_qpn = r.Get<uint32_t>();
    e.msg_psn = r.Get<uint32_t>();
    e.rma_qpn = r.Get<uint32_t>();
    e.rma_psn = r.Get<uint32_t>();
    e.mtu = r.Get<uint8_t>();
    Require(e.msg_qpn <= kMax24 && e.rma_qpn <= kMax24 && e.msg_psn <= kMax24 && e.rma_psn <= kMax24,
            what + "QP number or PSN wider than 24 bits");
    Require(e.mtu >= 1 && e.mtu <= 5, what + "bad MTU");
    b.nics.push_back(e);
  }
  const size_t body = r.pos();
  uint64_t sum = r.Get<uint64_t>();
  Require(r.ok() && r.AtEnd(), what + "truncated or trailing bytes");
  Require(sum == Fnv1a64(bytes.data(), body), what + "checksum mismatch");
  return b;
}

}  // namespace jax_moe::fabric::verbs
