// EngineCore progress thread: drains submissions, polls completions, and the waits that sleep on them.
#include "fabric/engine_core.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <set>

#include "common/deadline.h"
#include "common/error.h"
#include "common/log.h"

namespace jax_moe::fabric {

namespace {

constexpr size_t kRecvBuffers = 32;
constexpr size_t kRecvBytes = 16384;
constexpr size_t kPollBatch = 64;

}  // namespace

void EngineCore::ProgressLoop() {
  if (options_.progress_cpu >= 0 || !options_.progress_cpus.empty()) {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (options_.progress_cpu >= 0) {
      CPU_SET(options_.progress_cpu, &set);
    } else {
      for (int c : options_.progress_cpus)
        if (c >= 0 && c < CPU_SETSIZE) CPU_SET(c, &set);
    }
    int rc = pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
    if (rc != 0) JAX_MOE_LOG(kWarn, "pinning the progress thread (CPU %d, %d cores) failed: %d",
                             int(options_.progress_cpu), int(options_.progress_cpus.size()), int(rc));
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
  progress_owner = this;
  uint64_t idle = 0;
  auto nap = std::chrono::microseconds(20);
  auto last_work = std::chrono::steady_clock::now();
  PassClock clock(profile_);
  while (!stop_.load(std::memory_order_relaxed)) {
    pass_seq_.fetch_add(1, std::memory_order_seq_cst);  // odd: inside a pass
    bool work = false;
    // Completions first, then the hooks (a proxy sees what just arrived and what its device rang), then what the
    // hooks and other threads submitted is posted in this same pass: seeing a bell and posting its writes take one
    // pass, not two. Each phase fails alone: an error in one must not starve the others (nor the callers waiting in
    // RunOnProgress), pass after pass.
    const auto phase = [&](const char* what, auto&& fn) {
      try {
        work |= fn();
      } catch (const std::exception& e) {
        JAX_MOE_LOG(kError, "progress thread, %s: %s", what, e.what());
      }
    };
    phase("polling", [&] { return PollAll(); });
    clock.Lap(PassProfile::kPoll);
    {
      std::lock_guard<std::mutex> lock(hook_mu_);  // RemoveProgressHook waits for a running hook on it
      for (auto& hook : hooks_) phase("a progress hook", hook.second);
    }
    clock.Lap(PassProfile::kHooks);
    phase("submissions", [&] { return DrainSubmissions(); });
    phase("posting", [&] { return PostPending(); });
    clock.Lap(PassProfile::kPost);
    if (!hello_resend_.empty()) phase("hellos", [&] { ResendHellos(); return false; });
    clock.Pass();
    pass_seq_.fetch_add(1, std::memory_order_seq_cst);  // even: between passes
    if (work) {
      idle = 0;
      nap = std::chrono::microseconds(20);
      last_work = std::chrono::steady_clock::now();
      continue;
    }
    ++idle;
    // A busy-polling engine (a GPU's proxy) owns its core: it yields rarely, only so that a thread sharing the core
    // by mistake is not starved. Others yield every 16th idle pass to the waiters and processes beside them.
    if (options_.busy_poll) {
      if ((idle & 1023) == 0) sched_yield();
      continue;
    }
    if (idle < 200 || (idle & 63) != 0 ||
        std::chrono::steady_clock::now() - last_work < kHotWindow) {  // the clock is read every 64th pass
      if ((idle & 15) == 0) sched_yield();
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
    clock.Restart();  // a nap is not a pass
  }
}

uint64_t EngineCore::AddProgressHook(std::function<bool()> hook) {
  Require(static_cast<bool>(hook), "add_progress_hook: empty hook");
  std::lock_guard<std::mutex> lock(hook_mu_);
  const uint64_t id = next_hook_id_++;
  hooks_.emplace(id, std::move(hook));
  return id;
}

void EngineCore::RemoveProgressHook(uint64_t id) {
  std::function<bool()> gone;  // destroyed outside the lock
  std::lock_guard<std::mutex> lock(hook_mu_);
  auto it = hooks_.find(id);
  if (it == hooks_.end()) return;
  gone = std::move(it->second);
  hooks_.erase(it);
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
  op->set_in_flight.reset();
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
  if (op->set_in_flight) op->set_in_flight->fetch_sub(1, std::memory_order_release);
  if (!ok) write_errors_++;
  writes_completed_++;
  FreeOp(op);
}

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

}  // namespace jax_moe::fabric
