// What every handler of both device sides shares: one mapping from jax_moe errors to FFI codes (so one condition
// raises the same Python exception on "cpu" and "cuda"), buffer shape checks, and running a call that may throw.
#pragma once
#include <cstdint>
#include <exception>
#include <initializer_list>
#include <string>

#include "common/error.h"
#include "xla/ffi/api/ffi.h"

namespace jax_moe::ffi_util {

namespace ffi = xla::ffi;

// kTimeout -> DEADLINE_EXCEEDED, kMisuse -> FAILED_PRECONDITION, a peer's failure -> UNAVAILABLE.
inline ffi::Error ToFfi(ErrorCode code, const std::string& message) {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return ffi::Error::InvalidArgument(message);
    case ErrorCode::kTimeout:
      return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
    case ErrorCode::kMisuse:
      return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
    case ErrorCode::kPeerFailed:
    case ErrorCode::kUnavailable:
    case ErrorCode::kClosed:
      return ffi::Error(ffi::ErrorCode::kUnavailable, message);
    default:
      return ffi::Error::Internal(message);
  }
}

// Runs `fn()`, turning every exception into an ffi::Error whose message starts with `prefix`.
template <typename Fn>
ffi::Error Guarded(const char* prefix, Fn&& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return ToFfi(e.code(), std::string(prefix) + e.what());
  } catch (const std::exception& e) {
    return ffi::Error::Internal(std::string(prefix) + e.what());
  }
  return ffi::Error::Success();
}

// True when `buffer` has exactly the dimensions `dims`.
template <typename B>
bool HasDims(const B& buffer, std::initializer_list<int64_t> dims) {
  auto d = buffer.dimensions();
  if (d.size() != dims.size()) return false;
  size_t i = 0;
  for (int64_t want : dims) {
    if (d[i++] != want) return false;
  }
  return true;
}

// A buffer that does not fit the Communicator it is called for (a caller's bug: nothing runs).
inline ffi::Error Mismatch(const char* prefix, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(prefix) + what + " does not match the Communicator's shape");
}

}  // namespace jax_moe::ffi_util
