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
  // Never destroyed (as the registry): a handler may still hold a send at exit.
  static auto* mu = new std::mutex;
  static auto* rings = new std::map<int, std::unique_ptr<Ring>>;
  std::lock_guard<std::mutex> lock(*mu);
  std::unique_ptr<Ring>& r = (*rings)[ordinal];
  if (!r) r = std::make_unique<Ring>();
  return *r;
}

bool Staged(const DeviceComm& dev) { return dev.fabric && dev.fabric->proxy_calls_cuda(); }

// Waits (bounded by its Communicator's timeout) until round `round` of `stream` was rung on `dev`, or its device or
// pump reported an error. `dev` was locked under the ring's mutex: DestroyComm forgets a Communicator's sends under
// it (after no handler holds the device, so none records more), then waits until no one else holds the device, so
// the fabric lives while this waits.
void WaitRung(const std::shared_ptr<const DeviceComm>& dev, int stream, uint64_t round) {
  if (!dev || !dev->fabric) return;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(dev->timeout_s);
  while (dev->fabric->Rung(size_t(stream)) < round) {
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
    std::shared_ptr<const DeviceComm> owner;
    int stream = 0;
    uint64_t round = 0;
    {
      std::lock_guard<std::mutex> lock(ring.mu);
      if (ring.sends.size() < kRunAhead) break;
      owner = ring.sends.front().dev.lock();
      stream = ring.sends.front().stream;
      round = ring.sends.front().round;
      ring.sends.pop_front();
    }
    WaitRung(owner, stream, round);
  }
  if (DeviceReport failed = StickyError(*dev); !failed.empty()) return failed;
  return ProxyError(*dev);
}

void ForgetSends(int ordinal, const DeviceComm* dev) {
  Ring& ring = RingOf(ordinal);
  std::lock_guard<std::mutex> lock(ring.mu);
  for (auto it = ring.sends.begin(); it != ring.sends.end();) {
    const std::shared_ptr<const DeviceComm> held = it->dev.lock();
    if (!held || held.get() == dev) it = ring.sends.erase(it); else ++it;
  }
}

void CountSend(const std::shared_ptr<const DeviceComm>& dev, int stream) {
  const uint64_t round = dev->sends_launched[stream].fetch_add(1, std::memory_order_relaxed) + 1;
  if (!Staged(*dev)) return;
  Ring& ring = RingOf(dev->ordinal);
  std::lock_guard<std::mutex> lock(ring.mu);
  ring.sends.push_back({dev, stream, round});
}

}  // namespace jax_moe::cuda
