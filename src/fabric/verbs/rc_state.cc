#include "fabric/verbs/rc_state.h"

namespace jax_moe::fabric::verbs {

const char* RcStateName(RcState s) {
  switch (s) {
    case RcState::kIdle: return "idle";
    case RcState::kLocalReady: return "local-ready";
    case RcState::kConnected: return "connected";
    case RcState::kFailed: return "failed";
  }
  return "?";
}

}  // namespace jax_moe::fabric::verbs
