// The send side of CpuComm: credits, staging, delivery now or from the peer queues later.
#include <cstring>

#include "cpu/rank_state.h"

namespace jax_moe::cpu {

namespace {

// A staging buffer whose regions are all delivered and whose remote writes are complete, or a new one.
Staging* AcquireStaging(CpuComm::Rank& me, CpuComm::Direction& d, int64_t n) {
  for (auto& st : d.staging) {
    if (st->queued == 0 && !st->remote_pending) return st.get();
  }
  for (auto& st : d.staging) {
    if (st->queued == 0 && me.engine) {
      // Only remote writes hold it: they complete without any peer's application, so this wait is bounded.
      me.engine->WaitSends(30.0);
      for (auto& other : d.staging) other->remote_pending = false;
      return st.get();
    }
  }
  auto st = std::make_unique<Staging>();
  st->buf = HostBuffer(n * d.region_bytes);
  if (me.engine) st->mr = me.engine->Register(st->buf.data(), st->buf.size());
  d.staging.push_back(std::move(st));
  return d.staging.back().get();
}

uint64_t DestOffset(const CpuComm::Direction& d, int64_t n, uint64_t round, int32_t sender) {
  return (d.Lane(round) * n + sender) * d.region_bytes;
}

}  // namespace

bool CpuComm::CreditOk(Rank& me, DirectionOf dir, int64_t peer, uint64_t round) {
  Direction& d = me.*dir;
  const uint64_t earlier = d.Earlier(round);  // the receiver must have read every earlier round of this lane
  if (earlier == 0) return true;
  const int64_t lane = d.Lane(round);
  if (Rank* q = me.local_peer[peer]) return ((*q).*dir).released[lane].load(std::memory_order_acquire) >= earlier;
  uint64_t& credits = d.remote_credits[peer * d.lanes + lane];
  while (me.engine->TryConsumeImm(MakeImm(d.credit_kind, options_.slot, uint32_t(peer), uint32_t(lane)), 1)) ++credits;
  return credits >= earlier;
}

void CpuComm::SendRound(Rank& me, DirectionOf dir, uint64_t round, const std::vector<int32_t>& rows,
                        const Fill& fill) {
  Direction& d = me.*dir;
  const int64_t n = options_.shape.num_ranks;
  std::vector<char> now(n);
  std::vector<uint8_t*> regions(n);
  Staging* st = nullptr;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool staged = false;
    for (int64_t p = 0; p < n; ++p) {
      now[p] = d.queue[p].empty() && CreditOk(me, dir, p, round);
      staged |= !now[p] || !me.local_peer[p];
    }
    if (staged) st = AcquireStaging(me, d, n);
    for (int64_t p = 0; p < n; ++p) {
      Rank* q = me.local_peer[p];
      regions[p] = (now[p] && q) ? ((*q).*dir).Region(n, round, me.info.rank) : st->buf.data() + p * d.region_bytes;
    }
    if (st) st->queued += 1;  // keeps it ours while we fill it outside the lock
  }
  fill(regions);
  std::lock_guard<std::mutex> lock(mu_);
  if (st) st->queued -= 1;
  std::vector<uint64_t> src, len, dst;
  bool all_remote_now = true;
  for (int64_t p = 0; p < n; ++p) {
    const uint64_t bytes = d.header_bytes + uint64_t(rows[p]) * d.row_bytes;
    if (!now[p]) {
      d.queue[p].push_back({round, st, bytes});
      st->queued += 1;
      all_remote_now &= bool(me.local_peer[p]);
    } else if (Rank* q = me.local_peer[p]) {
      ((*q).*dir).arrived[d.Lane(round) * n + me.info.rank].store(round, std::memory_order_release);
    } else {
      src.push_back(p * d.region_bytes);
      len.push_back(bytes);
      dst.push_back(DestOffset(d, n, round, me.info.rank));
    }
  }
  cv_.notify_all();
  if (src.empty()) return;
  st->remote_pending = true;
  const uint32_t imm = MakeImm(d.data_kind, options_.slot, uint32_t(me.info.rank), uint32_t(d.Lane(round)));
  if (all_remote_now) {  // the common case: one scatter from the group's prebuilt templates
    try {
      me.engine->Scatter(d.group, *st->mr, src.data(), len.data(), dst.data(), src.size(), imm);
      return;
    } catch (const Error& e) {
      if (e.code() != ErrorCode::kPeerFailed) throw;
      // A peer is gone: still serve the others below, so that they fail naming the right rank.
    }
  }
  std::vector<int32_t> failed;
  std::string why;
  for (size_t i = 0, j = 0; i < me.remote_ranks.size(); ++i) {
    const int32_t p = me.remote_ranks[i];
    if (!now[p]) continue;
    try {
      me.engine->Write(me.remote_peers[i], *st->mr, src[j], len[j], d.remote_regions[i], dst[j], imm);
    } catch (const Error& e) {
      failed.push_back(p);
      why = e.what();
    }
    ++j;
  }
  if (!failed.empty()) {
    Throw(ErrorCode::kPeerFailed,
          std::string(d.name) + " on rank " + std::to_string(me.info.rank) + ": cannot write to ranks " +
              RankList(failed) + ": " + why);
  }
}

void CpuComm::FlushQueues(Rank& me, DirectionOf dir) {  // called with mu_ held
  Direction& d = me.*dir;
  const int64_t n = options_.shape.num_ranks;
  for (int64_t p = 0; p < n; ++p) {
    auto& queue = d.queue[p];
    while (!queue.empty() && CreditOk(me, dir, p, queue.front().round)) {
      const Outgoing out = queue.front();
      const uint8_t* region = out.staging->buf.data() + p * d.region_bytes;
      if (Rank* q = me.local_peer[p]) {
        Direction& qd = (*q).*dir;
        std::memcpy(qd.Region(n, out.round, me.info.rank), region, out.bytes);
        qd.arrived[qd.Lane(out.round) * n + me.info.rank].store(out.round, std::memory_order_release);
      } else {
        const int64_t i = me.remote_index[p];
        out.staging->remote_pending = true;
        me.engine->Write(me.remote_peers[i], *out.staging->mr, p * d.region_bytes, out.bytes, d.remote_regions[i],
                         DestOffset(d, n, out.round, me.info.rank),
                         MakeImm(d.data_kind, options_.slot, uint32_t(me.info.rank), uint32_t(d.Lane(out.round))));
      }
      out.staging->queued -= 1;
      queue.pop_front();
      cv_.notify_all();
    }
  }
}

}  // namespace jax_moe::cpu
