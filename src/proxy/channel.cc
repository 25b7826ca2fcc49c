#include "proxy/channel.h"

#include <algorithm>

#include "common/error.h"

namespace jax_moe::proxy {

std::string RankList(const std::vector<int32_t>& ranks) {
  std::string s = "[";
  for (size_t i = 0; i < ranks.size(); ++i) s += (i ? ", " : "") + std::to_string(ranks[i]);
  return s + "]";
}

Channel::Channel(const ChannelConfig& config, const std::vector<bool>& remote,
                 std::shared_ptr<fabric::TransferEngine> engine, SameProcess* local, Allocate allocate, std::mutex& mu,
                 std::condition_variable& cv)
    : config_(config),
      engine_(std::move(engine)),
      local_(local),
      mu_(mu),
      cv_(cv),
      staging_(int64_t(remote.size()) * config.lanes.region_bytes, std::move(allocate)) {
  const int64_t n = int64_t(remote.size()), k = lanes().count;
  const RegionSlots& slots = config.slots;
  JAX_MOE_REQUIRE(slots.num_ranks() == n && config.rank >= 0 && config.rank < n &&
                      slots.Slots(config.rank) == lanes().slots,
                  "Channel: one entry per rank, this rank among them, and lanes of as many regions as its slots");
  remote_index_.assign(n, -1);
  for (int64_t p = 0; p < n; ++p) {
    if (!remote[p]) continue;
    JAX_MOE_REQUIRE(slots.Slot(config.rank, p) >= 0 && slots.Slot(p, config.rank) >= 0,
                    "Channel: a remote rank without a region in our buffers, or we without one in its");
    remote_index_[p] = int64_t(remote_ranks_.size());
    remote_ranks_.push_back(int32_t(p));
    own_slot_.push_back(slots.Slot(config.rank, p));
    slot_at_peer_.push_back(slots.Slot(p, config.rank));
    peer_slots_.push_back(slots.Slots(p));
  }
  posted_to_.assign(remote_ranks_.size(), 0);
  take_.assign(remote_ranks_.size(), 0);
  ask_from_.assign(size_t(k), 0);
  JAX_MOE_REQUIRE(remote_ranks_.empty() || engine_, "Channel: ranks in other processes need a TransferEngine");
  JAX_MOE_REQUIRE(remote_ranks_.size() == size_t(n) || local_, "Channel: ranks of this process need the device side");
  queue_.resize(n);
  last_received_.assign(k, 0);
  remote_credits_.assign(n * k, 0);
  remote_rounds_.assign(n * k, 0);
}

Channel::~Channel() {
  if (!engine_) return;
  try {
    if (!remote_peers_.empty()) engine_->DestroyPeerSet(peer_set_);
    constexpr uint32_t kIdMask = (1u << kCommIdBits) - 1;
    engine_->DiscardImms(kIdMask, config_.comm_id & kIdMask);
  } catch (const std::exception&) {  // a closed engine: nothing of ours is left in it
  }
}

uint64_t Channel::SendsInFlight() const {
  return remote_peers_.empty() ? 0 : engine_->SendsInFlight(peer_set_);
}

void Channel::Connect(const std::vector<fabric::PeerId>& peers, std::vector<fabric::RegionDescriptor> regions) {
  JAX_MOE_REQUIRE(peers.size() == remote_ranks_.size() && regions.size() == peers.size(),
          "Channel: one engine and one region per remote rank");
  if (peers.empty()) return;
  fabric::PeerSetId set = engine_->CreatePeerSet(peers, regions);
  std::lock_guard<std::mutex> lock(mu_);
  remote_peers_ = peers;
  remote_regions_ = std::move(regions);
  peer_set_ = set;
}

bool Channel::CountReceived(uint64_t round) {
  uint64_t& last = last_received_[lanes().Lane(round)];
  if (round <= last) return false;
  last = round;
  ++received_;
  return true;
}

bool Channel::CreditOk(int64_t peer, uint64_t round) {
  const uint64_t earlier = lanes().Earlier(round);  // the receiver must have read every earlier round of this lane
  if (earlier == 0) return true;
  if (remote_index_[peer] < 0) return local_->CreditOk(peer, round);
  uint64_t& credits = remote_credits_[peer * lanes().count + lanes().Lane(round)];
  while (engine_->TryConsumeImm(Imm(config_.credit_kind, round, uint32_t(peer)), 1)) ++credits;
  return credits >= earlier;
}

void Channel::Send(uint64_t round, const std::vector<int32_t>& rows, const Fill& fill) {
  const int64_t n = num_ranks();
  std::vector<char> now(n);
  std::vector<uint8_t*> regions(n);
  Staging* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool staged = false;
    for (int64_t p = 0; p < n; ++p) {
      now[p] = queue_[p].empty() && CreditOk(p, round);
      staged |= !now[p] || remote_index_[p] >= 0;
    }
    if (staged) st = staging_.Acquire(engine_.get());
    for (int64_t p = 0; p < n; ++p) {
      const bool in_place = now[p] && remote_index_[p] < 0;
      regions[p] = in_place ? local_->Region(p, round) : st->mem.data + p * lanes().region_bytes;  // staging: by rank
    }
    if (st) st->queued += 1;  // keeps it ours while we fill it outside the lock
  }
  fill(regions);
  std::lock_guard<std::mutex> lock(mu_);
  if (st) st->queued -= 1;
  std::vector<int32_t> post;
  std::vector<uint64_t> bytes;
  for (int64_t p = 0; p < n; ++p) {
    const uint64_t b = config_.header_bytes + uint64_t(rows[p]) * config_.row_bytes;
    if (!now[p]) {
      queue_[p].push_back({round, st, b});
      st->queued += 1;
    } else if (remote_index_[p] < 0) {
      local_->Deliver(p, nullptr, b, round);
    } else {
      post.push_back(int32_t(p));
      bytes.push_back(b);
    }
  }
  cv_.notify_all();
  if (post.empty()) return;
  st->remote_pending = true;
  std::vector<uint64_t> offsets;
  for (int32_t p : post) offsets.push_back(uint64_t(p) * lanes().region_bytes);
  Post(round, *st->mr, offsets, post, bytes);
}

void Channel::Post(uint64_t round, const fabric::MemoryRegion& src, const std::vector<uint64_t>& src_offsets,
                   const std::vector<int32_t>& ranks, const std::vector<uint64_t>& bytes) {
  const uint32_t imm = Imm(config_.data_kind, round, uint32_t(config_.rank));
  if (ranks.size() == remote_ranks_.size()) {  // the common case: one scatter from the peer set's prebuilt templates
    std::vector<uint64_t> dsts(ranks.size());
    for (size_t i = 0; i < ranks.size(); ++i) dsts[i] = PeerOffset(round, size_t(remote_index_[ranks[i]]));
    try {
      engine_->Scatter(peer_set_, src, src_offsets.data(), bytes.data(), dsts.data(), ranks.size(), imm);
      return;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kPeerFailed) throw;
      // A peer is gone: still serve the others below, so that they fail naming the right rank.
    }
  }
  std::vector<int32_t> failed;
  std::string why;
  for (size_t j = 0; j < ranks.size(); ++j) {
    const int64_t i = remote_index_[ranks[j]];
    try {
      engine_->Write(remote_peers_[i], src, src_offsets[j], bytes[j], remote_regions_[i], PeerOffset(round, size_t(i)),
                     imm, peer_set_);
    } catch (const Error& e) {
      failed.push_back(ranks[j]);
      why = e.what();
    }
  }
  if (!failed.empty()) {
    Throw(ErrorCode::kPeerFailed, std::string(config_.name) + " on rank " + std::to_string(config_.rank) +
                                      ": cannot write to ranks " + RankList(failed) + ": " + why);
  }
}

uint64_t Channel::PostAreas(uint64_t ready, const fabric::MemoryRegion& area, const uint64_t* words) {
  const size_t m = remote_ranks_.size();
  if (m == 0 || posted_all_ >= ready) {
    if (m == 0 && ready > posted_all_) posted_all_ = ready;
    return posted_all_;
  }
  std::vector<int32_t> ranks;
  std::vector<uint64_t> offsets, lengths;
  for (uint64_t round = posted_all_ + 1; round <= ready; ++round) {
    // Ask the receivers due this round in turn, from where the last pass stopped on this round's lane, up to the
    // first without credit (one look-up a round while all wait); post in rank order, since a prebuilt scatter's
    // entries are the peer set's members in order. The rounds in progress are at most K, one per lane.
    const int64_t lane = lanes().Lane(round);
    size_t& from = ask_from_[size_t(lane)];
    std::fill(take_.begin(), take_.end(), 0);
    for (size_t j = 0; j < m; ++j) {
      const size_t i = (from + j) % m;
      if (posted_to_[i] != round - 1) continue;  // has it already, or is behind with an earlier one
      if (!CreditOk(remote_ranks_[i], round)) {
        from = (i + 1) % m;  // the next pass starts after it: each stop is nearer to any receiver it kept waiting
        break;
      }
      take_[i] = 1;
    }
    ranks.clear();
    offsets.clear();
    lengths.clear();
    const uint64_t* bytes = words + lane * num_ranks();
    for (size_t i = 0; i < m; ++i) {
      if (!take_[i]) continue;
      const int32_t p = remote_ranks_[i];
      // Read once, so that the length checked is the length posted, whatever a faulty device writes (a sound one
      // rewrites this lane only after kSent says every receiver had the round).
      const uint64_t b = __atomic_load_n(bytes + p, __ATOMIC_RELAXED);
      if (b > lanes().region_bytes) {
        Throw(ErrorCode::kInvalidArgument, std::string(config_.name) + ": the device announced a region of " +
                                               std::to_string(b) + " bytes, more than a region holds");
      }
      ranks.push_back(p);
      offsets.push_back(lanes().Offset(round, own_slot_[i]));
      lengths.push_back(b);
    }
    if (ranks.empty()) continue;  // a receiver ahead may still take the next round
    Post(round, area, offsets, ranks, lengths);  // one scatter when it goes to every remote rank at once
    for (int32_t p : ranks) posted_to_[size_t(remote_index_[p])] = round;
  }
  uint64_t least = ready;
  for (uint64_t r : posted_to_) least = r < least ? r : least;
  posted_all_ = least;
  return posted_all_;
}

void Channel::Flush() {
  const int64_t n = num_ranks();
  for (int64_t p = 0; p < n; ++p) {
    auto& queue = queue_[p];
    while (!queue.empty() && CreditOk(p, queue.front().round)) {
      const Outgoing out = queue.front();
      const uint8_t* region = out.staging->mem.data + p * lanes().region_bytes;
      if (remote_index_[p] < 0) {
        local_->Deliver(p, region, out.bytes, out.round);
      } else {
        const int64_t i = remote_index_[p];
        out.staging->remote_pending = true;
        engine_->Write(remote_peers_[i], *out.staging->mr, p * lanes().region_bytes, out.bytes, remote_regions_[i],
                       PeerOffset(out.round, size_t(i)), Imm(config_.data_kind, out.round, uint32_t(config_.rank)),
                       peer_set_);
      }
      out.staging->queued -= 1;
      queue.pop_front();
      cv_.notify_all();
    }
  }
}

bool Channel::HasQueued() const {
  for (const auto& q : queue_) {
    if (!q.empty()) return true;
  }
  return false;
}

bool Channel::Arrived(uint64_t round, std::vector<int32_t>* missing) {
  const int64_t n = num_ranks(), lane = lanes().Lane(round);
  Cursor& c = arrived_cursor_;
  if (c.round != round) c = {round, 0};
  bool all = true;
  for (int64_t p = missing ? 0 : c.next; p < n; ++p) {  // the list of who is missing needs every rank
    bool here;
    if (remote_index_[p] < 0) {
      here = local_->Arrived(p, round);
    } else {
      uint64_t& count = remote_rounds_[p * lanes().count + lane];
      while (engine_->TryConsumeImm(Imm(config_.data_kind, round, uint32_t(p)), 1)) ++count;
      here = count > lanes().Earlier(round);
    }
    if (!here) {
      all = false;
      if (!missing) return false;
      missing->push_back(int32_t(p));
    } else if (!missing) {  // every rank before p is here too: a missing one would have returned
      c.next = p + 1;
    }
  }
  return all;
}

void Channel::Release(uint64_t round) {
  if (local_) local_->Released(round);
  if (!remote_ranks_.empty()) engine_->Barrier(peer_set_, Imm(config_.credit_kind, round, uint32_t(config_.rank)));
  cv_.notify_all();
}

bool Channel::Drained() {
  const int64_t n = num_ranks();
  for (int64_t p = 0; p < n; ++p) {
    if (!queue_[p].empty()) return false;
    if (remote_index_[p] < 0) continue;
    // Rounds send_round + 1 .. send_round + K cover every lane once: each needs the credits of all rounds sent.
    for (int64_t k = 1; k <= lanes().count; ++k) {
      if (!CreditOk(p, send_round_ + uint64_t(k))) return false;
    }
  }
  return true;
}

}  // namespace jax_moe::proxy
