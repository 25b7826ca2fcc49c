// How far the host may run ahead of the GPU. Where the proxy thread calls CUDA (fabric_memory="staged": the copy
// engine's work; GPU areas that need a GPUDirect flush), each such call waits while this process's launch queue is
// full, and a queue filled far ahead (XLA enqueues whole programs, and then the next ones, without waiting) has a
// receive kernel near its head that waits for exactly those calls: the proxy stops, the kernel spins until its
// timeout. Measured on one H200, two processes as two nodes, staged: 20 iterations of the decode benchmark in one
// program passed, 100 (four programs enqueued back to back) stopped in the second. So the plain handlers hold a send
// back until the GPU has rung the bell of the send kRunAhead sends before it on the same GPU, whichever Communicator
// and stream made it (the launch queue is the device's: one Communicator per layer must not multiply the depth). The
// command-buffer handlers are not held.
#pragma once
#include <cstdint>
#include <memory>

#include "cuda/device_comm.h"
#include "cuda/device_error.h"

namespace jax_moe::cuda {

// Sends of staged Communicators that one GPU may have launched beyond the last one it rang (one Communicator
// alternating dispatch and combine: four iterations; one per layer: four layers' rounds, with their compute).
constexpr size_t kRunAhead = 8;

// Before a send of `dev` (plain handlers): where dev's proxy calls CUDA, waits until the
// GPU rang the oldest of its last kRunAhead recorded sends (any Communicator of the GPU); returns at once otherwise.
// Each wait is bounded by that Communicator's timeout and ends early on its device or pump error. Returns dev's own
// sticky or pump report, if any: the caller then launches nothing (as Device() would have refused).
DeviceReport HoldRunAhead(const std::shared_ptr<const DeviceComm>& dev);

// Drops every recorded send of `dev` (DestroyComm, once no handler holds the device, so none records another; it then
// waits again for a hold that locked the device just before): no hold reaches a Communicator being destroyed
// afterwards.
void ForgetSends(int ordinal, const DeviceComm* dev);

// Records a send launched on `stream` of `dev` (what HoldRunAhead waits for later); a no-op where dev's proxy makes
// no CUDA call.
void CountSend(const std::shared_ptr<const DeviceComm>& dev, int stream);

}  // namespace jax_moe::cuda
