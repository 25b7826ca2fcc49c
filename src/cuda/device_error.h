// Errors the kernels raise into a device's host-mapped error word (one 64-bit word: ErrorKind << 32 | detail).
#pragma once
#include <string>

#include "common/error.h"
#include "cuda/device_comm.h"

namespace jax_moe::cuda {

// What a handler reports: the message and which kind of error it is (the handlers map kinds to FFI codes, the same
// as the "cpu" backend's: a bad expert id is INVALID_ARGUMENT, a peer that never answered DEADLINE_EXCEEDED).
struct DeviceReport {
  bool failed = false;
  ErrorCode code = ErrorCode::kInternal;
  std::string message;
  bool empty() const { return !failed; }
};

// The device's error published since the last take, once (it is acknowledged, not cleared); empty when none. A
// timeout (on any local device of the Communicator) is reported instead, by this and every later call: the Communicator is
// unusable after one.
DeviceReport TakeError(const DeviceComm& dev);
// The timeout that ended the Communicator on any local device, if any; clears nothing.
DeviceReport StickyError(const DeviceComm& dev);
// Why the host proxy of the device's remote ranks stopped, if it did (every later call fails with it).
DeviceReport ProxyError(const DeviceComm& dev);

}  // namespace jax_moe::cuda
