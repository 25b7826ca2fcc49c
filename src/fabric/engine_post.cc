// EngineCore posting: peer sets, Scatter/Write validation and submission, and posting the backlog.
#include "fabric/engine_core.h"

#include <algorithm>
#include <set>

#include "common/error.h"

namespace jax_moe::fabric {

namespace {

// What became of one attempt to post a queued item.
enum class PostOutcome {
  kDone,     // left the queue: posted, or (a write) completed as failed; counts as progress
  kDropped,  // left the queue unposted and released (a send; its peer was failed); not progress
  kRefused,  // the provider's queue is full for this (NIC, peer): stays queued
};

// One pass over `queue` in order. A refusal is remembered per (NIC, peer) key and that key's later
// items wait without being tried; after kMaxBlocked distinct refusals the endpoint itself is probably
// full and the rest waits for the next pass. Returns whether anything counted as progress.
template <typename Item, typename KeyOf, typename TryPost>
bool PostQueue(std::deque<Item>& queue, KeyOf key_of, TryPost try_post) {
  constexpr size_t kMaxBlocked = 64;
  if (queue.empty()) return false;
  bool progressed = false;
  std::vector<uint64_t> blocked;
  std::vector<Item> keep;  // refused, or behind a refused one of the same (NIC, peer); nothing allocated if none
  while (!queue.empty()) {
    Item item = std::move(queue.front());
    queue.pop_front();
    const uint64_t k = key_of(item);
    if (std::find(blocked.begin(), blocked.end(), k) != blocked.end()) {
      keep.push_back(std::move(item));
      continue;
    }
    const PostOutcome outcome = try_post(item);
    if (outcome == PostOutcome::kDone) progressed = true;
    if (outcome != PostOutcome::kRefused) continue;
    blocked.push_back(k);
    keep.push_back(std::move(item));
    if (blocked.size() >= kMaxBlocked) break;
  }
  for (size_t i = keep.size(); i-- > 0;) queue.push_front(std::move(keep[i]));  // before what was not tried, in order
  return progressed;
}

uint64_t NicPeerKey(int nic, uint32_t peer) { return (static_cast<uint64_t>(nic) << 32) | peer; }

}  // namespace

uint32_t EngineCore::CreatePeerSet(const std::vector<uint32_t>& peers, const std::vector<RegionDescriptor>& regions) {
  CheckOpen();
  JAX_MOE_REQUIRE(!peers.empty(), "peer_set: no peers");
  JAX_MOE_REQUIRE(peers.size() == regions.size(), "peer_set: " + std::to_string(peers.size()) + " peers but " +
                                              std::to_string(regions.size()) + " descriptors");
  JAX_MOE_REQUIRE(std::set<uint32_t>(peers.begin(), peers.end()).size() == peers.size(), "peer_set: duplicate peer");
  {
    // Cheap checks first, then ask the owners (a round trip, once per descriptor and peer).
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < peers.size(); ++i) {
      JAX_MOE_REQUIRE(peers[i] < peers_.size() && peers_[peers[i]]->ready,
              "peer_set: unknown peer " + std::to_string(peers[i]) + " (connect() it first)");
      JAX_MOE_REQUIRE(regions[i].owner == peers_[peers[i]]->nonce, "peer_set: descriptor " + std::to_string(i) +
                                                               " was not registered by " + peers_[peers[i]]->label +
                                                               " (forged or mismatched)");
    }
  }
  VerifyDescriptors(peers, regions);
  auto set = std::make_unique<PeerSet>();
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < peers.size(); ++i) {
    JAX_MOE_REQUIRE(peers[i] < peers_.size() && peers_[peers[i]]->ready,
            "peer_set: unknown peer " + std::to_string(peers[i]) + " (connect() it first)");
    const PeerState& p = *peers_[peers[i]];
    const RegionDescriptor& d = regions[i];
    JAX_MOE_REQUIRE(d.owner == p.nonce, "peer_set: descriptor " + std::to_string(i) +
                                    " was not registered by " + p.label + " (forged or mismatched)");
    JAX_MOE_REQUIRE(static_cast<int>(d.keys.size()) == p.remote_num_nics,
            "peer_set: descriptor " + std::to_string(i) + " has keys for " + std::to_string(d.keys.size()) +
                " NICs, " + p.label + " has " + std::to_string(p.remote_num_nics));
    WriteTemplate t;
    t.peer = p.id;
    t.nic = static_cast<int>(i % num_nics_);  // shard members (not bytes) over local NICs
    const int remote_nic = t.nic % p.remote_num_nics;
    t.req.dest = p.dest[t.nic];
    t.req.rkey = d.keys[remote_nic];
    t.req.remote_addr = caps_.remote_virt_addr ? d.base : 0;
    t.imm_peer_id = p.remote_peer_id;
    t.remote_size = d.size;
    set->templates.push_back(t);
  }
  set->members = peers;
  set->regions = regions;
  peer_sets_.push_back(std::move(set));
  return static_cast<uint32_t>(peer_sets_.size() - 1);
}

const PeerSet& EngineCore::PeerSetLocked(uint32_t set) const {
  JAX_MOE_REQUIRE(set < peer_sets_.size() && peer_sets_[set], "unknown peer set " + std::to_string(set));
  return *peer_sets_[set];
}

size_t EngineCore::PeerSetSize(uint32_t set) const {
  std::lock_guard<std::mutex> lock(mu_);
  return PeerSetLocked(set).members.size();
}

// The slot stays (ids are indices); writes still out count down the set's shared counter, which they hold. Writes of
// the set not yet posted (queued, or refused by a full queue) are dropped by PostPending from now on; a pass that may
// have read the flag before it was set is waited out (bounded), so that once this returns the set's user may free
// what its queued writes would have read.
void EngineCore::DestroyPeerSet(uint32_t set) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    PeerSetLocked(set).gone->store(true, std::memory_order_seq_cst);
    peer_sets_[set].reset();
  }
  if (progress_owner == this) return;  // called from a hook: no pass of ours is half done
  const uint64_t seq = pass_seq_.load(std::memory_order_seq_cst);
  if ((seq & 1) == 0) return;  // between passes: the next one sees the flag
  const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(100);
  while (pass_seq_.load(std::memory_order_seq_cst) == seq && !stop_.load() && std::chrono::steady_clock::now() < end)
    std::this_thread::yield();
}

uint64_t EngineCore::SendsInFlight(uint32_t set) const {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t n = PeerSetLocked(set).in_flight->load(std::memory_order_acquire);
  return n > 0 ? uint64_t(n) : 0;
}

void EngineCore::Scatter(uint32_t set, const MemoryRegion* src, const uint64_t* src_offsets,
                         const uint64_t* lengths, const uint64_t* dst_offsets, size_t n, std::optional<uint32_t> imm,
                         bool zero_byte) {
  CheckOpen();
  if (imm) CheckImm(*imm);
  std::vector<PendingWrite> writes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const PeerSet& ps = PeerSetLocked(set);
    JAX_MOE_REQUIRE(n == ps.members.size(), "scatter: got " + std::to_string(n) + " entries for a peer set of " +
                                        std::to_string(ps.members.size()) + " peers");
    const BackendRegion* local = nullptr;
    if (!zero_byte) {
      JAX_MOE_REQUIRE(src != nullptr && src->core_.lock().get() == this, "scatter: region is not registered with this engine");
      auto it = regions_.find(src->id_);
      JAX_MOE_REQUIRE(it != regions_.end(), "scatter: region was deregistered");
      local = it->second.region.get();
    }
    writes.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const WriteTemplate& t = ps.templates[i];
      const PeerState& p = *peers_[t.peer];
      if (p.failed) Throw(ErrorCode::kPeerFailed, "scatter: " + PeerListLocked({t.peer}));
      uint64_t so = 0, len = 0, doff = 0;
      if (!zero_byte) {
        so = src_offsets[i], len = lengths[i], doff = dst_offsets[i];
        JAX_MOE_REQUIRE(src->descriptor().Contains(so, len),
                "scatter: entry " + std::to_string(i) + " reads [" + std::to_string(so) + ", +" + std::to_string(len) +
                    ") outside the source region of " + std::to_string(src->size()) + " bytes");
        JAX_MOE_REQUIRE(ps.regions[i].Contains(doff, len),
                "scatter: entry " + std::to_string(i) + " writes [" + std::to_string(doff) + ", +" +
                    std::to_string(len) + ") outside the remote region of " + std::to_string(t.remote_size) +
                    " bytes of " + p.label);
        JAX_MOE_REQUIRE(len <= caps_.max_write_bytes, "scatter: entry " + std::to_string(i) + " exceeds the provider's " +
                                                  std::to_string(caps_.max_write_bytes) + "-byte write limit");
      }
      const void* base = zero_byte ? nullptr : src->data();
      void* desc = zero_byte ? nullptr : local->descs[t.nic];
      PatchWrite(t, base, desc, so, len, doff, imm, nullptr, &writes[i].req);
      writes[i].req.host_to_host = !zero_byte && local->how == Registration::kHost &&
                                   !(ps.regions[i].flags & RegionDescriptor::kFlagDevice);
      writes[i].nic = t.nic;
      writes[i].peer = t.peer;
      writes[i].set_in_flight = ps.in_flight;
      writes[i].set_gone = ps.gone;
    }
    for (const auto& w : writes) peers_[w.peer]->in_flight++;
    ps.in_flight->fetch_add(int64_t(n), std::memory_order_relaxed);
  }
  writes_posted_ += n;
  Submit(std::move(writes));
}

void EngineCore::Write(uint32_t peer, const MemoryRegion& src, uint64_t src_offset, uint64_t length,
                       const RegionDescriptor& dst, uint64_t dst_offset, std::optional<uint32_t> imm,
                       std::optional<uint32_t> counted_in) {
  CheckOpen();
  if (imm) CheckImm(*imm);
  {
    std::lock_guard<std::mutex> lock(mu_);
    JAX_MOE_REQUIRE(peer < peers_.size() && peers_[peer]->ready, "write: unknown peer " + std::to_string(peer));
    JAX_MOE_REQUIRE(dst.owner == peers_[peer]->nonce,
            "write: descriptor was not registered by " + peers_[peer]->label + " (forged or mismatched)");
  }
  VerifyDescriptors({peer}, {dst});
  std::vector<PendingWrite> writes(1);
  {
    std::lock_guard<std::mutex> lock(mu_);
    JAX_MOE_REQUIRE(peer < peers_.size() && peers_[peer]->ready, "write: unknown peer " + std::to_string(peer));
    PeerState& p = *peers_[peer];
    if (p.failed) Throw(ErrorCode::kPeerFailed, "write: " + PeerListLocked({peer}));
    JAX_MOE_REQUIRE(dst.owner == p.nonce, "write: descriptor was not registered by " + p.label + " (forged or mismatched)");
    JAX_MOE_REQUIRE(static_cast<int>(dst.keys.size()) == p.remote_num_nics, "write: descriptor NIC count mismatch");
    JAX_MOE_REQUIRE(src.core_.lock().get() == this, "write: region is not registered with this engine");
    auto it = regions_.find(src.id_);
    JAX_MOE_REQUIRE(it != regions_.end(), "write: region was deregistered");
    JAX_MOE_REQUIRE(src.descriptor().Contains(src_offset, length), "write: source range [" + std::to_string(src_offset) + ", +" +
                                                               std::to_string(length) + ") outside the source region of " +
                                                               std::to_string(src.size()) + " bytes");
    JAX_MOE_REQUIRE(dst.Contains(dst_offset, length), "write: destination range [" + std::to_string(dst_offset) + ", +" +
                                                  std::to_string(length) + ") outside the remote region of " +
                                                  std::to_string(dst.size) + " bytes");
    JAX_MOE_REQUIRE(length <= caps_.max_write_bytes, "write: exceeds the provider's write size limit");
    WriteTemplate t;
    t.peer = peer;
    t.nic = p.nic;
    t.req.dest = p.dest[p.nic];
    t.req.rkey = dst.keys[p.remote_nic];
    t.req.remote_addr = caps_.remote_virt_addr ? dst.base : 0;
    t.imm_peer_id = p.remote_peer_id;
    PatchWrite(t, src.data(), it->second.region->descs[p.nic], src_offset, length, dst_offset, imm, nullptr,
               &writes[0].req);
    writes[0].req.host_to_host =
        it->second.region->how == Registration::kHost && !(dst.flags & RegionDescriptor::kFlagDevice);
    writes[0].nic = p.nic;
    writes[0].peer = peer;
    if (counted_in) {
      const PeerSet& ps = PeerSetLocked(*counted_in);
      writes[0].set_in_flight = ps.in_flight;
      writes[0].set_gone = ps.gone;
      writes[0].set_in_flight->fetch_add(1, std::memory_order_relaxed);
    }
    p.in_flight++;
  }
  writes_posted_++;
  Submit(std::move(writes));
}

void EngineCore::Submit(std::vector<PendingWrite>&& writes) {
  if (progress_owner == this) {  // a hook of ours: posted later in this same pass (PostPending), no queue between
    for (auto& w : writes) backlog_.push_back(std::move(w));
    return;
  }
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

// Posts queued control messages, then writes. A full queue (-FI_EAGAIN) is tracked per (NIC, peer):
// rxm answers EAGAIN for a peer it cannot connect to (a dead process), and that must not hold back
// writes to everyone else (PostQueue). What stays queued waits for the next pass, after completions
// were polled.
bool EngineCore::PostPending() {
  bool progressed = PostQueue(
      pending_sends_, [](const PendingSend& s) { return NicPeerKey(s.nic, s.op->peer); },
      [this](PendingSend& s) {
        try {
          const bool ok =
              backend_->PostSend(s.nic, s.dest, s.op->buffer.data(), s.op->buffer.size(), s.op, s.bootstrap);
          return ok ? PostOutcome::kDone : PostOutcome::kRefused;
        } catch (const Error& e) {
          FailPeer(s.op->peer, e.what());
          FreeOp(s.op);
          return PostOutcome::kDropped;
        }
      });
  progressed |= PostQueue(
      backlog_, [](const PendingWrite& w) { return NicPeerKey(w.nic, w.peer); },
      [this](PendingWrite& w) {
        if (w.req.context == nullptr) {
          OpContext* op = NewOp(OpContext::kWrite, w.peer, w.nic);
          op->set_in_flight = std::move(w.set_in_flight);
          w.req.context = op;
        }
        if (w.set_gone && w.set_gone->load(std::memory_order_seq_cst)) {
          // Its peer set's user is gone and may have freed the memory: drop it. It completes as done, not failed:
          // nobody waits for it, and it must not read as a failure to the engine's other users.
          WriteDone(static_cast<OpContext*>(w.req.context), true);
          std::lock_guard<std::mutex> lock(sends_mu_);
          sends_cv_.notify_all();
          return PostOutcome::kDropped;
        }
        try {
          return backend_->PostWrites(w.nic, &w.req, 1) == 1 ? PostOutcome::kDone : PostOutcome::kRefused;
        } catch (const Error& e) {
          // This write cannot be posted at all: it completes as failed and marks its peer.
          FailPeer(w.peer, e.what());
          WriteDone(static_cast<OpContext*>(w.req.context), false);
          {  // it completed here, not through the CQ: wake WaitSends as a polled completion would
            std::lock_guard<std::mutex> lock(sends_mu_);
            sends_cv_.notify_all();
          }
          return PostOutcome::kDone;
        }
      });
  notices_apart_.store(backend_->notices_apart(), std::memory_order_relaxed);
  return progressed;
}

}  // namespace jax_moe::fabric
