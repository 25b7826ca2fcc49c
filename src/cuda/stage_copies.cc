#include "cuda/stage_copies.h"

#include <cuda.h>

#include "common/error.h"
#include "cuda/cuda_scope.h"

namespace jax_moe::cuda {

bool LazyModuleLoading() {
  // cuModuleGetLoadingMode through the runtime: no driver library is linked (CI machines have none).
  using GetLoadingMode = CUresult (*)(CUmoduleLoadingMode*);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult status{};
  if (cudaGetDriverEntryPointByVersion("cuModuleGetLoadingMode", &fn, 12000, cudaEnableDefault, &status) !=
          cudaSuccess ||
      status != cudaDriverEntryPointSuccess || fn == nullptr) {
    cudaGetLastError();
    return true;  // cannot tell: assume the default
  }
  CUmoduleLoadingMode mode{};
  if (reinterpret_cast<GetLoadingMode>(fn)(&mode) != CUDA_SUCCESS) return true;
  return mode == CU_MODULE_LAZY_LOADING;
}

StageCopies::StageCopies(int ordinal, int slots) : ordinal_(ordinal) {
  Require(slots > 0, "StageCopies: no slots");
  DeviceScope scope(ordinal);
  try {
    for (cudaStream_t& s : streams_) Check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "cudaStreamCreate");
    events_.assign(size_t(slots), nullptr);
    for (cudaEvent_t& e : events_) Check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
  } catch (...) {
    for (cudaEvent_t e : events_)
      if (e) cudaEventDestroy(e);
    for (cudaStream_t s : streams_)
      if (s) cudaStreamDestroy(s);
    throw;
  }
  rounds_.assign(size_t(slots), 0);
}

StageCopies::~StageCopies() {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(ordinal_);
  for (cudaStream_t s : streams_) cudaStreamSynchronize(s);  // nothing of ours may read freed areas
  for (cudaEvent_t e : events_) cudaEventDestroy(e);
  for (cudaStream_t s : streams_) cudaStreamDestroy(s);
  cudaSetDevice(previous);
}

void StageCopies::MakeCurrent() const {
  static thread_local int current = -1;  // the proxy thread serves one GPU: set once, not on every pass
  if (current != ordinal_) {
    Check(cudaSetDevice(ordinal_), "cudaSetDevice(proxy thread)");
    current = ordinal_;
  }
}

bool StageCopies::Ready(int slot, uint64_t round, bool to_device, const std::function<std::vector<Copy>()>& copies) {
  Require(slot >= 0 && size_t(slot) < events_.size() && round > 0, "StageCopies: bad slot or round");
  MakeCurrent();
  cudaEvent_t event = events_[size_t(slot)];
  if (rounds_[size_t(slot)] != round) {
    Require(rounds_[size_t(slot)] < round, "StageCopies: rounds out of order");
    cudaStream_t stream = streams_[to_device ? 1 : 0];
    for (const Copy& c : copies()) {
      if (c.bytes == 0) continue;
      Check(cudaMemcpyAsync(c.dst, c.src, c.bytes, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost,
                            stream),
            "cudaMemcpyAsync(fabric stage)");
    }
    Check(cudaEventRecord(event, stream), "cudaEventRecord(fabric stage)");
    rounds_[size_t(slot)] = round;
  }
  const cudaError_t err = cudaEventQuery(event);
  if (err == cudaErrorNotReady) return false;
  Check(err, "cudaEventQuery(fabric stage)");
  return true;
}

}  // namespace jax_moe::cuda
