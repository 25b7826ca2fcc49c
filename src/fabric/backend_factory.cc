// Picks a backend by name. Compiled without libfabric/ibverbs too: the names then report unavailable.
#include <string>

#include "common/error.h"
#include "common/log.h"
#include "fabric/backend.h"

namespace jax_moe::fabric {

#ifdef JAX_MOE_HAVE_LIBFABRIC
std::unique_ptr<Backend> OpenOfiBackend(const std::string& provider, int num_nics, const std::string& pci_bus_id,
                                        bool host_memory_only);  // ofi/ofi_backend.cc
#endif
#ifdef JAX_MOE_HAVE_IBVERBS
std::unique_ptr<Backend> OpenVerbsBackend(int num_nics, const std::string& pci_bus_id);  // verbs/verbs_backend.cc
#endif

namespace {

std::unique_ptr<Backend> OpenNamed(const std::string& name, int num_nics, const std::string& pci_bus_id,
                                   bool host_memory_only) {
  if (name == "verbs" || name == "ibverbs") {
#ifdef JAX_MOE_HAVE_IBVERBS
    return OpenVerbsBackend(num_nics, pci_bus_id);
#else
    Throw(ErrorCode::kUnavailable, "provider 'verbs': jax_moe was built without libibverbs");
#endif
  }
  if (name == "efa" || name == "tcp" || name == "shm") {
#ifdef JAX_MOE_HAVE_LIBFABRIC
    return OpenOfiBackend(name, num_nics, pci_bus_id, host_memory_only);
#else
    Throw(ErrorCode::kUnavailable, "provider '" + name + "': jax_moe was built without libfabric");
#endif
  }
  Throw(ErrorCode::kInvalidArgument,
        "unknown provider '" + name + "' (expected auto, efa, verbs, tcp or shm)");
}

}  // namespace

std::unique_ptr<Backend> OpenBackend(const std::string& provider, int num_nics, const std::string& pci_bus_id,
                                     bool host_memory_only) {
  if (provider != "auto") return OpenNamed(provider, num_nics, pci_bus_id, host_memory_only);
  // auto: real RDMA first (EFA, then ConnectX verbs), then sockets. tcp comes before shm because it
  // also reaches other hosts; ask for "shm" explicitly for single-node runs.
  std::string tried;
  for (const char* name : {"efa", "verbs", "tcp", "shm"}) {
    try {
      return OpenNamed(name, num_nics, pci_bus_id, host_memory_only);
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kInvalidArgument) throw;  // a bad setting (JAX_MOE_IB_*): the user's to fix
      JAX_MOE_LOG(kInfo, "provider auto: %s unavailable: %s", std::string(name).c_str(), e.what());
      tried += std::string(tried.empty() ? "" : "; ") + e.what();
    }
  }
  Throw(ErrorCode::kUnavailable, "provider auto: no provider available (" + tried + ")");
}

}  // namespace jax_moe::fabric
