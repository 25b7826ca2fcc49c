// Pinned host memory mapped into the GPUs: the fabric areas and words that a NIC and the kernels share.
#pragma once
#include <cstddef>
#include <cstdint>

#include "fabric/numa_memory.h"

namespace jax_moe::cuda {

// `bytes` of zeroed host memory on NUMA node `node` (-1: the default placement; fabric/numa_memory.h), pinned and
// mapped into every GPU (cudaHostRegister, portable and mapped); unpinned and freed on destruction.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(size_t bytes, int node = -1);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  uint8_t* host() const { return static_cast<uint8_t*>(pages_.data()); }
  uint8_t* device() const { return device_; }
  size_t size() const { return size_; }
  int node() const { return pages_.node(); }  // the node asked for and granted (-1: default placement)

 private:
  fabric::NumaMemory pages_;
  uint8_t* device_ = nullptr;
  size_t size_ = 0;
};

}  // namespace jax_moe::cuda
