// Per-peer connection state machine of the verbs backend (pure: the backend performs the
// ibv_modify_qp calls the transitions ask for). Writes submitted before the peer is connected are
// parked and released in order once it is.
//
//   kIdle --CreateLocal--> kLocalReady --RemoteInfo--> kConnected
//   kIdle --RemoteInfo--> (create local first) kConnected
//   any --Fail--> kFailed (parked writes are returned for failing)
// RemoteInfo on kConnected with the same QP numbers is a duplicate handshake (simultaneous connect)
// and is ignored; different numbers are an error (the peer restarted: fail loudly, never mix).
#pragma once
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "fabric/verbs/handshake.h"

namespace jax_moe::fabric::verbs {

enum class RcState { kIdle, kLocalReady, kConnected, kFailed };
const char* RcStateName(RcState s);

// What the backend must do after an event.
struct RcActions {
  bool create_local_qps = false;  // ibv_create_qp x2 + INIT
  bool connect_qps = false;       // INIT -> RTR -> RTS with `remote`
  bool flush_parked = false;      // post every parked write now
  bool fail_parked = false;       // complete every parked write as failed
};

template <typename Write>
class RcConnection {
 public:
  RcState state() const { return state_; }
  const RcEndpointInfo& remote() const { return remote_; }
  const std::string& failure() const { return failure_; }

  RcActions CreateLocal() {
    RcActions a;
    if (state_ == RcState::kIdle) {
      a.create_local_qps = true;
      state_ = RcState::kLocalReady;
    }
    return a;
  }

  // The peer's blob arrived. Returns actions, or fails the connection on a conflicting blob.
  RcActions RemoteInfo(const RcEndpointInfo& info) {
    RcActions a;
    switch (state_) {
      case RcState::kFailed:
        return a;
      case RcState::kConnected:
        if (info.msg_qpn != remote_.msg_qpn || info.rma_qpn != remote_.rma_qpn) {
          return Fail("peer re-handshook with different QPs (restarted?)");
        }
        return a;  // duplicate
      case RcState::kIdle:
        a.create_local_qps = true;
        [[fallthrough]];
      case RcState::kLocalReady:
        remote_ = info;
        a.connect_qps = true;
        a.flush_parked = !parked_.empty();
        state_ = RcState::kConnected;
        return a;
    }
    return a;
  }

  RcActions Fail(const std::string& why) {
    RcActions a;
    if (state_ == RcState::kFailed) return a;
    failure_ = why;
    state_ = RcState::kFailed;
    a.fail_parked = !parked_.empty();
    return a;
  }

  // A write for this peer: true = post it now; false = parked (not yet connected). Throws nothing;
  // callers check state() == kFailed first.
  bool Submit(const Write& w) {
    if (state_ == RcState::kConnected) return true;
    parked_.push_back(w);
    return false;
  }
  std::vector<Write> TakeParked() {
    std::vector<Write> out(parked_.begin(), parked_.end());
    parked_.clear();
    return out;
  }
  size_t parked() const { return parked_.size(); }

 private:
  RcState state_ = RcState::kIdle;
  RcEndpointInfo remote_;
  std::string failure_;
  std::deque<Write> parked_;
};

}  // namespace jax_moe::fabric::verbs
