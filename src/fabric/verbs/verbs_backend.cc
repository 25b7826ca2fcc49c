// libibverbs backend (placeholder until the device code lands): reports unavailable.
#include <infiniband/verbs.h>

#include "common/error.h"
#include "fabric/backend.h"

namespace jax_moe::fabric {

std::unique_ptr<Backend> OpenVerbsBackend(int num_nics) {
  int n = 0;
  ibv_device** list = ibv_get_device_list(&n);
  if (list != nullptr) ibv_free_device_list(list);
  if (n <= 0) Throw(ErrorCode::kUnavailable, "provider verbs: no RDMA device (ibv_get_device_list found none)");
  Throw(ErrorCode::kUnavailable, "provider verbs: not implemented yet");
}

}  // namespace jax_moe::fabric
