// What memory a registration covers and how the transport took it (public: TransferEngine::Register, fabric_info).
#pragma once
#include <cstdint>

namespace jax_moe::fabric {

// Where the bytes of a region to register live. Device memory may come with a dmabuf of its range (the caller
// exports it and keeps the fd open until the region is deregistered): providers that take dmabufs register through
// it, the others through the CUDA pointer (FI_HMEM_CUDA / nvidia-peermem).
struct MemorySpec {
  int device = -1;             // CUDA ordinal; -1: host memory
  int dmabuf_fd = -1;          // a dmabuf holding the region, or -1
  uint64_t dmabuf_offset = 0;  // the region's first byte within that dmabuf
};

// How a region was registered, as fabric_info and the benchmark report it.
enum class Registration { kHost, kDmabuf, kCudaPointer, kFakeDevice };
const char* RegistrationName(Registration r);

}  // namespace jax_moe::fabric
