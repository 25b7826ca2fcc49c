#include "proxy/proxy.h"

#include <algorithm>
#include <chrono>

#include "common/deadline.h"
#include "common/format.h"

namespace jax_moe::proxy {

Proxy::Proxy(double timeout_s) : timeout_s_(timeout_s) { Require(timeout_s > 0, "Proxy: timeout must be positive"); }

Proxy::~Proxy() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (progress_.joinable()) progress_.join();
}

void Proxy::Start(std::vector<Channel*> channels) {
  channels_ = std::move(channels);
  progress_ = std::thread([this] { Loop(); });
}

void Proxy::CheckHealthy() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  if (!failure_.empty()) {
    Throw(failure_code_, "this Communicator failed earlier (" + failure_ +
                             "); its rounds cannot resume: build a new Communicator (every process, as for the first)");
  }
}

void Proxy::Fail(const std::string& message, ErrorCode code) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) {
      failure_ = message;
      failure_code_ = code;
    }
  }
  cv_.notify_all();
}

bool Proxy::failed() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return !failure_.empty();
}

void Proxy::Guard(const std::function<void()>& fn) {
  CheckHealthy();
  try {
    fn();
  } catch (const Error& e) {
    Fail(e.what(), e.code());
    throw;
  } catch (const std::exception& e) {
    Fail(e.what(), ErrorCode::kInternal);
    Throw(ErrorCode::kInternal, e.what());
  }
}

void Proxy::WaitRound(Channel& ch, uint64_t round, const std::function<std::string(int64_t)>& name,
                      const std::function<std::string(int64_t)>& sender_failure) {
  const Deadline deadline = Deadline::After(timeout_s_);
  const int64_t n = ch.num_ranks();
  // Remote arrivals are polled (immediates are counted, not signalled); same-process ones wake us through cv_.
  const auto nap = ch.remote_ranks().empty() ? std::chrono::microseconds(20000) : std::chrono::microseconds(100);
  std::unique_lock<std::mutex> lock(mu_);
  std::vector<int32_t> missing;
  while (!ch.Arrived(round, &missing)) {
    CheckHealthy();
    for (int64_t p = 0, j = 0; p < n; ++p) {
      if (j < int64_t(missing.size()) && missing[j] == p) {
        ++j;
        continue;
      }
      std::string failed = sender_failure(p);
      if (!failed.empty()) Throw(ErrorCode::kInvalidArgument, failed);
    }
    if (deadline.Expired()) {
      std::string names;
      for (int32_t p : missing) names += (names.empty() ? "" : ", ") + name(p);
      Throw(ErrorCode::kTimeout, std::string(ch.config().name) + " on " + name(ch.config().rank) + ": no data from " + names +
                                     " within " + Format("%g", timeout_s_) + " s (round " + std::to_string(round) +
                                     "): its process may have died or stopped calling this Communicator");
    }
    missing.clear();
    cv_.wait_for(lock, nap);
  }
}

void Proxy::Drain(double bound_s) {
  // After a failure, peers stop giving credit, but regions still queued may carry the error that lets them fail at
  // once (a sender's bad expert id): those are still delivered where credit comes, within the same bound.
  const bool failed_before = failed();
  const Deadline deadline = Deadline::After(std::min(timeout_s_, bound_s));
  std::unique_lock<std::mutex> lock(mu_);
  try {
    for (;;) {
      bool drained = true;
      for (Channel* ch : channels_) drained = drained && (failed_before ? !ch->HasQueued() : ch->Drained());
      if (drained || deadline.Expired() || (!failed_before && failed())) return;
      cv_.wait_for(lock, std::chrono::microseconds(200));
    }
  } catch (const std::exception&) {  // a closed or failed engine: nothing more will come
  }
}

void Proxy::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (!stop_) {
    bool waiting = false;
    for (Channel* ch : channels_) {
      try {
        ch->Flush();
      } catch (const Error& e) {
        Fail(e.what(), e.code());
      }
      waiting |= ch->HasQueued();
    }
    cv_.wait_for(lock, waiting ? std::chrono::microseconds(100) : std::chrono::microseconds(20000));
  }
}

}  // namespace jax_moe::proxy
