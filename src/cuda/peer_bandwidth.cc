// The benchmark's reference: what the copy engine moves between two GPUs (cudaMemcpyPeerAsync).
#include "cuda/peer_bandwidth.h"

#include <cuda_runtime.h>

#include <cstring>

#include "cuda/cuda_scope.h"
#include "kernels/moe_kernels.h"

namespace jax_moe::cuda {

double PeerCopyBandwidth(int src, int dst, size_t bytes, int iters) {
  void* a = nullptr;
  void* b = nullptr;
  {
    DeviceScope s(src);
    Check(cudaMalloc(&a, bytes), "cudaMalloc");
    if (src != dst) {
      cudaError_t err = cudaDeviceEnablePeerAccess(dst, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError(); else Check(err, "cudaDeviceEnablePeerAccess");
    }
  }
  {
    DeviceScope s(dst);
    Check(cudaMalloc(&b, bytes), "cudaMalloc");
  }
  DeviceScope s(src);
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  Check(cudaMemcpyPeerAsync(b, dst, a, src, bytes, stream), "cudaMemcpyPeerAsync");  // warm-up
  Check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) Check(cudaMemcpyPeerAsync(b, dst, a, src, bytes, stream), "cudaMemcpyPeerAsync");
  Check(cudaEventRecord(stop, stream), "cudaEventRecord");
  Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  cudaFree(a);
  {
    DeviceScope t(dst);
    cudaFree(b);
  }
  return static_cast<double>(bytes) * iters / (ms * 1e-3);
}

std::tuple<double, double, double> HostReadBandwidth(int ordinal, size_t bytes, int iters) {
  bytes = bytes / 16 * 16;
  DeviceScope scope(ordinal);
  void* host = nullptr;
  void* mapped = nullptr;
  void* dev = nullptr;
  Check(cudaHostAlloc(&host, bytes, cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  Check(cudaHostGetDevicePointer(&mapped, host, 0), "cudaHostGetDevicePointer");
  Check(cudaMalloc(&dev, bytes + 64), "cudaMalloc");
  cudaMemset(dev, 0, bytes + 64);
  int sms = 1;
  Check(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ordinal), "cudaDeviceGetAttribute");
  unsigned long long* out = reinterpret_cast<unsigned long long*>(static_cast<char*>(dev) + bytes);
  cudaStream_t stream;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cudaEvent_t start, stop;
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  auto timed = [&](auto&& op) {
    op();  // warm-up
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < iters; ++i) op();
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    return static_cast<double>(bytes) * iters / (ms * 1e-3);
  };
  const double copy = timed([&] { Check(cudaMemcpyAsync(dev, host, bytes, cudaMemcpyHostToDevice, stream), "cudaMemcpyAsync"); });
  const double read = timed([&] { Check(LaunchReadFold(mapped, bytes, out, 4 * sms, stream), "ReadFold"); });
  // The same right after the CPU wrote the buffer (as a host transport does before the receive kernel reads it):
  // its lines may still sit dirty in the CPU's caches.
  float total_ms = 0;
  for (int i = 0; i < iters; ++i) {
    std::memset(host, i + 1, bytes);
    Check(cudaEventRecord(start, stream), "cudaEventRecord");
    Check(LaunchReadFold(mapped, bytes, out, 4 * sms, stream), "ReadFold");
    Check(cudaEventRecord(stop, stream), "cudaEventRecord");
    Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    Check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    total_ms += ms;
  }
  const double fresh = static_cast<double>(bytes) * iters / (total_ms * 1e-3);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  cudaFree(dev);
  cudaFreeHost(host);
  return {copy, read, fresh};
}

}  // namespace jax_moe::cuda
