#include "common/error.h"

namespace jax_moe {

const char* ErrorCodeName(ErrorCode code) {
  switch (code) {
    case ErrorCode::kInvalidArgument: return "invalid argument";
    case ErrorCode::kTimeout: return "timeout";
    case ErrorCode::kPeerFailed: return "peer failed";
    case ErrorCode::kUnavailable: return "unavailable";
    case ErrorCode::kClosed: return "closed";
    case ErrorCode::kInternal: return "internal";
    case ErrorCode::kMisuse: return "misuse";
  }
  return "unknown";
}

void Throw(ErrorCode code, const std::string& message) { throw Error(code, message); }

}  // namespace jax_moe
