// The host side of the protocol for one Communicator in one process: the channels of its local ranks, the progress
// thread that delivers queued regions as credits arrive, bounded waits that name the late peers, and the sticky first
// error. The device side ("cpu" today, the GPU proxy next) packs and unpacks regions around it.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/error.h"
#include "proxy/channel.h"

namespace jax_moe::proxy {

class Proxy {
 public:
  explicit Proxy(double timeout_s);
  // Stops the progress thread (call Drain first to let queued regions and owed credits settle).
  ~Proxy();
  Proxy(const Proxy&) = delete;
  Proxy& operator=(const Proxy&) = delete;

  std::mutex& mu() { return mu_; }
  std::condition_variable& cv() { return cv_; }
  double timeout_s() const { return timeout_s_; }

  // Starts the progress thread over `channels` (which outlive it).
  void Start(std::vector<Channel*> channels);

  // Failure: the first error marks the Communicator failed; later calls fail at once with it, with its code, so that
  // every rank and every later call report one error the same way.
  void CheckHealthy() const;
  void Fail(const std::string& message, ErrorCode code);
  bool failed() const;
  // Runs a half: a failure marks the Communicator failed and is rethrown.
  void Guard(const std::function<void()>& fn);

  // Blocks until every sender's region of `round` arrived in `ch`. Bounded by the timeout: the error names the ranks
  // that did not answer (`name(rank)`). `sender_failure(rank)` is the error a rank reported in a region that did
  // arrive (empty when none): it ends the wait at once, since other ranks of its process may never send this round.
  // Names are built only for an error: receives run on every round.
  void WaitRound(Channel& ch, uint64_t round, const std::function<std::string(int64_t)>& name,
                 const std::function<std::string(int64_t)>& sender_failure);

  // Waits (bounded by min(timeout, bound_s)) until the channels hold nothing queued and every remote peer gave credit
  // for every round sent: then no write of ours is owed or on its way, and our engine may close without leaving a
  // peer's write hanging. After a failure it only waits for the queued regions (they may carry the error).
  void Drain(double bound_s);

 private:
  void Loop();

  const double timeout_s_;
  std::vector<Channel*> channels_;
  mutable std::mutex failure_mu_;
  std::string failure_;
  ErrorCode failure_code_ = ErrorCode::kPeerFailed;
  std::mutex mu_;  // queues, staging and credits of every channel; waiters and the progress thread sleep on cv_
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread progress_;
};

}  // namespace jax_moe::proxy
