// A kernel that reads a buffer once (16-byte loads, grid-stride) and folds it into one word: the benchmark's measure
// of how fast the GPU reads pinned host memory in place, as the receive kernels of remote ranks do.
#include "kernels/moe_kernels.h"

namespace jax_moe::cuda {
namespace {

__global__ void ReadFoldKernel(const int4* src, long long vectors, unsigned long long* out) {
  unsigned long long acc = 0;
  for (long long i = blockIdx.x * static_cast<long long>(blockDim.x) + threadIdx.x; i < vectors;
       i += static_cast<long long>(gridDim.x) * blockDim.x) {
    const int4 v = __ldcg(src + i);
    acc ^= static_cast<unsigned long long>(static_cast<unsigned>(v.x ^ v.y ^ v.z ^ v.w));
  }
  if (acc == 0x9e3779b97f4a7c15ull) atomicXor(out, acc);  // never true for zeroed memory: keeps the loads alive
}

}  // namespace

cudaError_t LaunchReadFold(const void* src, size_t bytes, unsigned long long* out, int blocks, cudaStream_t stream) {
  ReadFoldKernel<<<blocks, 256, 0, stream>>>(static_cast<const int4*>(src), static_cast<long long>(bytes / 16), out);
  return cudaGetLastError();
}

}  // namespace jax_moe::cuda
