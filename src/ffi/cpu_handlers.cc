#include "ffi/cpu_handlers.h"

#include <string>

#include "common/error.h"
#include "cpu/cpu_comm.h"
#include "ffi/ffi_util.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_moe::ffi_handlers {
namespace {

using ffi_util::HasDims;

constexpr char kPrefix[] = "jax_moe: ";

ffi::Error Mismatch(const char* what) { return ffi_util::Mismatch(kPrefix, what); }

// Columns of the scale operand and result: without scales (bf16, or the per-entry rows of gradients) one unread column
// stands in, because a zero-sized array crossing shard_map bodies crashed XLA's Shardy partitioner (jax 0.11.2: grad
// of lax.scan over a shard_map'ed layer).
int64_t ScaleColumns(int64_t num_scales, bool per_entry) { return per_entry || num_scales == 0 ? 1 : num_scales; }

// Runs `fn(comm)` for the Communicator `comm_id`, turning every exception into an ffi::Error.
template <typename Fn>
ffi::Error WithComm(int64_t comm_id, Fn&& fn) {
  auto comm = cpu::FindComm(uint32_t(comm_id));
  if (!comm) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                      "jax_moe: Communicator " + std::to_string(comm_id) + " is not set up in this process");
  }
  return ffi_util::Guarded(kPrefix, [&] { fn(*comm); });
}

ffi::Error DispatchSend(int32_t device, int64_t comm_id, bool per_entry, ffi::Token, ffi::AnyBuffer x, ffi::AnyBuffer x_scale,
                        ffi::Buffer<ffi::S32> topk_idx, ffi::Result<ffi::Token>, ffi::Result<ffi::Buffer<ffi::S32>> position,
                        ffi::Result<ffi::Buffer<ffi::S32>> ticket) {
  auto comm = cpu::FindComm(uint32_t(comm_id));
  const int64_t t = topk_idx.dimensions().size() == 2 ? topk_idx.dimensions()[0] : -1;
  if (comm) {
    const auto& s = comm->options().shape;
    const int64_t rows = per_entry ? t * s.experts_per_token : t;
    if (!HasDims(x, {rows, s.hidden}) || int64_t(ffi::ByteWidth(x.element_type())) != s.x_itemsize) {
      return Mismatch("x");
    }
    if (!HasDims(x_scale, {rows, ScaleColumns(s.num_scales, per_entry)}) || x_scale.element_type() != ffi::F32) {
      return Mismatch("x_scale");
    }
    if (!HasDims(topk_idx, {t, s.experts_per_token}) || !HasDims(*position, {t * s.experts_per_token}) ||
        ticket->element_count() != 2) {
      return Mismatch("topk_idx");
    }
  }
  return WithComm(comm_id, [&](cpu::CpuComm& c) {
    c.DispatchSend(device, static_cast<const uint8_t*>(x.untyped_data()),
                   static_cast<const uint8_t*>(x_scale.untyped_data()), topk_idx.typed_data(), t, per_entry,
                   position->typed_data(), ticket->typed_data());
  });
}

ffi::Error DispatchRecv(int32_t device, int64_t comm_id, ffi::Token, ffi::Buffer<ffi::S32> ticket,
                         ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> expert_x, ffi::Result<ffi::AnyBuffer> expert_x_scale,
                         ffi::Result<ffi::Buffer<ffi::S32>> counts, ffi::Result<ffi::Buffer<ffi::S32>> dest) {
  auto comm = cpu::FindComm(uint32_t(comm_id));
  if (comm) {
    const auto& s = comm->options().shape;
    const int64_t m = s.max_recv_rows();
    if (!HasDims(*expert_x, {m, s.hidden}) || int64_t(ffi::ByteWidth(expert_x->element_type())) != s.x_itemsize) {
      return Mismatch("expert_x");
    }
    if (!HasDims(*expert_x_scale, {m, ScaleColumns(s.num_scales, false)})) return Mismatch("expert_x_scale");
    if (!HasDims(*counts, {s.local_experts}) || !HasDims(*dest, {m}) || ticket.element_count() != 2) {
      return Mismatch("dispatch_recv outputs");
    }
  }
  return WithComm(comm_id, [&](cpu::CpuComm& c) {
    c.DispatchRecv(device, ticket.typed_data(), static_cast<uint8_t*>(expert_x->untyped_data()),
                   static_cast<uint8_t*>(expert_x_scale->untyped_data()), counts->typed_data(), dest->typed_data());
  });
}

ffi::Error CombineSend(int32_t device, int64_t comm_id, ffi::Token, ffi::AnyBuffer expert_y, ffi::Buffer<ffi::S32> dest,
                       ffi::Result<ffi::Token>, ffi::Result<ffi::Buffer<ffi::S32>> ticket) {
  auto comm = cpu::FindComm(uint32_t(comm_id));
  if (comm) {
    const auto& s = comm->options().shape;
    const int64_t m = s.max_recv_rows();
    if (!HasDims(expert_y, {m, s.hidden}) || expert_y.element_type() != ffi::BF16) return Mismatch("expert_y");
    if (!HasDims(dest, {m}) || ticket->element_count() != 2) return Mismatch("the dispatch route");
  }
  return WithComm(comm_id, [&](cpu::CpuComm& c) {
    c.CombineSend(device, static_cast<const uint8_t*>(expert_y.untyped_data()), dest.typed_data(),
                  ticket->typed_data());
  });
}

ffi::Error CombineRecv(int32_t device, int64_t comm_id, bool reduce, ffi::Token, ffi::Buffer<ffi::S32> ticket,
                        ffi::Buffer<ffi::F32> topk_weights, ffi::Buffer<ffi::S32> position,
                        ffi::Result<ffi::Token>, ffi::Result<ffi::AnyBuffer> out) {
  auto comm = cpu::FindComm(uint32_t(comm_id));
  const int64_t t = topk_weights.dimensions().size() == 2 ? topk_weights.dimensions()[0] : -1;
  if (comm) {
    const auto& s = comm->options().shape;
    if (!HasDims(*out, {reduce ? t : t * s.experts_per_token, s.hidden}) || out->element_type() != ffi::BF16) {
      return Mismatch("combine output");
    }
    if (!HasDims(topk_weights, {t, s.experts_per_token}) || !HasDims(position, {t * s.experts_per_token}) ||
        ticket.element_count() != 2) {
      return Mismatch("topk_weights");
    }
  }
  return WithComm(comm_id, [&](cpu::CpuComm& c) {
    c.CombineRecv(device, ticket.typed_data(), topk_weights.typed_data(), position.typed_data(), t, reduce,
                  static_cast<uint8_t*>(out->untyped_data()));
  });
}

}  // namespace
}  // namespace jax_moe::ffi_handlers

namespace h = jax_moe::ffi_handlers;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCpuDispatchSend, h::DispatchSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<bool>("per_entry")
                                  .Arg<ffi::Token>()  // program order (jax_moe/backends/ffi_call.py)
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCpuDispatchRecv, h::DispatchRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()  // program order (jax_moe/backends/ffi_call.py)
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCpuCombineSend, h::CombineSend,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Arg<ffi::Token>()  // program order (jax_moe/backends/ffi_call.py)
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCpuCombineRecv, h::CombineRecv,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Attr<int64_t>("comm_id")
                                  .Attr<bool>("reduce")
                                  .Arg<ffi::Token>()  // program order (jax_moe/backends/ffi_call.py)
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Token>()
                                  .Ret<ffi::AnyBuffer>());
