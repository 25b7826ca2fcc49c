// The host side of a device's error word (kernels/sync.cuh RaiseError): decoding, taking and the sticky timeout.
#include "ffi/cuda/device_error.h"

#include <cstdint>
#include <string>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {
namespace {

std::string ErrorMessage(unsigned long long word) {
  const int kind = static_cast<int>(word >> 32);
  const int detail = static_cast<int>(static_cast<uint32_t>(word));
  switch (kind) {
    case kNoError:
      return "";
    case kBadExpertId:
      return "jax_moe cuda: an earlier dispatch on this device got expert id " + std::to_string(detail) +
             " in topk_idx, outside [0, num_experts) and not -1 (those slots were masked)";
    case kTimeout: {
      static const char* const kWhat[] = {"its dispatched tokens", "its acknowledgement of our dispatch",
                                          "its combined rows", "its acknowledgement of our combine"};
      const int flag = detail / kWaitStride;  // FlagKind; the combine kinds repeat per channel
      if (flag < 0 || flag >= kFlagKinds) return "jax_moe cuda: a wait timed out (" + std::to_string(detail) + ")";
      const int what = flag < kCombineFlag ? flag : kCombineFlag + (flag - kCombineFlag) % 2;
      // A missing ack is also what two sends of one Communicator in flight look like (the second waits for the
      // first's receive, queued behind it on the stream).
      const bool ack = what == kDispatchAck || what == kCombineAck;
      return "jax_moe cuda: rank " + std::to_string(detail % kWaitStride) + " did not send " + kWhat[what] +
             (flag >= kCombineFlag + 2 ? " (gradient channel)" : "") + " within the timeout" +
             (ack ? " (or two sends of this Communicator were in flight: it allows one dispatch and one combine at "
                    "a time; use one Communicator per micro-batch)"
                  : "") +
             "; this Communicator's results are incomplete from then on and every later call fails: build a new "
             "Communicator";
    }
    case kBadPeerData:
      return "jax_moe cuda: rank " + std::to_string(detail) +
             " sent token counts or lists that do not fit this Communicator's buffers (its data was dropped); "
             "results of that call are incomplete";
    default:
      return "jax_moe cuda: device error " + std::to_string(kind);
  }
}

}  // namespace

std::string TakeError(const DeviceGroup& dev) {
  // One 64-bit word (kind << 32 | detail): taken and cleared atomically, so a kind is never read without its detail
  // and an error raised meanwhile is not lost. A timeout is not cleared: after it the peers' epochs are out of step
  // with this device's, so every later call must fail rather than return stale rows.
  unsigned long long word = __atomic_load_n(dev.host_error, __ATOMIC_SEQ_CST);
  if (static_cast<int>(word >> 32) != kTimeout) word = __atomic_exchange_n(dev.host_error, 0ull, __ATOMIC_SEQ_CST);
  if (static_cast<int>(word >> 32) == kTimeout) __atomic_store_n(dev.host_error, word, __ATOMIC_SEQ_CST);
  return ErrorMessage(word);
}

std::string StickyError(const DeviceGroup& dev) {
  const unsigned long long word = __atomic_load_n(dev.host_error, __ATOMIC_SEQ_CST);
  return static_cast<int>(word >> 32) == kTimeout ? ErrorMessage(word) : std::string();
}

}  // namespace jax_moe::cuda
