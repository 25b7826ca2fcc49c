// The FFI layer's way to the kernels: each call enqueues a half (or a one-shot pair) of one device's Communicator on
// `stream`, with that device's kernel arguments. The layers above src/cuda include this, never a kernels launcher;
// the calls' arguments are the kernels' plain Io structs (buffers and sizes, no behaviour).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "cuda/device_comm.h"
#include "kernels/moe_kernels.h"

namespace jax_moe::cuda {

cudaError_t Launch(const DeviceComm& dev, const DispatchSendIo& io, cudaStream_t stream);
cudaError_t Launch(const DeviceComm& dev, const DispatchRecvIo& io, cudaStream_t stream);
cudaError_t Launch(const DeviceComm& dev, const CombineSendIo& io, cudaStream_t stream);
cudaError_t Launch(const DeviceComm& dev, const CombineRecvIo& io, cudaStream_t stream);

// The one-shot calls (kernels/moe_kernels.h LaunchDispatch / LaunchCombine): `send_launched` as there.
cudaError_t Launch(const DeviceComm& dev, const DispatchSendIo& send, const DispatchRecvIo& recv, cudaStream_t stream,
                   bool* send_launched);
cudaError_t Launch(const DeviceComm& dev, const CombineSendIo& send, const CombineRecvIo& recv, cudaStream_t stream,
                   bool* send_launched);

// Each NVLink kernel's launch shape for `tokens` tokens, named as the Python tests and benchmarks name the halves
// ("dispatch_send", ..., "dispatch" / "combine" for the one-shot calls' one kernel: blocks 0 where not fused).
struct NamedShape {
  const char* name;
  int blocks;
  int threads;
};
std::vector<NamedShape> LaunchShapes(const DeviceComm& dev, int tokens);

// The device's global timer (ns) into out[0], on `stream` (the benchmark's stamps).
cudaError_t LaunchStamp(uint64_t* out, cudaStream_t stream);

}  // namespace jax_moe::cuda
