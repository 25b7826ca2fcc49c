// Send buffers of one rank and direction: one region per peer, for regions that cannot be delivered yet (no credit)
// and for regions written to other processes (the NIC reads them after the send half returns). The memory comes from
// the device side (host memory on "cpu"; pinned, GPU-mapped host memory or device memory on a GPU), so the proxy never
// allocates or touches it except through the TransferEngine.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "fabric/transfer_engine.h"

namespace jax_moe::proxy {

// A block of memory and whatever keeps it alive.
struct Block {
  uint8_t* data = nullptr;
  uint64_t size = 0;
  std::shared_ptr<void> owner;
};
using Allocate = std::function<Block(uint64_t bytes)>;

struct Staging {
  Block mem;
  std::shared_ptr<fabric::MemoryRegion> mr;  // registered when the rank has peers in other processes
  int queued = 0;                            // regions still waiting in a peer queue
  bool remote_pending = false;               // writes from it may still be in flight
};

class StagingPool {
 public:
  StagingPool(uint64_t bytes, Allocate allocate) : bytes_(bytes), allocate_(std::move(allocate)) {}
  // A buffer whose regions are all delivered and whose remote writes are complete, or a new one. `engine` (may be
  // null) registers new buffers and completes writes that still hold an idle one.
  Staging* Acquire(fabric::TransferEngine* engine);
  uint64_t BytesAllocated() const { return bytes_ * buffers_.size(); }

 private:
  uint64_t bytes_;
  Allocate allocate_;
  std::vector<std::unique_ptr<Staging>> buffers_;
};

}  // namespace jax_moe::proxy
