// A point in time after which a wait gives up. Every blocking call in jax_moe takes one.
#pragma once
#include <chrono>
#include <limits>

namespace jax_moe {

class Deadline {
 public:
  using Clock = std::chrono::steady_clock;

  // A negative or non-finite timeout means "wait forever" (only for tests and tools).
  static Deadline After(double seconds) {
    Deadline d;
    if (seconds >= 0 && seconds < 1e9) {
      d.at_ = Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
    }
    return d;
  }
  static Deadline Never() { return Deadline(); }

  bool Expired() const { return Clock::now() >= at_; }
  Clock::time_point at() const { return at_; }
  double RemainingSeconds() const {
    return std::chrono::duration<double>(at_ - Clock::now()).count();
  }

 private:
  Clock::time_point at_ = Clock::time_point::max();
};

}  // namespace jax_moe
