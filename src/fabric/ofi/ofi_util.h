// RAII and error helpers for libfabric handles.
#pragma once
#include <rdma/fabric.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <sys/uio.h>

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

// One write of `len` bytes from `local` (registration `desc`) to `remote_addr` (key `rkey`) of `dest`, with CQ `data`
// where `flags` ask for it; returns fi_writemsg's code (-FI_EAGAIN: post again later).
inline ssize_t WriteMsg(fid_ep* ep, const void* local, uint64_t len, void* desc, uint64_t dest, uint64_t remote_addr,
                        uint64_t rkey, uint64_t data, void* context, uint64_t flags) {
  iovec iov{const_cast<void*>(local), len};
  fi_rma_iov rma{remote_addr, len, rkey};
  fi_msg_rma msg{};
  msg.msg_iov = &iov;
  msg.desc = &desc;
  msg.iov_count = 1;
  msg.addr = dest;
  msg.rma_iov = &rma;
  msg.rma_iov_count = 1;
  msg.context = context;
  msg.data = data;
  return fi_writemsg(ep, &msg, flags);
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
