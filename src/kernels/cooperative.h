// Cooperative launches: a kernel whose blocks wait on each other (a half's flags raised by its own last block) must
// have every block resident at once, which only a cooperative launch guarantees.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <utility>

namespace jax_moe::cuda {

// Blocks of `kernel` (with `threads` threads and `smem` dynamic shared bytes) resident at once on a device of
// `num_sms` SMs; 0 when the occupancy query fails. Cached per (kernel, threads, smem).
int ResidentBlocks(const void* kernel, int threads, size_t smem, int num_sms);

// Whether the one-shot calls may run as one kernel: `one_kernel` (KernelArgs: no peer shares this GPU) unless
// JAX_MOE_CUDA_ONE_KERNEL says otherwise ("0": never, so a benchmark can compare both in one process; "force": also
// beside a peer on this GPU, safe only when the processes are time-sliced, not under MPS: for tests). Read at every
// launch.
bool OneKernelAllowed(bool one_kernel);

// Launches `kernel` cooperatively (every block resident, or the launch fails and nothing runs).
template <typename... Params, typename... Args>
cudaError_t LaunchCooperative(void (*kernel)(Params...), int blocks, int threads, size_t smem, cudaStream_t stream,
                              Args&&... args) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeCooperative;
  attr.val.cooperative = 1;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cfg.attrs = &attr;
  cfg.numAttrs = 1;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

}  // namespace jax_moe::cuda
