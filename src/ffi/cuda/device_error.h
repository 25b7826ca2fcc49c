// Errors the kernels raise into a device's host-mapped error word (one 64-bit word: ErrorKind << 32 | detail).
#pragma once
#include <string>

#include "ffi/cuda/group.h"

namespace jax_moe::cuda {

// Reads and clears the device's error word: empty when no error was raised since the last call. A timeout stays
// set (the group is unusable after one), so it is reported again by every later call.
std::string TakeError(const DeviceGroup& dev);
// The timeout that ended this device's group, if any (for the send halves; does not clear anything).
std::string StickyError(const DeviceGroup& dev);

}  // namespace jax_moe::cuda
