// Host memory placed on one NUMA node: the pinned areas a NIC and a GPU read and write live on their socket, so no
// byte of a round crosses the inter-socket link twice (the proxy thread is kept there too: nic_topology.h).
// Plain Linux calls (mmap, mbind); no libnuma.
#pragma once
#include <cstddef>

namespace jax_moe::fabric {

// Page-aligned anonymous memory of at least `bytes`, zeroed, preferring NUMA node `node` (-1: the kernel's default
// placement). The policy is set before the first touch, which is what places a page; pages are touched here, so
// pinning them afterwards (cudaHostRegister) keeps them where they are. Preferred rather than bound: a full node
// spills over instead of failing.
class NumaMemory {
 public:
  NumaMemory(size_t bytes, int node);
  ~NumaMemory();
  NumaMemory(const NumaMemory&) = delete;
  NumaMemory& operator=(const NumaMemory&) = delete;
  void* data() const { return data_; }
  size_t size() const { return size_; }  // mapped (a whole number of pages)
  int node() const { return node_; }     // asked for (-1: none)

 private:
  void* data_ = nullptr;
  size_t size_ = 0;
  int node_ = -1;
};

// The NUMA node that holds the page at `p` (touched), or -1 when the kernel does not say.
int NumaNodeOf(const void* p);

}  // namespace jax_moe::fabric
