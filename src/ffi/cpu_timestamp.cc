// A host-clock timestamp in the data-dependency chain of an XLA:CPU program, for the benchmark: `a` passes through
// (aliased), `dep` orders the stamp after its producer, and the stamp is steady_clock nanoseconds as two uint32 words
// (low, high), so it needs no 64-bit types in JAX.
#include <chrono>
#include <cstring>

#include "ffi/cpu_handlers.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

ffi::Error Timestamp(ffi::AnyBuffer a, ffi::AnyBuffer dep, ffi::Result<ffi::AnyBuffer> a_out,
                     ffi::Result<ffi::Buffer<ffi::U32>> stamp) {
  if (a_out->untyped_data() != a.untyped_data()) std::memcpy(a_out->untyped_data(), a.untyped_data(), a.size_bytes());
  const uint64_t ns = uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                   std::chrono::steady_clock::now().time_since_epoch())
                                   .count());
  if (stamp->element_count() != 2) return ffi::Error::InvalidArgument("jax_moe: the timestamp needs 2 words");
  stamp->typed_data()[0] = uint32_t(ns);
  stamp->typed_data()[1] = uint32_t(ns >> 32);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxMoeCpuTimestamp, Timestamp,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U32>>());
