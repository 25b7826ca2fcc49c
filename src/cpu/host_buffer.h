// A zero-initialised, 64-byte aligned host allocation owned by one rank (receive regions, staging).
#pragma once
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>

#include "common/error.h"

namespace jax_moe::cpu {

class HostBuffer {
 public:
  HostBuffer() = default;
  explicit HostBuffer(uint64_t bytes) : bytes_(bytes) {
    if (bytes == 0) return;
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!p) Throw(ErrorCode::kInternal, "out of host memory allocating " + std::to_string(bytes) + " bytes");
    std::memset(p, 0, bytes);
    data_.reset(static_cast<uint8_t*>(p));
  }
  uint8_t* data() const { return data_.get(); }
  uint64_t size() const { return bytes_; }

 private:
  struct Free {
    void operator()(uint8_t* p) const { std::free(p); }
  };
  std::unique_ptr<uint8_t, Free> data_;
  uint64_t bytes_ = 0;
};

}  // namespace jax_moe::cpu
