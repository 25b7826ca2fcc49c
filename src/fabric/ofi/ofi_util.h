// RAII and error helpers for libfabric handles.
#pragma once
#include <rdma/fabric.h>
#include <rdma/fi_errno.h>

#include <string>

#include "common/error.h"

namespace jax_moe::fabric::ofi {

// Throws Error(kInternal) "<call>: <fi_strerror>" when rc < 0.
inline void Check(ssize_t rc, const char* call) {
  if (rc < 0) {
    Throw(ErrorCode::kInternal, std::string(call) + ": " + fi_strerror(static_cast<int>(-rc)) + " (" +
                                    std::to_string(rc) + ")");
  }
}

// Owns any libfabric object with an embedded `struct fid fid` (fid_fabric, fid_domain, fid_ep, ...).
template <typename T>
class Fid {
 public:
  Fid() = default;
  explicit Fid(T* p) : p_(p) {}
  ~Fid() { reset(); }
  Fid(Fid&& o) noexcept : p_(o.p_) { o.p_ = nullptr; }
  Fid& operator=(Fid&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_;
      o.p_ = nullptr;
    }
    return *this;
  }
  Fid(const Fid&) = delete;
  Fid& operator=(const Fid&) = delete;

  void reset() {
    if (p_ != nullptr) fi_close(&p_->fid);
    p_ = nullptr;
  }
  T* get() const { return p_; }
  T* operator->() const { return p_; }
  T** out() {
    reset();
    return &p_;
  }
  explicit operator bool() const { return p_ != nullptr; }

 private:
  T* p_ = nullptr;
};

}  // namespace jax_moe::fabric::ofi
