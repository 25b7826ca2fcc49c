// The words a device and its pump share per direction (proxy/pump.h has who writes which and when). Host and device
// code include it: the kernels address the words by these indices in host-mapped memory.
#pragma once

namespace jax_moe::proxy {

enum BellWord { kRung = 0, kSent = 1, kArrived = 2, kRead = 3, kError = 4, kBellWords = 8 };

}  // namespace jax_moe::proxy
