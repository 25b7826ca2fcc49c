// The host side of a device's error word (kernels/sync.cuh RaiseError, PublishError): decoding, taking (with the ack
// word) and the sticky timeout.
#include "cuda/device_error.h"

#include <cstdint>
#include <string>

#include "kernels/moe_layout.h"

namespace jax_moe::cuda {
namespace {

std::string Name(const DeviceComm& dev, int rank) {
  if (rank >= 0 && rank < static_cast<int>(dev.names.size())) return dev.names[rank];
  return "rank " + std::to_string(rank);
}

DeviceReport Report(const DeviceComm& dev, unsigned long long word) {
  const int kind = static_cast<int>(word >> 32);
  const int detail = static_cast<int>(static_cast<uint32_t>(word));
  switch (kind) {
    case kNoError:
      return {};
    case kBadExpertId:
      return {true, ErrorCode::kInvalidArgument,
              "jax_moe cuda: an earlier dispatch of " + Name(dev, dev.args.rank) + " got expert id " +
                  std::to_string(detail) + " in topk_idx, outside [0, num_experts) and not -1 (those entries were "
                  "masked)"};
    case kTimeout: {
      static const char* const kWhat[] = {"its dispatched tokens", "its acknowledgement of our dispatch",
                                          "its combined rows", "its acknowledgement of our combine"};
      const int flag = detail / kWaitStride;  // FlagKind; the combine kinds repeat per channel
      if (flag == kIndexWait)  // no peer in it: blocks of this GPU's own launch
        return {true, ErrorCode::kTimeout,
                "jax_moe cuda: dispatch_send's blocks deriving the index of " + Name(dev, detail % kWaitStride) +
                    "'s region waited for one another past the timeout: some of them got no SM (another kernel or "
                    "process held the GPU's SMs); this Communicator cannot go on: build a new Communicator"};
      if (flag < 0 || flag >= kFlagKinds)
        return {true, ErrorCode::kTimeout, "jax_moe cuda: a wait timed out (" + std::to_string(detail) + ")"};
      const int what = flag < kCombineFlag ? flag : kCombineFlag + (flag - kCombineFlag) % 2;
      // Rounds run in program order and a send whose stream holds rounds never received is refused by its handler,
      // so a missing flag means the peer's program stopped or never made that call.
      return {true, ErrorCode::kTimeout,
              "jax_moe cuda: " + Name(dev, detail % kWaitStride) +
                  " did not send " + kWhat[what] + (flag >= kCombineFlag + 2 ? " (gradient channel)" : "") +
                  " within the timeout (its process may have died or stopped calling this Communicator); this "
                  "Communicator's results are incomplete from then on and every later call fails: build a new "
                  "Communicator"};
    }
    case kBadPeerData:
      return {true, ErrorCode::kPeerFailed,
              "jax_moe cuda: " + Name(dev, detail) +
                  " sent token counts or lists that are out of range or out of token order (its data was dropped); "
                  "results of that call are incomplete"};
    case kProxyFailed: {
      const std::string why = dev.fabric ? dev.fabric->Error() : std::string();
      return {true, ErrorCode::kPeerFailed,
              "jax_moe cuda: the host proxy of " + Name(dev, dev.args.rank) + " stopped" +
                  (why.empty() ? std::string() : ": " + why) +
                  "; this Communicator cannot go on: build a new Communicator"};
    }
    case kOutOfOrder:
      return {true, ErrorCode::kMisuse,
              "jax_moe cuda: a " + std::string(detail == 0 ? "dispatch_recv" : "combine_recv") + " of " +
                  Name(dev, dev.args.rank) + " was given the handle of another round than the one it was due to "
                  "receive: a handle was dropped (sent, never received) or rounds of one direction were received out "
                  "of send order across programs; backend 'cuda' receives them in send order. This Communicator's "
                  "rounds are out of step from then on and every later call fails: build a new Communicator"};
    default:
      return {true, ErrorCode::kInternal, "jax_moe cuda: device error " + std::to_string(kind)};
  }
}

}  // namespace

DeviceReport TakeError(const DeviceComm& dev) {
  // The host never writes the error word (a host exchange racing the device's write is not atomic on PCIe hosts);
  // it reports a published error whose number it has not acknowledged yet, then acknowledges it, which lets the
  // device publish the next one. Host threads (XLA's, take_errors) agree on who reports through a CAS on the ack
  // word, which only the host writes. A timeout outranks it and is reported every time: after one, the peers' epochs
  // are out of step with this device's, so every later call must fail rather than return stale rows.
  unsigned long long* ack = dev.host_error + kAckWord;
  unsigned long long taken = __atomic_load_n(ack, __ATOMIC_ACQUIRE);
  const unsigned long long word = __atomic_load_n(dev.host_error + kErrorWord, __ATOMIC_ACQUIRE);
  const unsigned long long seq = word >> kErrorSeqShift;
  DeviceReport report;
  if (seq != taken && __atomic_compare_exchange_n(ack, &taken, seq, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
    report = Report(dev, word & kErrorBody);
  DeviceReport sticky = StickyError(dev);
  return sticky.empty() ? report : sticky;
}

DeviceReport StickyError(const DeviceComm& dev) {
  for (const unsigned long long* timeout : dev.comm_timeouts) {
    const unsigned long long word = __atomic_load_n(timeout, __ATOMIC_SEQ_CST);
    if (word != 0) return Report(dev, word);
  }
  return {};
}

DeviceReport ProxyError(const DeviceComm& dev) {
  if (!dev.fabric) return {};
  const std::string why = dev.fabric->Error();
  if (why.empty()) return {};
  // A late peer is a timeout, as on NVLink; anything else (a peer gone, bad data) means the peer failed.
  const bool late = dev.fabric->ErrorCodeOf() == ErrorCode::kTimeout;
  return {true, late ? ErrorCode::kTimeout : ErrorCode::kPeerFailed,
          "jax_moe cuda: the host proxy of " + Name(dev, dev.args.rank) + " stopped: " + why +
              "; this Communicator cannot go on: build a new Communicator"};
}

}  // namespace jax_moe::cuda
