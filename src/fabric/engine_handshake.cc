// EngineCore peers: the peer table, HELLO/ACK handshake, descriptor checks with their owners, peer failure.
#include "fabric/engine_core.h"

#include <chrono>

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"

namespace jax_moe::fabric {

namespace {

constexpr std::chrono::milliseconds kHelloResend(500);
constexpr double kControlTimeoutSeconds = 30.0;  // descriptor checks (CreatePeerSet has no timeout argument)

}  // namespace

PeerState& EngineCore::FindOrAddPeerLocked(const EngineAddress& addr, const std::string& raw) {
  auto it = peer_by_nonce_.find(addr.nonce);
  if (it != peer_by_nonce_.end()) return *peers_[it->second];
  if (peers_.size() >= kMaxPeers) Throw(ErrorCode::kInvalidArgument, "too many peers (max 4096)");
  auto p = std::make_unique<PeerState>();
  p->id = static_cast<uint32_t>(peers_.size());
  p->nonce = addr.nonce;
  p->address = raw;
  p->remote_num_nics = static_cast<int>(addr.nics.size());
  p->nic = static_cast<int>(p->id % num_nics_);
  p->remote_nic = p->nic % p->remote_num_nics;
  for (int i = 0; i < num_nics_; ++i) {
    p->dest.push_back(backend_->AddPeer(i, p->id, addr.nics[i % p->remote_num_nics]));
  }
  p->label = "peer " + std::to_string(p->id) + " (" + backend_->FormatAddress(0, addr.nics[0]) + ")";
  peer_by_nonce_[addr.nonce] = p->id;
  peers_.push_back(std::move(p));
  return *peers_.back();
}

void EngineCore::SendHandshake(PeerState& peer, Handshake::Type type) {
  Handshake h;
  h.type = type;
  h.sender_nonce = nonce_;
  h.your_peer_id = peer.id;
  h.sender_address = address_;
  h.blob = backend_->LocalConnectBlob(peer.id);
  OpContext* op = NewOp(OpContext::kSend, peer.id, 0);
  op->buffer = h.Serialize();
  pending_sends_.push_back({0, peer.dest[0], op, /*bootstrap=*/true});
}

void EngineCore::SendControl(uint32_t peer, Handshake::Type type, uint32_t id, const std::string& blob) {
  Handshake h;
  h.type = type;
  h.sender_nonce = nonce_;
  h.your_peer_id = id;
  h.sender_address = address_;
  h.blob = blob;
  uint64_t dest;
  {
    std::lock_guard<std::mutex> lock(mu_);
    dest = peers_[peer]->dest[0];
  }
  OpContext* op = NewOp(OpContext::kSend, peer, 0);
  op->buffer = h.Serialize();
  pending_sends_.push_back({0, dest, op, /*bootstrap=*/false});
}

uint32_t EngineCore::Connect(const std::string& address, double timeout_s) {
  CheckOpen();
  EngineAddress addr = EngineAddress::Parse(address);
  Require(addr.provider == caps_.provider,
          "connect: peer uses provider '" + addr.provider + "', this engine '" + caps_.provider + "'");
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = peer_by_nonce_.find(addr.nonce);
    if (it != peer_by_nonce_.end() && peers_[it->second]->ready) return it->second;
  }
  uint32_t id = 0;
  RunOnProgress([&] {
    std::lock_guard<std::mutex> lock(mu_);
    PeerState& p = FindOrAddPeerLocked(addr, address);
    id = p.id;
    if (!p.ready) {
      SendHandshake(p, Handshake::kHello);
      hello_resend_.push_back({p.id, std::chrono::steady_clock::now() + kHelloResend});
    }
  });
  Deadline deadline = Deadline::After(timeout_s);
  active_waiters_++;
  std::unique_lock<std::mutex> lock(mu_);
  PeerState& p = *peers_[id];
  bool ok = peers_cv_.wait_until(lock, deadline.at(), [&] { return p.ready || p.failed || closed_; });
  active_waiters_--;
  CheckOpen();
  if (p.failed) Throw(ErrorCode::kPeerFailed, "connect: " + p.label + " failed: " + p.failure);
  if (!ok) {
    Throw(ErrorCode::kTimeout, "connect: " + p.label + " did not answer the handshake within " +
                                   FormatSeconds(timeout_s));
  }
  return id;
}

void EngineCore::ResendHellos() {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < hello_resend_.size();) {
    PeerState& p = *peers_[hello_resend_[i].first];
    if (p.ready || p.failed) {
      hello_resend_[i] = hello_resend_.back();
      hello_resend_.pop_back();
      continue;
    }
    if (now >= hello_resend_[i].second) {
      SendHandshake(p, Handshake::kHello);
      hello_resend_[i].second = now + kHelloResend;
    }
    ++i;
  }
}

void EngineCore::OnMessage(int nic, const std::string& bytes) {
  Handshake h;
  EngineAddress addr;
  try {
    h = Handshake::Parse(bytes.data(), bytes.size());
    if (h.type == Handshake::kVerify || h.type == Handshake::kVerifyReply) {
      uint32_t peer;
      {
        std::lock_guard<std::mutex> lock(mu_);
        auto it = peer_by_nonce_.find(h.sender_nonce);
        Require(it != peer_by_nonce_.end(), "descriptor check from an unknown engine");
        peer = it->second;
        if (h.type == Handshake::kVerifyReply) {
          auto r = verify_requests_.find(h.your_peer_id);
          if (r != verify_requests_.end() && r->second.peer == peer) {
            r->second.done = true;
            r->second.rejection = h.blob;
          }
        }
      }
      if (h.type == Handshake::kVerify) {
        SendControl(peer, Handshake::kVerifyReply, h.your_peer_id, CheckOwnDescriptor(h.blob));
      } else {
        peers_cv_.notify_all();
      }
      return;
    }
    addr = EngineAddress::Parse(h.sender_address);
    Require(addr.nonce == h.sender_nonce, "handshake: sender nonce does not match its address");
    Require(addr.provider == backend_->provider(), "handshake: provider mismatch");
  } catch (const Error& e) {
    JAX_MOE_LOG(kWarn, "dropping control message on NIC %d: %s", int(nic), e.what());
    return;
  }
  PeerState* peer = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    try {
      peer = &FindOrAddPeerLocked(addr, h.sender_address);
      if (h.your_peer_id >= kMaxPeers) Throw(ErrorCode::kInvalidArgument, "handshake: bad peer id");
      peer->remote_peer_id = h.your_peer_id;
      backend_->LocalConnectBlob(peer->id);  // create transport state before accepting the peer's
      backend_->AcceptConnectBlob(peer->id, h.blob);
      peer->ready = true;
    } catch (const Error& e) {
      JAX_MOE_LOG(kWarn, "handshake from %s failed: %s", backend_->FormatAddress(0, addr.nics[0]).c_str(), e.what());
      return;
    }
  }
  peers_cv_.notify_all();
  if (h.type == Handshake::kHello) SendHandshake(*peer, Handshake::kAck);
}

std::string EngineCore::CheckOwnDescriptor(const std::string& bytes) const {
  RegionDescriptor d;
  try {
    d = RegionDescriptor::Parse(bytes);
  } catch (const Error& e) {
    return e.what();
  }
  if (d.owner != nonce_) return "descriptor names another engine";
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& kv : regions_) {
    const RegionDescriptor& mine = kv.second.descriptor;
    if (mine.base == d.base && mine.size == d.size && mine.flags == d.flags && mine.keys == d.keys) return "";
  }
  return Format("no live registered region matches (base 0x%llx, %llu bytes)",
                static_cast<unsigned long long>(d.base), static_cast<unsigned long long>(d.size));
}

void EngineCore::VerifyDescriptors(const std::vector<uint32_t>& peers, const std::vector<RegionDescriptor>& regions) {
  std::vector<uint32_t> ids;
  std::vector<size_t> index;
  std::vector<std::string> blobs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < peers.size(); ++i) {
      std::string blob = regions[i].Serialize();
      if (verified_.count({peers[i], blob})) continue;
      uint32_t id = next_verify_id_++;
      verify_requests_[id].peer = peers[i];
      ids.push_back(id);
      index.push_back(i);
      blobs.push_back(std::move(blob));
    }
  }
  if (ids.empty()) return;
  RunOnProgress([&] {
    for (size_t k = 0; k < ids.size(); ++k) SendControl(peers[index[k]], Handshake::kVerify, ids[k], blobs[k]);
  });
  Deadline deadline = Deadline::After(kControlTimeoutSeconds);
  active_waiters_++;
  std::unique_lock<std::mutex> lock(mu_);
  auto all_done = [&] {
    for (uint32_t id : ids) {
      const VerifyRequest& r = verify_requests_[id];
      if (!r.done && !peers_[r.peer]->failed) return false;
    }
    return true;
  };
  peers_cv_.wait_until(lock, deadline.at(), [&] { return all_done() || closed_; });
  active_waiters_--;
  std::vector<uint32_t> silent;
  std::string rejected;
  for (size_t k = 0; k < ids.size(); ++k) {
    VerifyRequest r = verify_requests_[ids[k]];
    verify_requests_.erase(ids[k]);
    if (!r.done) {
      silent.push_back(r.peer);
    } else if (!r.rejection.empty()) {
      if (rejected.empty()) {
        rejected = "descriptor " + std::to_string(index[k]) + " rejected by its owner " + PeerListLocked({r.peer}) +
                   ": " + r.rejection;
      }
    } else {
      verified_.insert({r.peer, blobs[k]});
    }
  }
  if (closed_) Throw(ErrorCode::kClosed, "TransferEngine is closed");
  if (!rejected.empty()) Throw(ErrorCode::kInvalidArgument, rejected);
  if (!silent.empty()) {
    Throw(ErrorCode::kTimeout, "descriptor check: no answer within " + FormatSeconds(kControlTimeoutSeconds) +
                                   " from " + PeerListLocked(silent));
  }
}

void EngineCore::FailPeer(uint32_t peer, const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (peer >= peers_.size()) return;
    PeerState& p = *peers_[peer];
    if (!p.failed.exchange(true)) {
      p.failure = why;
      JAX_MOE_LOG(kWarn, "%s failed: %s", p.label.c_str(), std::string(why).c_str());
    }
  }
  peers_cv_.notify_all();
  imms_.Poke();
}

std::string EngineCore::PeerListLocked(const std::vector<uint32_t>& peers) const {
  std::string out;
  for (uint32_t id : peers) {
    if (!out.empty()) out += ", ";
    if (id < peers_.size()) {
      out += peers_[id]->label;
      if (peers_[id]->failed) out += " [failed: " + peers_[id]->failure + "]";
    } else {
      out += "peer " + std::to_string(id) + " (unknown)";
    }
  }
  return out;
}

std::string EngineCore::PeerLabel(uint32_t peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return PeerListLocked({peer});
}

}  // namespace jax_moe::fabric
