#include "fabric/numa_memory.h"

#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/error.h"
#include "common/log.h"

namespace jax_moe::fabric {
namespace {

// <linux/mempolicy.h>'s values (numaif.h comes with libnuma, which we do not need).
constexpr int kMpolPreferred = 1;
constexpr unsigned kMpolFNode = 1u << 0, kMpolFAddr = 1u << 1;
constexpr int kMaxNodes = 1024;  // bits in the node masks below

}  // namespace

NumaMemory::NumaMemory(size_t bytes, int node) : node_(node) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  size_ = (bytes + page - 1) / page * page;
  if (size_ == 0) size_ = page;
  void* p = mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    Throw(ErrorCode::kInternal, "NumaMemory: mmap of " + std::to_string(size_) + " bytes failed: " +
                                             std::strerror(errno));
  }
  data_ = p;
  // Not copied into a child process: fork() would otherwise make these pages copy-on-write in the parent, and a
  // write after it would move a page that the GPU and the NIC still address (older kernels).
  madvise(data_, size_, MADV_DONTFORK);
  if (node >= kMaxNodes) node_ = -1;  // nothing asked: report the default placement
  if (node >= 0 && node < kMaxNodes) {
    unsigned long mask[kMaxNodes / (8 * sizeof(unsigned long))] = {};
    mask[node / (8 * sizeof(unsigned long))] = 1ul << (node % (8 * sizeof(unsigned long)));
    // A refusal (no NUMA support in the kernel, a node offline) leaves the default placement: slower, not wrong.
    if (syscall(SYS_mbind, data_, static_cast<unsigned long>(size_), static_cast<unsigned long>(kMpolPreferred), mask,
                static_cast<unsigned long>(kMaxNodes + 1), 0u) != 0) {
      static std::atomic<bool> said{false};  // once a process: containers often refuse mbind (no CAP_SYS_NICE)
      if (!said.exchange(true)) {
        JAX_MOE_LOG(kWarn, "NumaMemory: mbind to NUMA node %d refused (%s): pinned areas get the default placement",
                    node, std::strerror(errno));
      }
      node_ = -1;
    }
  }
  std::memset(data_, 0, size_);  // the first touch places every page under the policy above
}

NumaMemory::~NumaMemory() {
  if (data_) munmap(data_, size_);
}

int NumaNodeOf(const void* p) {
  int node = -1;
  if (syscall(SYS_get_mempolicy, &node, nullptr, 0ul, const_cast<void*>(p),
              static_cast<unsigned long>(kMpolFNode | kMpolFAddr)) != 0) {
    return -1;
  }
  return node;
}

}  // namespace jax_moe::fabric
