#include "cuda/launch.h"

namespace jax_moe::cuda {

cudaError_t Launch(const DeviceComm& dev, const DispatchSendIo& io, cudaStream_t stream) {
  return LaunchDispatchSend(dev.args, io, stream);
}
cudaError_t Launch(const DeviceComm& dev, const DispatchRecvIo& io, cudaStream_t stream) {
  return LaunchDispatchRecv(dev.args, io, stream);
}
cudaError_t Launch(const DeviceComm& dev, const CombineSendIo& io, cudaStream_t stream) {
  return LaunchCombineSend(dev.args, io, stream);
}
cudaError_t Launch(const DeviceComm& dev, const CombineRecvIo& io, cudaStream_t stream) {
  return LaunchCombineRecv(dev.args, io, stream);
}
cudaError_t Launch(const DeviceComm& dev, const DispatchSendIo& send, const DispatchRecvIo& recv, cudaStream_t stream,
                   bool* send_launched) {
  return LaunchDispatch(dev.args, send, recv, stream, send_launched);
}
cudaError_t Launch(const DeviceComm& dev, const CombineSendIo& send, const CombineRecvIo& recv, cudaStream_t stream,
                   bool* send_launched) {
  return LaunchCombine(dev.args, send, recv, stream, send_launched);
}
std::vector<NamedShape> LaunchShapes(const DeviceComm& dev, int tokens) {
  const KernelArgs& a = dev.args;
  auto named = [](const char* name, LaunchShape s) { return NamedShape{name, s.blocks, s.threads}; };
  return {named("dispatch_send", DispatchSendShape(a, tokens)),
          named("dispatch_recv", DispatchRecvShape(a)),
          named("combine_send", CombineSendShape(a, kWeighted)),
          named("combine_send_per_entry", CombineSendShape(a, kPerEntry)),
          named("combine_recv", CombineRecvShape(a, tokens)),
          named("dispatch", DispatchShape(a, tokens)),
          named("combine", CombineShape(a, kWeighted, tokens))};
}
cudaError_t LaunchStamp(uint64_t* out, cudaStream_t stream) { return LaunchTimestamp(out, stream); }

}  // namespace jax_moe::cuda
