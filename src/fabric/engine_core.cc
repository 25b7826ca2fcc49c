#include "fabric/engine_core.h"

#include <pthread.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <random>
#include <set>

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"

namespace jax_moe::fabric {

struct CallState {
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

namespace {

constexpr size_t kRecvBuffers = 32;
constexpr size_t kRecvBytes = 16384;
constexpr size_t kPollBatch = 64;
constexpr std::chrono::milliseconds kHelloResend(500);
constexpr double kControlTimeoutSeconds = 30.0;  // descriptor checks (peer_group has no timeout argument)

uint64_t MakeNonce() {
  std::random_device rd;
  uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd() ^ (t * 0x9e3779b97f4a7c15ull) ^
               (static_cast<uint64_t>(getpid()) << 17);
  return v == 0 ? 1 : v;
}

std::string FormatSeconds(double s) { return Format("%.3g s", s); }

}  // namespace

EngineCore::EngineCore(const EngineOptions& options) : options_(options) {
  Require(options.num_nics >= 1 && options.num_nics <= 16, "num_nics must be in [1, 16]");
  backend_ = OpenBackend(options.provider, options.num_nics);
  num_nics_ = backend_->num_nics();
  caps_.provider = backend_->provider();
  caps_.max_imm = backend_->max_imm();
  caps_.max_write_bytes = backend_->max_write_bytes();
  caps_.remote_virt_addr = backend_->remote_virt_addr();
  caps_.device_memory = backend_->supports_device_memory();
  nonce_ = MakeNonce();
  EngineAddress addr;
  addr.nonce = nonce_;
  addr.provider = backend_->provider();
  for (int i = 0; i < num_nics_; ++i) addr.nics.push_back(backend_->NicAddress(i));
  address_ = addr.Serialize();
  imms_per_nic_ = std::vector<std::atomic<uint64_t>>(num_nics_);
}

EngineCore::~EngineCore() { Close(); }

void EngineCore::Start() {
  thread_ = std::thread([this] { ProgressLoop(); });
}

void EngineCore::CheckImm(uint64_t imm) const {
  const uint32_t max = caps_.max_imm;
  Require(imm <= max, "imm " + std::to_string(imm) + " out of range: this provider carries immediates in [0, " +
                          std::to_string(max) + "]");
}

void EngineCore::CheckOpen() const {
  if (closed_.load()) Throw(ErrorCode::kClosed, "TransferEngine is closed");
}

void EngineCore::Close() {
  if (closed_.exchange(true)) return;
  stop_ = true;
  sq_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  imms_.Shutdown();
  {
    std::lock_guard<std::mutex> lock(sq_mu_);
    for (auto& call : sq_calls_) {
      std::lock_guard<std::mutex> l(call.state->mu);
      call.state->error = std::make_exception_ptr(Error(ErrorCode::kClosed, "TransferEngine is closed"));
      call.state->done = true;
      call.state->cv.notify_all();
    }
    sq_calls_.clear();
    sq_writes_.clear();
  }
  peers_cv_.notify_all();
  sends_cv_.notify_all();
  std::lock_guard<std::mutex> lock(mu_);
  regions_.clear();  // closes memory registrations before their domains
  backend_.reset();
  backlog_.clear();
  pending_sends_.clear();
  free_ops_.clear();
  all_ops_.clear();
}

void EngineCore::RunOnProgress(std::function<void()> fn) {
  CheckOpen();
  auto state = std::make_shared<CallState>();
  {
    std::lock_guard<std::mutex> lock(sq_mu_);
    // Checked under sq_mu_: Close() fails queued calls under it after the thread stopped.
    if (stop_.load()) Throw(ErrorCode::kClosed, "TransferEngine is closed");
    sq_calls_.push_back({std::move(fn), state});
    sq_nonempty_ = true;
  }
  sq_cv_.notify_one();
  std::unique_lock<std::mutex> lock(state->mu);
  state->cv.wait(lock, [&] { return state->done; });
  if (state->error) std::rethrow_exception(state->error);
}

void EngineCore::Submit(std::vector<PendingWrite>&& writes) {
  {
    std::lock_guard<std::mutex> lock(sq_mu_);
    if (sq_writes_.empty()) {
      sq_writes_ = std::move(writes);
    } else {
      sq_writes_.insert(sq_writes_.end(), writes.begin(), writes.end());
    }
    sq_nonempty_ = true;
  }
  sq_cv_.notify_one();
}

// ---------------------------------------------------------------------------------------------------
// Registration

std::shared_ptr<MemoryRegion> EngineCore::Register(void* ptr, uint64_t nbytes, int device) {
  CheckOpen();
  Require(ptr != nullptr, "register: null pointer");
  Require(nbytes > 0, "register: empty region");
  Require(reinterpret_cast<uint64_t>(ptr) + nbytes >= reinterpret_cast<uint64_t>(ptr), "register: region wraps");
  if (device >= 0 && !caps_.device_memory) {
    Throw(ErrorCode::kUnavailable, "register: provider '" + caps_.provider +
                                       "' cannot register CUDA device memory (no FI_HMEM support)");
  }
  std::unique_ptr<BackendRegion> br;
  RunOnProgress([&] { br = backend_->Register(ptr, nbytes, device); });
  std::shared_ptr<MemoryRegion> mr(new MemoryRegion());
  mr->core_ = weak_from_this();
  mr->ptr_ = ptr;
  mr->size_ = nbytes;
  mr->device_ = device;
  mr->descriptor_.owner = nonce_;
  mr->descriptor_.base = reinterpret_cast<uint64_t>(ptr);
  mr->descriptor_.size = nbytes;
  mr->descriptor_.flags = device >= 0 ? RegionDescriptor::kFlagDevice : 0;
  mr->descriptor_.keys = br->keys;
  std::lock_guard<std::mutex> lock(mu_);
  mr->id_ = next_region_id_++;
  regions_[mr->id_].region = std::move(br);
  regions_[mr->id_].descriptor = mr->descriptor_;
  return mr;
}

void EngineCore::Deregister(uint64_t id) {
  if (closed_.load()) return;
  std::unique_ptr<BackendRegion> region;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = regions_.find(id);
    if (it == regions_.end()) return;
    region = std::move(it->second.region);
    regions_.erase(it);
  }
  // fi_close must run on the progress thread; hand the registration over and let it die there.
  auto holder = std::make_shared<std::unique_ptr<BackendRegion>>(std::move(region));
  try {
    RunOnProgress([holder] { holder->reset(); });
  } catch (const Error&) {
    // Engine closed meanwhile: the backend already released everything.
    holder->release();
  }
}

// ---------------------------------------------------------------------------------------------------
// Peers and handshake

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
  h.your_slot = peer.id;
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
  h.your_slot = id;
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
          auto r = verify_requests_.find(h.your_slot);
          if (r != verify_requests_.end() && r->second.peer == peer) {
            r->second.done = true;
            r->second.rejection = h.blob;
          }
        }
      }
      if (h.type == Handshake::kVerify) {
        SendControl(peer, Handshake::kVerifyReply, h.your_slot, CheckOwnDescriptor(h.blob));
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
      if (h.your_slot >= kMaxPeers) Throw(ErrorCode::kInvalidArgument, "handshake: bad slot");
      peer->remote_slot = h.your_slot;
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

std::vector<PeerInfo> EngineCore::Peers() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<PeerInfo> out;
  for (const auto& p : peers_) out.push_back({p->id, p->label, p->nic, p->failed.load(), p->failure});
  return out;
}

EngineStats EngineCore::Stats() const {
  EngineStats s;
  s.writes_posted = writes_posted_.load();
  s.writes_completed = writes_completed_.load();
  s.write_errors = write_errors_.load();
  for (const auto& c : imms_per_nic_) s.imms_per_nic.push_back(c.load());
  return s;
}

// ---------------------------------------------------------------------------------------------------
// Groups and posting

uint32_t EngineCore::CreateGroup(const std::vector<uint32_t>& peers, const std::vector<RegionDescriptor>& regions) {
  CheckOpen();
  Require(!peers.empty(), "peer_group: no peers");
  Require(peers.size() == regions.size(), "peer_group: " + std::to_string(peers.size()) + " peers but " +
                                              std::to_string(regions.size()) + " descriptors");
  Require(std::set<uint32_t>(peers.begin(), peers.end()).size() == peers.size(), "peer_group: duplicate peer");
  {
    // Cheap checks first, then ask the owners (a round trip, once per descriptor and peer).
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < peers.size(); ++i) {
      Require(peers[i] < peers_.size() && peers_[peers[i]]->ready,
              "peer_group: unknown peer " + std::to_string(peers[i]) + " (connect() it first)");
      Require(regions[i].owner == peers_[peers[i]]->nonce, "peer_group: descriptor " + std::to_string(i) +
                                                               " was not registered by " + peers_[peers[i]]->label +
                                                               " (forged or mismatched)");
    }
  }
  VerifyDescriptors(peers, regions);
  auto group = std::make_unique<PeerGroup>();
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < peers.size(); ++i) {
    Require(peers[i] < peers_.size() && peers_[peers[i]]->ready,
            "peer_group: unknown peer " + std::to_string(peers[i]) + " (connect() it first)");
    const PeerState& p = *peers_[peers[i]];
    const RegionDescriptor& d = regions[i];
    Require(d.owner == p.nonce, "peer_group: descriptor " + std::to_string(i) +
                                    " was not registered by " + p.label + " (forged or mismatched)");
    Require(static_cast<int>(d.keys.size()) == p.remote_num_nics,
            "peer_group: descriptor " + std::to_string(i) + " has keys for " + std::to_string(d.keys.size()) +
                " NICs, " + p.label + " has " + std::to_string(p.remote_num_nics));
    WriteTemplate t;
    t.peer = p.id;
    t.nic = static_cast<int>(i % num_nics_);  // shard members (not bytes) over local NICs
    const int remote_nic = t.nic % p.remote_num_nics;
    t.req.dest = p.dest[t.nic];
    t.req.rkey = d.keys[remote_nic];
    t.req.remote_addr = caps_.remote_virt_addr ? d.base : 0;
    t.imm_slot = p.remote_slot;
    t.remote_size = d.size;
    group->templates.push_back(t);
  }
  group->members = peers;
  group->regions = regions;
  groups_.push_back(std::move(group));
  return static_cast<uint32_t>(groups_.size() - 1);
}

size_t EngineCore::GroupSize(uint32_t group) const {
  std::lock_guard<std::mutex> lock(mu_);
  Require(group < groups_.size(), "unknown peer group " + std::to_string(group));
  return groups_[group]->members.size();
}

void EngineCore::Scatter(uint32_t group, const MemoryRegion* src, const uint64_t* src_offsets,
                         const uint64_t* lengths, const uint64_t* dst_offsets, size_t n, std::optional<uint32_t> imm,
                         bool zero_byte) {
  CheckOpen();
  if (imm) CheckImm(*imm);
  std::vector<PendingWrite> writes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Require(group < groups_.size(), "unknown peer group " + std::to_string(group));
    const PeerGroup& g = *groups_[group];
    Require(n == g.members.size(), "scatter: got " + std::to_string(n) + " entries for a group of " +
                                       std::to_string(g.members.size()) + " peers");
    const BackendRegion* local = nullptr;
    if (!zero_byte) {
      Require(src != nullptr && src->core_.lock().get() == this, "scatter: region is not registered with this engine");
      auto it = regions_.find(src->id_);
      Require(it != regions_.end(), "scatter: region was deregistered");
      local = it->second.region.get();
    }
    writes.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const WriteTemplate& t = g.templates[i];
      const PeerState& p = *peers_[t.peer];
      if (p.failed) Throw(ErrorCode::kPeerFailed, "scatter: " + PeerListLocked({t.peer}));
      uint64_t so = 0, len = 0, doff = 0;
      if (!zero_byte) {
        so = src_offsets[i], len = lengths[i], doff = dst_offsets[i];
        Require(src->descriptor().Contains(so, len),
                "scatter: entry " + std::to_string(i) + " reads [" + std::to_string(so) + ", +" + std::to_string(len) +
                    ") outside the source region of " + std::to_string(src->size()) + " bytes");
        Require(g.regions[i].Contains(doff, len),
                "scatter: entry " + std::to_string(i) + " writes [" + std::to_string(doff) + ", +" +
                    std::to_string(len) + ") outside the remote region of " + std::to_string(t.remote_size) +
                    " bytes of " + p.label);
        Require(len <= caps_.max_write_bytes, "scatter: entry " + std::to_string(i) + " exceeds the provider's " +
                                                  std::to_string(caps_.max_write_bytes) + "-byte write limit");
      }
      const void* base = zero_byte ? nullptr : src->data();
      void* desc = zero_byte ? nullptr : local->descs[t.nic];
      PatchWrite(t, base, desc, so, len, doff, imm, nullptr, &writes[i].req);
      writes[i].nic = t.nic;
      writes[i].peer = t.peer;
    }
    for (const auto& w : writes) peers_[w.peer]->in_flight++;
  }
  writes_posted_ += n;
  Submit(std::move(writes));
}

void EngineCore::Write(uint32_t peer, const MemoryRegion& src, uint64_t src_offset, uint64_t length,
                       const RegionDescriptor& dst, uint64_t dst_offset, std::optional<uint32_t> imm) {
  CheckOpen();
  if (imm) CheckImm(*imm);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Require(peer < peers_.size() && peers_[peer]->ready, "write: unknown peer " + std::to_string(peer));
    Require(dst.owner == peers_[peer]->nonce,
            "write: descriptor was not registered by " + peers_[peer]->label + " (forged or mismatched)");
  }
  VerifyDescriptors({peer}, {dst});
  std::vector<PendingWrite> writes(1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Require(peer < peers_.size() && peers_[peer]->ready, "write: unknown peer " + std::to_string(peer));
    PeerState& p = *peers_[peer];
    if (p.failed) Throw(ErrorCode::kPeerFailed, "write: " + PeerListLocked({peer}));
    Require(dst.owner == p.nonce, "write: descriptor was not registered by " + p.label + " (forged or mismatched)");
    Require(static_cast<int>(dst.keys.size()) == p.remote_num_nics, "write: descriptor NIC count mismatch");
    Require(src.core_.lock().get() == this, "write: region is not registered with this engine");
    auto it = regions_.find(src.id_);
    Require(it != regions_.end(), "write: region was deregistered");
    Require(src.descriptor().Contains(src_offset, length), "write: source range [" + std::to_string(src_offset) + ", +" +
                                                               std::to_string(length) + ") outside the source region of " +
                                                               std::to_string(src.size()) + " bytes");
    Require(dst.Contains(dst_offset, length), "write: destination range [" + std::to_string(dst_offset) + ", +" +
                                                  std::to_string(length) + ") outside the remote region of " +
                                                  std::to_string(dst.size) + " bytes");
    Require(length <= caps_.max_write_bytes, "write: exceeds the provider's write size limit");
    WriteTemplate t;
    t.peer = peer;
    t.nic = p.nic;
    t.req.dest = p.dest[p.nic];
    t.req.rkey = dst.keys[p.remote_nic];
    t.req.remote_addr = caps_.remote_virt_addr ? dst.base : 0;
    t.imm_slot = p.remote_slot;
    PatchWrite(t, src.data(), it->second.region->descs[p.nic], src_offset, length, dst_offset, imm, nullptr,
               &writes[0].req);
    writes[0].nic = p.nic;
    writes[0].peer = peer;
    p.in_flight++;
  }
  writes_posted_++;
  Submit(std::move(writes));
}

// ---------------------------------------------------------------------------------------------------
// Waits

void EngineCore::WaitImm(uint32_t imm, uint64_t count, double timeout_s) {
  CheckOpen();
  CheckImm(imm);
  std::map<uint32_t, uint64_t> seen;
  if (imms_.Wait(imm, count, Deadline::After(timeout_s), &seen)) return;
  CheckOpen();
  uint64_t got = 0;
  std::vector<uint32_t> missing;
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& kv : seen) got += kv.second;
  for (const auto& p : peers_) {
    if (!seen.count(p->id)) missing.push_back(p->id);
  }
  Throw(ErrorCode::kTimeout, "wait_imm(imm=" + std::to_string(imm) + ", count=" + std::to_string(count) +
                                 ") timed out after " + FormatSeconds(timeout_s) + ": got " + std::to_string(got) +
                                 "; peers that sent none: " + (missing.empty() ? "none" : PeerListLocked(missing)));
}

void EngineCore::WaitImmFrom(uint32_t imm, const std::vector<uint32_t>& peers, double timeout_s) {
  CheckOpen();
  CheckImm(imm);
  Require(std::set<uint32_t>(peers.begin(), peers.end()).size() == peers.size(), "wait_imm_from: duplicate peer");
  std::vector<uint32_t> missing;
  if (imms_.WaitFrom(imm, peers, 1, Deadline::After(timeout_s), &missing)) return;
  CheckOpen();
  std::lock_guard<std::mutex> lock(mu_);
  Throw(ErrorCode::kTimeout, "wait_imm_from(imm=" + std::to_string(imm) + ") timed out after " +
                                 FormatSeconds(timeout_s) + "; missing: " + PeerListLocked(missing));
}

void EngineCore::WaitSends(double timeout_s) {
  CheckOpen();
  const uint64_t target = writes_posted_.load();
  Deadline deadline = Deadline::After(timeout_s);
  active_waiters_++;
  std::unique_lock<std::mutex> lock(sends_mu_);
  bool ok = sends_cv_.wait_until(lock, deadline.at(), [&] { return writes_completed_.load() >= target || closed_; });
  active_waiters_--;
  CheckOpen();
  const uint64_t errors = write_errors_.load();
  const bool new_errors = errors > errors_reported_;
  errors_reported_ = errors;
  lock.unlock();
  if (!ok || new_errors) {
    std::vector<uint32_t> bad;
    std::lock_guard<std::mutex> plock(mu_);
    for (const auto& p : peers_) {
      if ((new_errors && p->failed) || (!ok && p->in_flight > 0)) bad.push_back(p->id);
    }
    if (!ok) {
      Throw(ErrorCode::kTimeout, "wait_sends timed out after " + FormatSeconds(timeout_s) +
                                     "; writes still in flight to: " + PeerListLocked(bad));
    }
    Throw(ErrorCode::kPeerFailed, "wait_sends: " + std::to_string(errors) + " write(s) failed; peers: " +
                                      PeerListLocked(bad));
  }
}

// ---------------------------------------------------------------------------------------------------
// Progress thread

OpContext* EngineCore::NewOp(OpContext::Kind kind, uint32_t peer, int nic) {
  OpContext* op;
  if (free_ops_.empty()) {
    all_ops_.push_back(std::make_unique<OpContext>());
    op = all_ops_.back().get();
  } else {
    op = free_ops_.back();
    free_ops_.pop_back();
  }
  op->kind = kind;
  op->peer = peer;
  op->nic = nic;
  return op;
}

void EngineCore::FreeOp(OpContext* op) {
  op->buffer.clear();
  free_ops_.push_back(op);
}

void EngineCore::PostRecvBuffer(int nic, OpContext* op) {
  op->buffer.resize(kRecvBytes);
  backend_->PostRecv(nic, op->buffer.data(), op->buffer.size(), op);
}

void EngineCore::WriteDone(OpContext* op, bool ok) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (op->peer < peers_.size()) peers_[op->peer]->in_flight--;
  }
  if (!ok) write_errors_++;
  writes_completed_++;
  FreeOp(op);
}

bool EngineCore::DrainSubmissions() {
  if (!sq_nonempty_.load(std::memory_order_acquire)) return false;
  std::vector<PendingWrite> writes;
  std::vector<PendingCall> calls;
  {
    std::lock_guard<std::mutex> lock(sq_mu_);
    writes.swap(sq_writes_);
    calls.swap(sq_calls_);
    sq_nonempty_ = false;
  }
  for (auto& call : calls) {
    try {
      call.fn();
    } catch (...) {
      call.state->error = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(call.state->mu);
    call.state->done = true;
    call.state->cv.notify_all();
  }
  for (auto& w : writes) backlog_.push_back(w);
  return true;
}

// Posts queued control messages and writes. A full queue (-FI_EAGAIN) is tracked per (NIC, peer):
// rxm answers EAGAIN for a peer it cannot connect to (a dead process), and that must not hold back
// writes to everyone else. After kMaxBlocked distinct refusals in one pass the endpoint itself is
// probably full; the rest waits for the next pass (after completions were polled).
bool EngineCore::PostPending() {
  constexpr size_t kMaxBlocked = 64;
  bool progressed = false;
  std::vector<uint64_t> blocked;
  auto key = [](int nic, uint32_t peer) { return (static_cast<uint64_t>(nic) << 32) | peer; };
  auto is_blocked = [&](uint64_t k) { return std::find(blocked.begin(), blocked.end(), k) != blocked.end(); };

  if (!pending_sends_.empty()) {
    std::deque<PendingSend> keep;
    while (!pending_sends_.empty()) {
      PendingSend s = pending_sends_.front();
      pending_sends_.pop_front();
      const uint64_t k = key(s.nic, s.op->peer);
      if (is_blocked(k)) {
        keep.push_back(s);
        continue;
      }
      bool ok = false;
      try {
        ok = backend_->PostSend(s.nic, s.dest, s.op->buffer.data(), s.op->buffer.size(), s.op, s.bootstrap);
      } catch (const Error& e) {
        FailPeer(s.op->peer, e.what());
        FreeOp(s.op);
        continue;
      }
      if (ok) {
        progressed = true;
        continue;
      }
      blocked.push_back(k);
      keep.push_back(s);
      if (blocked.size() >= kMaxBlocked) break;
    }
    while (!pending_sends_.empty()) {
      keep.push_back(pending_sends_.front());
      pending_sends_.pop_front();
    }
    pending_sends_.swap(keep);
  }

  if (!backlog_.empty()) {
    blocked.clear();
    std::deque<PendingWrite> keep;
    while (!backlog_.empty()) {
      PendingWrite w = backlog_.front();
      backlog_.pop_front();
      const uint64_t k = key(w.nic, w.peer);
      if (is_blocked(k)) {
        keep.push_back(w);
        continue;
      }
      if (w.req.context == nullptr) w.req.context = NewOp(OpContext::kWrite, w.peer, w.nic);
      size_t posted = 0;
      try {
        posted = backend_->PostWrites(w.nic, &w.req, 1);
      } catch (const Error& e) {
        // This write cannot be posted at all: it completes as failed and marks its peer.
        FailPeer(w.peer, e.what());
        WriteDone(static_cast<OpContext*>(w.req.context), false);
        progressed = true;
        continue;
      }
      if (posted == 1) {
        progressed = true;
        continue;
      }
      blocked.push_back(k);
      keep.push_back(w);
      if (blocked.size() >= kMaxBlocked) break;
    }
    while (!backlog_.empty()) {
      keep.push_back(backlog_.front());
      backlog_.pop_front();
    }
    backlog_.swap(keep);
  }
  return progressed;
}

bool EngineCore::PollAll() {
  bool any = false;
  bool sends_changed = false;
  arrivals_.clear();
  for (int nic = 0; nic < num_nics_; ++nic) {
    completions_.clear();
    size_t n = backend_->Poll(nic, &completions_, kPollBatch);
    if (n == 0) continue;
    any = true;
    for (const Completion& c : completions_) {
      if (c.kind != Completion::kImm && c.context != nullptr &&
          static_cast<OpContext*>(c.context)->kind == OpContext::kWrite) {
        sends_changed = true;
      }
      OnCompletion(nic, c);
    }
  }
  if (!arrivals_.empty()) imms_.AddBatch(arrivals_.data(), arrivals_.size());
  if (sends_changed) {
    std::lock_guard<std::mutex> lock(sends_mu_);
    sends_cv_.notify_all();
  }
  return any;
}

void EngineCore::OnCompletion(int nic, const Completion& c) {
  OpContext* op = static_cast<OpContext*>(c.context);
  switch (c.kind) {
    case Completion::kWriteDone:
    case Completion::kSendDone:
    case Completion::kRecvDone:
      // Our own operation finished: what it was is recorded in its context.
      if (op->kind == OpContext::kWrite) {
        WriteDone(op, true);
      } else if (op->kind == OpContext::kSend) {
        FreeOp(op);
      } else {
        std::string msg = op->buffer.substr(0, std::min<uint64_t>(c.length, op->buffer.size()));
        PostRecvBuffer(nic, op);
        OnMessage(nic, msg);
      }
      break;
    case Completion::kImm:
      imms_per_nic_[nic]++;
      arrivals_.push_back({c.imm, c.peer});
      break;
    case Completion::kError:
      if (op == nullptr) {
        JAX_MOE_LOG(kWarn, "completion error on NIC %d: %s", int(nic), std::string(c.error).c_str());
      } else if (op->kind == OpContext::kWrite) {
        FailPeer(op->peer, c.error);
        WriteDone(op, false);
      } else if (op->kind == OpContext::kSend) {
        FailPeer(op->peer, c.error);
        FreeOp(op);
      } else {
        JAX_MOE_LOG(kWarn, "receive error on NIC %d: %s", int(nic), std::string(c.error).c_str());
        if (!stop_) PostRecvBuffer(nic, op);
      }
      break;
  }
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

void EngineCore::ProgressLoop() {
  if (options_.progress_cpu >= 0) {
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(options_.progress_cpu, &set);
    int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    if (rc != 0) JAX_MOE_LOG(kWarn, "pinning the progress thread to CPU %d failed: %d", int(options_.progress_cpu), int(rc));
  }
  try {
    for (size_t i = 0; i < kRecvBuffers; ++i) PostRecvBuffer(0, NewOp(OpContext::kRecv, 0, 0));
  } catch (const Error& e) {
    JAX_MOE_LOG(kError, "posting handshake receives failed: %s", e.what());
  }
  // Idle policy. tcp/shm progress is manual (data only moves while we poll), so we spin while there
  // is something to post or something happened in the last kHotWindow. Writes in flight or threads
  // waiting with nothing happening (a slow or dead peer) get short naps, so a lost peer does not pin
  // a core forever; a truly idle engine naps up to 1 ms. A submission ends any nap at once.
  constexpr auto kHotWindow = std::chrono::milliseconds(2);
  constexpr auto kShortNap = std::chrono::microseconds(50);
  uint64_t idle = 0;
  auto nap = std::chrono::microseconds(20);
  auto last_work = std::chrono::steady_clock::now();
  while (!stop_.load(std::memory_order_relaxed)) {
    bool work = false;
    try {
      work |= DrainSubmissions();
      work |= PostPending();
      work |= PollAll();
      if (!hello_resend_.empty()) ResendHellos();
    } catch (const std::exception& e) {
      JAX_MOE_LOG(kError, "progress thread: %s", e.what());
    }
    if (work) {
      idle = 0;
      nap = std::chrono::microseconds(20);
      last_work = std::chrono::steady_clock::now();
      continue;
    }
    ++idle;
    if (options_.busy_poll || idle < 200 || (idle & 63) != 0 ||
        std::chrono::steady_clock::now() - last_work < kHotWindow) {  // the clock is read every 64th pass
      if ((idle & 15) == 0) sched_yield();  // share the core with the waiter and other processes
      continue;
    }
    // Unposted work (a peer refusing with EAGAIN) also only earns short naps: retrying it in a
    // tight loop would pin a core for as long as that peer stays dead.
    const bool busy = writes_completed_.load() < writes_posted_.load() || imms_.waiters() > 0 ||
                      active_waiters_.load() > 0 || !backlog_.empty() || !pending_sends_.empty();
    std::unique_lock<std::mutex> lock(sq_mu_);
    sq_cv_.wait_for(lock, busy ? std::chrono::microseconds(kShortNap) : nap,
                    [&] { return sq_nonempty_.load() || stop_.load(); });
    if (!busy) nap = std::min(nap * 2, std::chrono::microseconds(1000));
  }
}

}  // namespace jax_moe::fabric
