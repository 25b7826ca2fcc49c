#include "cuda/run_ahead.h"

#include <chrono>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "cuda/device_fabric.h"

namespace jax_moe::cuda {
namespace {

struct Send {
  std::weak_ptr<const DeviceComm> dev;  // a Communicator destroyed since rings nothing more: its entry is dropped
  int stream = 0;
  uint64_t round = 0;
};

// Per GPU ordinal: its last sends of staged Communicators, oldest first.
struct Ring {
  std::mutex mu;
  std::deque<Send> sends;
};

Ring& RingOf(int ordinal) {
  static std::mutex mu;
  static std::map<int, std::unique_ptr<Ring>> rings;  // never freed: one per GPU the process touched
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<Ring>& r = rings[ordinal];
  if (!r) r = std::make_unique<Ring>();
  return *r;
}

bool Staged(const DeviceComm& dev) { return dev.fabric && dev.fabric->proxy_calls_cuda(); }

// Waits (bounded by its Communicator's timeout) until `s` was rung, or its device or pump reported an error.
void WaitRung(const Send& s) {
  const std::shared_ptr<const DeviceComm> dev = s.dev.lock();
  if (!dev || !dev->fabric) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(dev->timeout_s);
  while (dev->fabric->Rung(size_t(s.stream)) < s.round) {
    if (std::chrono::steady_clock::now() > deadline || !StickyError(*dev).empty() || !dev->fabric->Error().empty())
      return;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace

DeviceReport HoldRunAhead(const std::shared_ptr<const DeviceComm>& dev) {
  if (!Staged(*dev)) return {};
  Ring& ring = RingOf(dev->ordinal);
  for (;;) {
    Send oldest;
    {
      std::lock_guard<std::mutex> lock(ring.mu);
      if (ring.sends.size() < kRunAhead) break;
      oldest = ring.sends.front();
      ring.sends.pop_front();
    }
    WaitRung(oldest);
  }
  return StickyError(*dev);
}

void CountSend(const std::shared_ptr<const DeviceComm>& dev, int stream) {
  const uint64_t round = dev->sends_launched[stream].fetch_add(1, std::memory_order_relaxed) + 1;
  if (!Staged(*dev)) return;
  Ring& ring = RingOf(dev->ordinal);
  std::lock_guard<std::mutex> lock(ring.mu);
  ring.sends.push_back({dev, stream, round});
}

}  // namespace jax_moe::cuda
