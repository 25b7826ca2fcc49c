// Measured device-to-device copy bandwidth, the reference the benchmark compares NVLink traffic with.
#pragma once
#include <cstddef>

namespace jax_moe::cuda {

// Measured cudaMemcpyPeerAsync bandwidth (bytes / s) from device src to device dst.
double PeerCopyBandwidth(int src, int dst, size_t bytes, int iters);

}  // namespace jax_moe::cuda
