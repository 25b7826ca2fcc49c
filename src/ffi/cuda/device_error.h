// Errors the kernels raise into a device's host-mapped error word (one 64-bit word: ErrorKind << 32 | detail).
#pragma once
#include <string>

#include "ffi/cuda/group.h"

namespace jax_moe::cuda {

// The device's error published since the last take, once (it is acknowledged, not cleared); empty when none. A
// timeout (on any local device of the group) is reported instead, by this and every later call: the group is
// unusable after one.
std::string TakeError(const DeviceGroup& dev);
// The timeout that ended the group on any local device, if any; clears nothing.
std::string StickyError(const DeviceGroup& dev);

}  // namespace jax_moe::cuda
