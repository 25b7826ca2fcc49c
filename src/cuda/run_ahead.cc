#include "cuda/run_ahead.h"

#include <chrono>
#include <thread>

#include "cuda/device_error.h"
#include "cuda/device_fabric.h"

namespace jax_moe::cuda {

void HoldRunAhead(const DeviceComm& dev, int stream) {
  if (!dev.fabric || !dev.fabric->proxy_calls_cuda()) return;
  const uint64_t next = dev.sends_launched[stream].load(std::memory_order_relaxed) + 1;
  if (next <= kRunAhead) return;
  const uint64_t want = next - kRunAhead;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(dev.timeout_s);
  while (dev.fabric->Rung(size_t(stream)) < want) {
    if (std::chrono::steady_clock::now() > deadline || !StickyError(dev).empty() || !dev.fabric->Error().empty())
      return;
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

void CountSend(const DeviceComm& dev, int stream) { dev.sends_launched[stream].fetch_add(1, std::memory_order_relaxed); }

}  // namespace jax_moe::cuda
