// The host side of a device's error word (kernels/sync.cuh RaiseError, PublishError): decoding, taking (with the ack
// word) and the sticky timeout.
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
  // The host never writes the error word (a host exchange racing the device's write is not atomic on PCIe hosts);
  // it reports a published error whose number it has not acknowledged yet, then acknowledges it, which lets the
  // device publish the next one. Host threads (XLA's, take_errors) agree on who reports through a CAS on the ack
  // word, which only the host writes. A timeout outranks it and is reported every time: after one, the peers' epochs
  // are out of step with this device's, so every later call must fail rather than return stale rows.
  unsigned long long* ack = dev.host_error + kAckWord;
  unsigned long long taken = __atomic_load_n(ack, __ATOMIC_ACQUIRE);
  const unsigned long long word = __atomic_load_n(dev.host_error + kErrorWord, __ATOMIC_ACQUIRE);
  const unsigned long long seq = word >> kErrorSeqShift;
  std::string message;
  if (seq != taken && __atomic_compare_exchange_n(ack, &taken, seq, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    message = ErrorMessage(word & kErrorBody);
  const std::string sticky = StickyError(dev);
  return sticky.empty() ? message : sticky;
}

std::string StickyError(const DeviceGroup& dev) {
  for (const unsigned long long* timeout : dev.group_timeouts) {
    const unsigned long long word = __atomic_load_n(timeout, __ATOMIC_SEQ_CST);
    if (word != 0) return ErrorMessage(word);
  }
  return "";
}

}  // namespace jax_moe::cuda
