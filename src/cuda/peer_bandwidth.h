// Measured device-to-device copy bandwidth, the reference the benchmark compares NVLink traffic with.
#pragma once
#include <cstddef>
#include <tuple>

namespace jax_moe::cuda {

// Measured cudaMemcpyPeerAsync bandwidth (bytes / s) from device src to device dst.
double PeerCopyBandwidth(int src, int dst, size_t bytes, int iters);

// How fast device `ordinal` gets pinned host memory (bytes / s): {copy engine (cudaMemcpyAsync host to device),
// a kernel reading the mapped memory in place (what the receive kernels of remote ranks do), the same kernel right
// after the CPU wrote the memory}.
std::tuple<double, double, double> HostReadBandwidth(int ordinal, size_t bytes, int iters);

}  // namespace jax_moe::cuda
