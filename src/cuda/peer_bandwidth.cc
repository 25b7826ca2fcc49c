// The benchmark's reference: what the copy engine moves between two GPUs (cudaMemcpyPeerAsync).
#include "cuda/peer_bandwidth.h"

#include <cuda_runtime.h>

#include "cuda/cuda_scope.h"

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

}  // namespace jax_moe::cuda
