// XLA FFI handlers of the four halves: check shapes against the Communicator, then enqueue the kernels on XLA's stream.
// Host work per call is a registry lookup and a read of the mapped error word, never a device synchronisation.
// Every handler exists twice. The plain one is not command-buffer compatible: each call runs on the host, so the recv
// halves report errors raised by earlier kernels (a recv half that reports one still launches its kernel first, so
// this device keeps its epochs in step). The "Graph" one is marked compatible (XLA may capture it into a CUDA graph
// and replay it without calling the handler): valid because all per-call state (epochs, flags) lives on the device
// and the launch arguments depend only on the shapes; errors then surface through CudaBackend.take_errors().
#include "ffi/cuda/handlers.h"

#include <cuda_runtime.h>

#include <memory>
#include <string>

#include "cuda/device_comm.h"
#include "cuda/device_error.h"
#include "cuda/launch.h"
#include "cuda/run_ahead.h"
#include "ffi/ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe::cuda {
namespace {

ffi::Error Launched(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jax_moe cuda: launching ") + what + " failed: " + cudaGetErrorString(err));
}

// The FFI code of a device report: the same mapping as the "cpu" backend's (ffi/ffi_util.h).
ffi::Error ToFfi(const DeviceReport& r) {
  return r.empty() ? ffi::Error::Success() : ffi_util::ToFfi(r.code, r.message);
}

// A send is refused while its stream holds kRoundSlots rounds that were never received: its kernel would wait for
// peers' acks of the oldest forever (every rank runs the same program, so every rank refuses alike). jax_moe.rounds
// refuses such programs at trace time; this catches handles that crossed programs (sends in one jitted call, no
// receive later).
ffi::Error CheckStreamFree(const DeviceComm& dev, int stream, const char* op) {
  if (dev.open_rounds[stream].load(std::memory_order_relaxed) < kRoundSlots) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("jax_moe cuda: ") + op + " on " + dev.names[dev.args.rank] + ": the previous " +
                        std::to_string(kRoundSlots) + " " + (stream == 0 ? "dispatch_send" : "combine_send") +
                        " calls of this Communicator were never received (each handle must reach the receive half "
                        "exactly once); backend 'cuda' holds " + std::to_string(kRoundSlots) +
                        " rounds per direction, so this Communicator cannot go on: build a new one");
}

// A one-shot call receives at once, and a receive takes the oldest open round of its stream: refused while any is
// open (jax_moe.rounds refuses it at trace time; this catches handles kept across programs).
ffi::Error CheckStreamEmpty(const DeviceComm& dev, int stream, const char* op) {
  if (dev.open_rounds[stream].load(std::memory_order_relaxed) <= 0) return ffi::Error::Success();
  return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                    std::string("jax_moe cuda: ") + op + " on " + dev.names[dev.args.rank] + ": a " +
                        (stream == 0 ? "dispatch_send" : "combine_send") +
                        " of this Communicator was never received, and backend 'cuda' receives rounds in the order "
                        "they were sent, so this one-shot call cannot run before it (each handle must reach the "
                        "receive half exactly once; a handle dropped leaves this Communicator unusable: build a new "
                        "one)");
}

ffi::Error Device(int64_t comm_id, int32_t ordinal, std::shared_ptr<const DeviceComm>& dev) {
  dev = FindDevice(comm_id, ordinal);
  if (!dev) {
    return ffi::Error::InvalidArgument("jax_moe cuda: Communicator " + std::to_string(comm_id) + " has no buffers on device " +
                                       std::to_string(ordinal) + " (was the Communicator built on this mesh?)");
  }
  if (!dev->connected) return ffi::Error::Internal("jax_moe cuda: Communicator " + std::to_string(comm_id) + " not connected");
  // After a timeout the peers' epochs are out of step with this device's: nothing is launched any more. The same
  // after the host proxy of its remote ranks stopped.
  if (DeviceReport failed = StickyError(*dev); !failed.empty()) return ToFfi(failed);
  if (DeviceReport failed = ProxyError(*dev); !failed.empty()) return ToFfi(failed);
  return ffi::Error::Success();
}

// The send halves write 4 int32 into their ticket result (the epoch; it orders the recv half after the send).
ffi::Error CheckTicket(size_t elements) {
  if (elements != 4) return ffi::Error::InvalidArgument("jax_moe cuda: the ticket result must be int32[4]");
  return ffi::Error::Success();
}

// fp8 scales are float32, one per 128 channels.
ffi::Error CheckScaleType(const char* what, ffi::DataType type) {
  if (type != ffi::DataType::F32)
    return ffi::Error::InvalidArgument(std::string("jax_moe cuda: ") + what + " must be float32");
  return ffi::Error::Success();
}

// Router weights given to dispatch_send: float32 [T, R] (T = the tokens of x).
ffi::Error CheckWeights(ffi::AnyBuffer w, int64_t tokens, int r) {
  const auto dims = w.dimensions();
  if (w.element_type() != ffi::DataType::F32 || dims.size() != 2 || dims[0] != tokens || dims[1] != r)
    return ffi::Error::InvalidArgument("jax_moe cuda: topk_weights must be float32 [T, experts_per_token]");
  return ffi::Error::Success();
}

// The combine modes (kernels/moe_layout.h CombineMode). Channel 1 (dispatch's transpose) returns summed rows: its
// fabric regions hold one row per token (FabricCombineRows), so rows per (t, k) are refused there across nodes.
ffi::Error CheckMode(const KernelArgs& a, int64_t channel, int64_t mode) {
  if (mode != kPerEntry && mode != kWeighted && mode != kUnit)
    return ffi::Error::InvalidArgument("jax_moe cuda: bad combine mode");
  if (channel == 1 && mode == kPerEntry && a.num_remote > 0)
    return ffi::Error::InvalidArgument("jax_moe cuda: combine channel 1 (dispatch's gradient) returns summed rows "
                                       "only where ranks are on other nodes (its areas hold one row per token)");
  return ffi::Error::Success();
}

ffi::Error CheckRows(const char* what, ffi::Span<const int64_t> dims, int64_t rows, int64_t row_bytes,
                     size_t itemsize, int64_t want_bytes) {
  if (dims.size() != 2 || dims[0] != rows || dims[1] * static_cast<int64_t>(itemsize) != want_bytes) {
    return ffi_util::Mismatch("jax_moe cuda: ", what);
  }
  (void)row_bytes;
  return ffi::Error::Success();
}

// Each half's shape checks, filling the launch's arguments. A shape error is a caller's bug: nothing is launched.
ffi::Error CheckDispatchSend(const KernelArgs& a, bool has_scale, bool has_weights, ffi::AnyBuffer x,
                             ffi::AnyBuffer x_scale, ffi::AnyBuffer topk_weights, ffi::Buffer<ffi::S32> topk_idx,
                             ffi::Result<ffi::Buffer<ffi::S32>>& ticket, DispatchSendIo& io) {
  const auto dims = x.dimensions();
  if (dims.size() != 2) return ffi::Error::InvalidArgument("jax_moe cuda: x must be [T, hidden]");
  const int64_t tokens = dims[0];
  if (tokens > a.s.max_tokens) return ffi::Error::InvalidArgument("jax_moe cuda: T exceeds max_tokens");
  if (auto e = CheckRows("x", dims, tokens, a.s.x_bytes(), ffi::ByteWidth(x.element_type()), a.s.x_bytes()); e.failure())
    return e;
  if (has_scale) {
    if (auto e = CheckScaleType("x_scale", x_scale.element_type()); e.failure()) return e;
    if (auto e = CheckRows("x_scale", x_scale.dimensions(), tokens, a.s.scale_bytes(), 4, a.s.scale_bytes()); e.failure())
      return e;
  }
  const auto idims = topk_idx.dimensions();
  if (idims.size() != 2 || idims[0] != tokens || idims[1] != a.s.experts_per_token)
    return ffi::Error::InvalidArgument("jax_moe cuda: topk_idx must be [T, experts_per_token]");
  if (has_weights) {
    if (auto e = CheckWeights(topk_weights, tokens, a.s.experts_per_token); e.failure()) return e;
  }
  if (auto e = CheckTicket(ticket->element_count()); e.failure()) return e;
  io.tokens = static_cast<int>(tokens);
  io.x = x.untyped_data();
  io.x_scale = has_scale ? x_scale.untyped_data() : nullptr;
  io.topk_weights = has_weights ? static_cast<const float*>(topk_weights.untyped_data()) : nullptr;
  io.topk_idx = topk_idx.typed_data();
  io.ticket = ticket->typed_data();
  return ffi::Error::Success();
}

ffi::Error CheckDispatchRecv(const KernelArgs& a, bool has_scale, bool has_weights, int64_t padding, ffi::AnyBuffer x,
                             ffi::AnyBuffer x_scale, ffi::AnyBuffer topk_weights, ffi::Result<ffi::AnyBuffer>& expert_x,
                             ffi::Result<ffi::AnyBuffer>& expert_x_scale, ffi::Result<ffi::Buffer<ffi::S32>>& counts,
                             ffi::Result<ffi::Buffer<ffi::S32>>& route, DispatchRecvIo& io) {
  const int64_t rows = a.s.max_recv_rows();
  if (auto e = CheckRows("expert_x", expert_x->dimensions(), rows, a.s.x_bytes(),
                         ffi::ByteWidth(expert_x->element_type()), a.s.x_bytes());
      e.failure())
    return e;
  if (counts->element_count() != size_t(a.s.local_experts) || route->element_count() != size_t(RouteLength(a.s)))
    return ffi::Error::InvalidArgument("jax_moe cuda: dispatch_recv outputs do not match the Communicator's shape");
  const auto xdims = x.dimensions();
  if (xdims.size() != 2 || xdims[0] > a.s.max_tokens) return ffi::Error::InvalidArgument("jax_moe cuda: bad x");
  const int64_t x_tokens = xdims[0];
  if (auto e = CheckRows("x", xdims, x_tokens, a.s.x_bytes(), ffi::ByteWidth(x.element_type()), a.s.x_bytes());
      e.failure())
    return e;
  if (has_scale) {
    if (auto e = CheckScaleType("x_scale", x_scale.element_type()); e.failure()) return e;
    if (auto e = CheckScaleType("expert_x_scale", expert_x_scale->element_type()); e.failure()) return e;
    if (auto e = CheckRows("x_scale", x_scale.dimensions(), x_tokens, a.s.scale_bytes(), 4, a.s.scale_bytes());
        e.failure())
      return e;
    if (auto e = CheckRows("expert_x_scale", expert_x_scale->dimensions(), rows, a.s.scale_bytes(), 4, a.s.scale_bytes());
        e.failure())
      return e;
  }
  if (has_weights) {
    if (auto e = CheckWeights(topk_weights, x_tokens, a.s.experts_per_token); e.failure()) return e;
  }
  if (padding != kPadLeave && padding != kPadZero && padding != kPadPoison)
    return ffi::Error::InvalidArgument("jax_moe cuda: bad padding mode");
  io.padding = static_cast<int>(padding);
  io.x = x.untyped_data();
  io.x_scale = has_scale ? x_scale.untyped_data() : nullptr;
  io.topk_weights = has_weights ? static_cast<const float*>(topk_weights.untyped_data()) : nullptr;
  io.x_tokens = static_cast<int>(x_tokens);
  io.expert_x = expert_x->untyped_data();
  io.expert_x_scale = has_scale ? expert_x_scale->untyped_data() : nullptr;
  io.counts = counts->typed_data();
  io.route = route->typed_data();
  return ffi::Error::Success();
}

ffi::Error CheckCombineSend(const KernelArgs& a, int64_t channel, int64_t mode, ffi::AnyBuffer expert_y,
                            ffi::Buffer<ffi::S32> route, ffi::Result<ffi::Buffer<ffi::S32>>& ticket, CombineSendIo& io) {
  if (auto e = CheckRows("expert_y", expert_y.dimensions(), a.s.max_recv_rows(), a.s.combine_row_bytes(),
                         ffi::ByteWidth(expert_y.element_type()), a.s.combine_row_bytes());
      e.failure())
    return e;
  if (route.element_count() != size_t(RouteLength(a.s))) return ffi::Error::InvalidArgument("jax_moe cuda: bad route");
  if (channel < 0 || channel >= kCombineChannels) return ffi::Error::InvalidArgument("jax_moe cuda: bad channel");
  if (auto e = CheckMode(a, channel, mode); e.failure()) return e;
  if (auto e = CheckTicket(ticket->element_count()); e.failure()) return e;
  io.channel = static_cast<int>(channel);
  io.mode = static_cast<int>(mode);
  io.expert_y = expert_y.untyped_data();
  io.route = route.typed_data();
  io.ticket = ticket->typed_data();
  return ffi::Error::Success();
}

ffi::Error CheckCombineRecv(const KernelArgs& a, int64_t channel, int64_t mode, ffi::Buffer<ffi::F32> topk_weights,
                            ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer expert_y, ffi::Result<ffi::AnyBuffer>& out,
                            CombineRecvIo& io) {
  if (channel < 0 || channel >= kCombineChannels) return ffi::Error::InvalidArgument("jax_moe cuda: bad channel");
  if (auto e = CheckMode(a, channel, mode); e.failure()) return e;
  const auto idims = topk_idx.dimensions();
  if (idims.size() != 2 || idims[1] != a.s.experts_per_token || idims[0] > a.s.max_tokens ||
      topk_weights.element_count() != topk_idx.element_count())
    return ffi::Error::InvalidArgument("jax_moe cuda: topk_idx / topk_weights do not match the Communicator's shape");
  const int64_t tokens = idims[0];
  if (auto e = CheckRows("out", out->dimensions(), tokens, a.s.combine_row_bytes(), ffi::ByteWidth(out->element_type()),
                         a.s.combine_row_bytes());
      e.failure())
    return e;
  if (auto e = CheckRows("expert_y", expert_y.dimensions(), a.s.max_recv_rows(), a.s.combine_row_bytes(),
                         ffi::ByteWidth(expert_y.element_type()), a.s.combine_row_bytes());
      e.failure())
    return e;
  io.channel = static_cast<int>(channel);
  io.mode = static_cast<int>(mode);
  io.tokens = static_cast<int>(tokens);
  io.topk_weights = topk_weights.typed_data();
  io.topk_idx = topk_idx.typed_data();
  io.expert_y = expert_y.untyped_data();
  io.out = out->untyped_data();
  return ffi::Error::Success();
}

// A send half: refused while its stream holds kRoundSlots rounds never received; counts the round it opens.
template <bool kGraph, typename LaunchFn>
ffi::Error Send(const std::shared_ptr<const DeviceComm>& held, int stream, const char* op, LaunchFn launch) {
  const DeviceComm& dev = *held;
  if constexpr (!kGraph) {
    if (auto e = CheckStreamFree(dev, stream, op); e.failure()) return e;
    if (DeviceReport failed = HoldRunAhead(held); !failed.empty()) return ToFfi(failed);
  }
  ffi::Error launched = Launched(launch(), op);
  if (!kGraph && launched.success()) {
    dev.open_rounds[stream].fetch_add(1, std::memory_order_relaxed);
    CountSend(held, stream);
  }
  return launched;
}

// A recv half: reports the device's earlier error (after launching, so this device keeps its epochs in step); closes
// the round.
template <bool kGraph, typename LaunchFn>
ffi::Error Recv(const DeviceComm& dev, int stream, const char* op, LaunchFn launch) {
  const DeviceReport earlier = TakeError(dev);
  ffi::Error launched = Launched(launch(), op);
  if (!kGraph && launched.success()) dev.open_rounds[stream].fetch_sub(1, std::memory_order_relaxed);
  return earlier.empty() ? std::move(launched) : ToFfi(earlier);
}

// A one-shot call: both halves' arguments are checked before anything is launched; the round opens and closes in it,
// unless the send was launched and the receive then failed to launch: that round stays open, so the next send on
// this stream is refused at once instead of waiting for acks that never come.
template <bool kGraph, typename LaunchFn>
ffi::Error OneShot(const std::shared_ptr<const DeviceComm>& held, int stream, const char* op, LaunchFn launch) {
  const DeviceComm& dev = *held;
  if constexpr (!kGraph) {
    if (auto e = CheckStreamEmpty(dev, stream, op); e.failure()) return e;
    if (DeviceReport failed = HoldRunAhead(held); !failed.empty()) return ToFfi(failed);
  }
  const DeviceReport earlier = TakeError(dev);
  bool send_launched = false;
  ffi::Error launched = Launched(launch(&send_launched), op);
  if (!kGraph && (launched.success() || send_launched)) CountSend(held, stream);
  if (!kGraph && launched.failure() && send_launched) dev.open_rounds[stream].fetch_add(1, std::memory_order_relaxed);
  return earlier.empty() ? std::move(launched) : ToFfi(earlier);
}

template <bool kGraph>
ffi::Error DispatchSendImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, bool has_scale, bool has_weights,
                            ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer topk_weights,
                            ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::Buffer<ffi::S32>> ticket) {
  std::shared_ptr<const DeviceComm> dev;
  if (auto e = Device(comm_id, ordinal, dev); e.failure()) return e;
  DispatchSendIo io;
  if (auto e = CheckDispatchSend(dev->args, has_scale, has_weights, x, x_scale, topk_weights, topk_idx, ticket, io);
      e.failure())
    return e;
  return Send<kGraph>(dev, 0, "dispatch_send", [&] { return Launch(*dev, io, stream); });
}

template <bool kGraph>
ffi::Error DispatchRecvImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, bool has_scale, bool has_weights,
                            int64_t padding, ffi::Buffer<ffi::S32> ticket, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                            ffi::AnyBuffer topk_weights, ffi::Result<ffi::AnyBuffer> expert_x,
                            ffi::Result<ffi::AnyBuffer> expert_x_scale, ffi::Result<ffi::Buffer<ffi::S32>> counts,
                            ffi::Result<ffi::Buffer<ffi::S32>> route) {
  std::shared_ptr<const DeviceComm> dev;
  if (auto e = Device(comm_id, ordinal, dev); e.failure()) return e;
  DispatchRecvIo io;
  if (auto e = CheckDispatchRecv(dev->args, has_scale, has_weights, padding, x, x_scale, topk_weights, expert_x,
                                 expert_x_scale, counts, route, io);
      e.failure())
    return e;
  if (auto e = CheckTicket(ticket.element_count()); e.failure()) return e;
  io.ticket = ticket.typed_data();
  return Recv<kGraph>(*dev, 0, "dispatch_recv", [&] { return Launch(*dev, io, stream); });
}

template <bool kGraph>
ffi::Error CombineSendImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, int64_t channel, int64_t mode,
                           ffi::AnyBuffer expert_y, ffi::Buffer<ffi::S32> route,
                           ffi::Result<ffi::Buffer<ffi::S32>> ticket) {
  std::shared_ptr<const DeviceComm> dev;
  if (auto e = Device(comm_id, ordinal, dev); e.failure()) return e;
  CombineSendIo io;
  if (auto e = CheckCombineSend(dev->args, channel, mode, expert_y, route, ticket, io); e.failure()) return e;
  return Send<kGraph>(dev, 1 + io.channel, "combine_send", [&] { return Launch(*dev, io, stream); });
}

template <bool kGraph>
ffi::Error CombineRecvImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, int64_t channel, int64_t mode,
                           ffi::Buffer<ffi::S32> ticket, ffi::Buffer<ffi::F32> topk_weights,
                           ffi::Buffer<ffi::S32> topk_idx, ffi::AnyBuffer expert_y, ffi::Result<ffi::AnyBuffer> out) {
  std::shared_ptr<const DeviceComm> dev;
  if (auto e = Device(comm_id, ordinal, dev); e.failure()) return e;
  CombineRecvIo io;
  if (auto e = CheckCombineRecv(dev->args, channel, mode, topk_weights, topk_idx, expert_y, out, io); e.failure())
    return e;
  if (auto e = CheckTicket(ticket.element_count()); e.failure()) return e;
  io.ticket = ticket.typed_data();
  return Recv<kGraph>(*dev, 1 + io.channel, "combine_recv", [&] { return Launch(*dev, io, stream); });
}

// The one-shot calls (`comm.dispatch`, `comm.combine`): both halves from one handler, as one kernel where every rank
// is on this node (cuda/launch.h). The send's ticket is a scratch result.
template <bool kGraph>
ffi::Error DispatchImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, bool has_scale, bool has_weights,
                        int64_t padding, ffi::AnyBuffer x, ffi::AnyBuffer x_scale, ffi::AnyBuffer topk_weights,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::Buffer<ffi::S32>> ticket,
                        ffi::Result<ffi::AnyBuffer> expert_x, ffi::Result<ffi::AnyBuffer> expert_x_scale,
                        ffi::Result<ffi::Buffer<ffi::S32>> counts, ffi::Result<ffi::Buffer<ffi::S32>> route) {
  std::shared_ptr<const DeviceComm> dev;
  if (auto e = Device(comm_id, ordinal, dev); e.failure()) return e;
  DispatchSendIo send;
  DispatchRecvIo recv;
  if (auto e = CheckDispatchSend(dev->args, has_scale, has_weights, x, x_scale, topk_weights, topk_idx, ticket, send);
      e.failure())
    return e;
  if (auto e = CheckDispatchRecv(dev->args, has_scale, has_weights, padding, x, x_scale, topk_weights, expert_x,
                                 expert_x_scale, counts, route, recv);
      e.failure())
    return e;
  return OneShot<kGraph>(dev, 0, "dispatch",
                         [&](bool* sent) { return Launch(*dev, send, recv, stream, sent); });
}

template <bool kGraph>
ffi::Error CombineImpl(cudaStream_t stream, int32_t ordinal, int64_t comm_id, int64_t channel, int64_t mode,
                       ffi::AnyBuffer expert_y, ffi::Buffer<ffi::S32> route, ffi::Buffer<ffi::F32> topk_weights,
                       ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::Buffer<ffi::S32>> ticket,
                       ffi::Result<ffi::AnyBuffer> out) {
  std::shared_ptr<const DeviceComm> dev;
  if (auto e = Device(comm_id, ordinal, dev); e.failure()) return e;
  CombineSendIo send;
  CombineRecvIo recv;
  if (auto e = CheckCombineSend(dev->args, channel, mode, expert_y, route, ticket, send); e.failure()) return e;
  if (auto e = CheckCombineRecv(dev->args, channel, mode, topk_weights, topk_idx, expert_y, out, recv); e.failure())
    return e;
  return OneShot<kGraph>(dev, 1 + send.channel, "combine",
                         [&](bool* sent) { return Launch(*dev, send, recv, stream, sent); });
}

// Passes `a` through (aliased) and stamps the device time once everything before it on the stream has finished.
template <bool kGraph>
ffi::Error TimestampImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer dep, ffi::Result<ffi::AnyBuffer> a_out,
                         ffi::Result<ffi::Buffer<ffi::U64>> stamp) {
  return Launched(LaunchStamp(stamp->typed_data(), stream), "timestamp");
}

}  // namespace
}  // namespace jax_moe::cuda

using namespace jax_moe::cuda;  // NOLINT: handler symbols below are extern "C"

// The graph variant counts no open rounds: a replayed command buffer does not call its handlers, so their counts
// would drift (jax_moe.rounds still refuses the programs that would open too many).
#define JAX_MOE_CUDA_HANDLERS(name, impl, binding)           \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, impl<false>, binding); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Graph, impl<true>, binding, {ffi::Traits::kCmdBufferCompatible})

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaDispatchSend, DispatchSendImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Ctx<ffi::DeviceOrdinal>()
                          .Attr<int64_t>("comm_id")
                          .Attr<bool>("has_scale")
                          .Attr<bool>("has_weights")
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>());

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaDispatchRecv, DispatchRecvImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Ctx<ffi::DeviceOrdinal>()
                          .Attr<int64_t>("comm_id")
                          .Attr<bool>("has_scale")
                          .Attr<bool>("has_weights")
                          .Attr<int64_t>("padding")
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Ret<ffi::AnyBuffer>()
                          .Ret<ffi::AnyBuffer>()
                          .Ret<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>());

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaCombineSend, CombineSendImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Ctx<ffi::DeviceOrdinal>()
                          .Attr<int64_t>("comm_id")
                          .Attr<int64_t>("channel")
                          .Attr<int64_t>("mode")
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>());

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaCombineRecv, CombineRecvImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Ctx<ffi::DeviceOrdinal>()
                          .Attr<int64_t>("comm_id")
                          .Attr<int64_t>("channel")
                          .Attr<int64_t>("mode")
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::F32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::AnyBuffer>()
                          .Ret<ffi::AnyBuffer>());

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaDispatch, DispatchImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Ctx<ffi::DeviceOrdinal>()
                          .Attr<int64_t>("comm_id")
                          .Attr<bool>("has_scale")
                          .Attr<bool>("has_weights")
                          .Attr<int64_t>("padding")
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::AnyBuffer>()
                          .Ret<ffi::AnyBuffer>()
                          .Ret<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>());

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaCombine, CombineImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Ctx<ffi::DeviceOrdinal>()
                          .Attr<int64_t>("comm_id")
                          .Attr<int64_t>("channel")
                          .Attr<int64_t>("mode")
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Arg<ffi::Buffer<ffi::F32>>()
                          .Arg<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::Buffer<ffi::S32>>()
                          .Ret<ffi::AnyBuffer>());

JAX_MOE_CUDA_HANDLERS(JaxMoeCudaTimestamp, TimestampImpl,
                      ffi::Ffi::Bind()
                          .Ctx<ffi::PlatformStream<cudaStream_t>>()
                          .Arg<ffi::AnyBuffer>()
                          .Arg<ffi::AnyBuffer>()
                          .Ret<ffi::AnyBuffer>()
                          .Ret<ffi::Buffer<ffi::U64>>());
