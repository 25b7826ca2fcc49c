#include "proxy/staging.h"

namespace jax_moe::proxy {

Staging* StagingPool::Acquire(fabric::TransferEngine* engine) {
  for (auto& st : buffers_) {
    if (st->queued == 0 && !st->remote_pending) return st.get();
  }
  for (auto& st : buffers_) {
    if (st->queued == 0 && engine) {
      // Only remote writes hold it: they complete without any peer's application, so this wait is bounded.
      engine->WaitSends(30.0);
      for (auto& other : buffers_) other->remote_pending = false;
      return st.get();
    }
  }
  auto st = std::make_unique<Staging>();
  st->mem = allocate_(bytes_);
  if (engine) st->mr = engine->Register(st->mem.data, st->mem.size);
  buffers_.push_back(std::move(st));
  return buffers_.back().get();
}

}  // namespace jax_moe::proxy
