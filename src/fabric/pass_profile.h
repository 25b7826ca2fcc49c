// Where the progress thread's passes go: time per phase (poll completions, run hooks, post), for the benchmarks'
// breakdown of the host path (EngineStats). One writer (the progress thread); readers load at any time.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

namespace jax_moe::fabric {

// Ticks: the TSC where there is one (a few cycles to read, so every pass can afford it), else steady-clock ns.
inline uint64_t Ticks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
#endif
}

struct PassProfile {
  enum Phase { kPoll, kHooks, kPost, kPhases };
  std::atomic<uint64_t> ticks[kPhases] = {};
  std::atomic<uint64_t> longest[kPhases] = {};  // the longest single lap of each phase: a call that blocked
  std::atomic<uint64_t> pass_ticks{0};
  std::atomic<uint64_t> passes{0};
  // Ticks to ns: measured between construction and the read.
  const uint64_t start_ticks = Ticks();
  const std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
  double NsPerTick() const {
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    const uint64_t t = Ticks() - start_ticks;
    return t > 0 ? ns / double(t) : 0.0;
  }
};

// The progress thread's stopwatch: Lap(phase) charges the time since the last lap to `phase`, Pass() ends a pass.
class PassClock {
 public:
  explicit PassClock(PassProfile& p) : p_(p), pass_start_(Ticks()), last_(pass_start_) {}
  void Lap(PassProfile::Phase phase) {
    const uint64_t t = Ticks();
    Add(p_.ticks[phase], t - last_);
    if (t - last_ > p_.longest[phase].load(std::memory_order_relaxed))
      p_.longest[phase].store(t - last_, std::memory_order_relaxed);
    last_ = t;
  }
  void Pass() {
    Add(p_.pass_ticks, last_ - pass_start_);
    Add(p_.passes, 1);
    pass_start_ = last_ = Ticks();
  }
  void Restart() { pass_start_ = last_ = Ticks(); }

 private:
  static void Add(std::atomic<uint64_t>& a, uint64_t v) {  // one writer: no locked instruction needed
    a.store(a.load(std::memory_order_relaxed) + v, std::memory_order_relaxed);
  }
  PassProfile& p_;
  uint64_t pass_start_, last_;
};

}  // namespace jax_moe::fabric
