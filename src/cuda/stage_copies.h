// fabric_memory="staged": the kernels read and write their areas in HBM, the wire carries pinned host memory, and a
// copy engine moves each round between the two, driven by the proxy thread without blocking it. The kernels then never
// cross PCIe row by row (a receive kernel's reads of host memory ran at 2-5 GB/s beside another process's kernels,
// where a copy engine moves ~50 GB/s), and the proxy thread makes no call that waits on the GPU.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

namespace jax_moe::cuda {

// Whether CUDA loads modules lazily in this process (the default since CUDA 12.2; CUDA_MODULE_LOADING=EAGER turns it
// off). Staging needs eager loading: under lazy loading, a kernel loaded at its first launch holds up the proxy
// thread's copies until the kernels running then end, among them the receive kernel that waits for those very copies
// (measured on one H200: a copy held 7.9 s, until the kernel's timeout; with EAGER the same runs passed, warming the
// copies up at set-up did not help).
bool LazyModuleLoading();

class StageCopies {
 public:
  struct Copy {
    void* dst;
    const void* src;
    size_t bytes;
  };
  // `slots` independent sequences of rounds (a stream's sends and its arrivals), each with its own event; copies to
  // the GPU and from it go on two non-blocking streams of GPU `ordinal`, so both copy engines can work at once.
  StageCopies(int ordinal, int slots);
  ~StageCopies();
  StageCopies(const StageCopies&) = delete;
  StageCopies& operator=(const StageCopies&) = delete;

  // Whether `slot`'s copies for `round` are done. The first call for a round enqueues what `copies()` lists (in the
  // direction `to_device` says) and records the slot's event; later calls only query it. A slot's previous round must
  // be done before its next one starts (the pump asks in round order, each until it is done). Throws on a CUDA error.
  bool Ready(int slot, uint64_t round, bool to_device, const std::function<std::vector<Copy>()>& copies);

 private:
  void MakeCurrent() const;  // the calling (proxy) thread's current device
  int ordinal_;
  cudaStream_t streams_[2] = {nullptr, nullptr};  // [to_device]
  std::vector<cudaEvent_t> events_;
  std::vector<uint64_t> rounds_;  // the round whose copies each slot's event follows (0: none yet)
};

}  // namespace jax_moe::cuda
