// Host side of the one-shot kernels (queue.cuh): how many blocks to launch, and whether to run one kernel at all.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>

namespace jax_moe::cuda {

// Blocks of `kernel` (with `threads` threads and `smem` dynamic shared bytes) resident at once on the current device
// (`num_sms` SMs); 0 when the occupancy query fails (not cached, so a later call asks again). Cached per (device,
// kernel, threads, smem).
int ResidentBlocks(const void* kernel, int threads, size_t smem, int num_sms);

// Whether the one-shot calls may run as one kernel: yes unless JAX_MOE_CUDA_ONE_KERNEL=0 (the two kernels, so that a
// benchmark can compare both in one process). Read at every launch.
bool OneKernelAllowed();

// Blocks to launch for a one-shot kernel with `parts` parts in all: one resident wave at most (the queue hands the
// parts out, so fewer blocks than parts is correct; more would only wait), at least one.
int OneKernelBlocks(const void* kernel, int threads, size_t smem, int num_sms, int parts);

// A one-shot call's one kernel: its blocks (0: the call runs as two kernels) and its send and receive parts.
struct OnePlan {
  int blocks = 0;
  int send_parts = 0;
  int recv_parts = 0;
};

}  // namespace jax_moe::cuda
