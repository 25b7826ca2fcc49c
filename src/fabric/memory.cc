#include "fabric/memory.h"

namespace jax_moe::fabric {

const char* RegistrationName(Registration r) {
  switch (r) {
    case Registration::kHost: return "host";
    case Registration::kDmabuf: return "cuda (dmabuf)";
    case Registration::kCudaPointer: return "cuda (FI_HMEM_CUDA pointer)";
    case Registration::kFakeDevice: return "fake device (host memory, tests)";
  }
  return "?";
}

}  // namespace jax_moe::fabric
