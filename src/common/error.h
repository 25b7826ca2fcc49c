// Error type shared by the native layers: an exception carrying a category, so bindings can map it
// (kTimeout -> TimeoutError, kInvalidArgument -> ValueError, kPeerFailed -> ConnectionError).
#pragma once
#include <stdexcept>
#include <string>

namespace jax_moe {

enum class ErrorCode {
  kInvalidArgument,  // bad input from the caller; nothing was posted
  kTimeout,          // a wait ran past its deadline
  kPeerFailed,       // a peer is unreachable or a transfer to it failed
  kUnavailable,      // the requested provider/device is not present
  kClosed,           // the object was closed
  kInternal,         // a library call failed unexpectedly
  kMisuse,           // the API was used against its contract (e.g. a send whose round is never received)
};

const char* ErrorCodeName(ErrorCode code);

class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message) : std::runtime_error(message), code_(code) {}
  ErrorCode code() const { return code_; }

 private:
  ErrorCode code_;
};

[[noreturn]] void Throw(ErrorCode code, const std::string& message);

// Throws kInvalidArgument with `message` when `cond` is false.
inline void Require(bool cond, const std::string& message) {
  if (!cond) Throw(ErrorCode::kInvalidArgument, message);
}

}  // namespace jax_moe

// Require for the data path: `message` is only built when `cond` fails. Require's string argument is built on every
// call, which on a proxy's post (a few concatenations and to_string per check) cost microseconds.
#define JAX_MOE_REQUIRE(cond, message)                                                   \
  do {                                                                                   \
    if (!(cond)) ::jax_moe::Throw(::jax_moe::ErrorCode::kInvalidArgument, (message));    \
  } while (0)
