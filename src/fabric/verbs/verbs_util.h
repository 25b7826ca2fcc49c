// Error helpers for libibverbs calls (they return errno values or NULL with errno set).
#pragma once
#include <cerrno>
#include <cstring>
#include <string>

#include "common/error.h"

namespace jax_moe::fabric::verbs {

// For calls returning 0 or an errno value (ibv_modify_qp, ibv_post_send, ...).
inline void CheckRc(int rc, const char* call) {
  if (rc != 0) Throw(ErrorCode::kInternal, std::string(call) + ": " + std::strerror(rc > 0 ? rc : -rc));
}

// For calls returning a pointer, NULL with errno on failure (ibv_create_qp, ibv_reg_mr, ...).
template <typename T>
T* CheckPtr(T* p, const char* call) {
  if (p == nullptr) Throw(ErrorCode::kInternal, std::string(call) + ": " + std::strerror(errno ? errno : EINVAL));
  return p;
}

}  // namespace jax_moe::fabric::verbs
