// How far the host may run ahead of the GPU. Where the proxy thread calls CUDA (fabric_memory="staged": the copy
// engine's work; GPU areas that need a GPUDirect flush), each such call waits while this process's launch queue is
// full, and a queue filled far ahead (XLA enqueues whole programs, and then the next ones, without waiting) has a
// receive kernel near its head that waits for exactly those calls: the proxy stops, the kernel spins until its
// timeout. Measured on one H200, two processes as two nodes, staged: 20 iterations of the decode benchmark in one
// program passed, 100 (four programs enqueued back to back) stopped in the second. So the plain handlers hold a send
// back until the GPU has rung the bell of the round kRunAhead before it; the command-buffer handlers are not called
// per execution and are not held.
#pragma once
#include <cstdint>

#include "cuda/device_comm.h"

namespace jax_moe::cuda {

// Rounds of one stream that may be launched beyond the last one this GPU has rung (a few rounds: a full queue is
// hundreds of launches, one round a dozen).
constexpr uint64_t kRunAhead = 4;

// Before a send on round stream `stream` (plain handlers): waits until this GPU rang round (sends launched + 1 -
// kRunAhead), where the proxy calls CUDA; returns at once otherwise. Bounded by the Communicator's timeout, and ends
// early once the device or the pump reports an error (the launch then reports it, or its kernel times out).
void HoldRunAhead(const DeviceComm& dev, int stream);

// Counts a send launched on `stream` (what HoldRunAhead compares the GPU's bell with).
void CountSend(const DeviceComm& dev, int stream);

}  // namespace jax_moe::cuda
