#include "cuda/device_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <unistd.h>

#include "common/log.h"
#include "cuda/cuda_scope.h"

namespace jax_moe::cuda {
namespace {

// cuMemGetHandleForAddressRange through the runtime's entry-point query: no link against libcuda.
using GetRangeHandle = CUresult (*)(void*, CUdeviceptr, size_t, CUmemRangeHandleType, unsigned long long);

GetRangeHandle RangeHandleFn() {
  static GetRangeHandle fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
    if (cudaGetDriverEntryPointByVersion("cuMemGetHandleForAddressRange", &p, 12000, cudaEnableDefault, &status) !=
            cudaSuccess ||
        status != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<GetRangeHandle>(nullptr);
    }
    return reinterpret_cast<GetRangeHandle>(p);
  }();
  return fn;
}

// A dmabuf of the whole allocation, or -1 (no such driver entry point, or the driver refuses: no dmabuf support). The range must start and end on host pages: cudaMalloc's large
// allocations start on 2 MiB boundaries, and the size is rounded up by the caller.
int ExportDmabuf(uint8_t* data, size_t size, int ordinal) {
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  GetRangeHandle fn = RangeHandleFn();
  if (fn == nullptr || reinterpret_cast<uintptr_t>(data) % page != 0 || size % page != 0) return -1;
  int fd = -1;
  const CUresult rc = fn(&fd, reinterpret_cast<CUdeviceptr>(data), size, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD, 0);
  if (rc != CUDA_SUCCESS) {
    JAX_MOE_LOG(kInfo, "cuda: no dmabuf for GPU %d memory (cuMemGetHandleForAddressRange: %d)", ordinal, int(rc));
    return -1;
  }
  return fd;
}

}  // namespace

DeviceMemory::DeviceMemory(size_t bytes, int ordinal) : ordinal_(ordinal) {
  constexpr size_t kGranule = size_t(2) << 20;  // whole 2 MiB pages: the dmabuf covers exactly the allocation
  size_ = (bytes + kGranule - 1) / kGranule * kGranule;
  DeviceScope scope(ordinal);
  void* p = nullptr;
  Check(cudaMalloc(&p, size_), "cudaMalloc(fabric area)");
  data_ = static_cast<uint8_t*>(p);
  if (cudaError_t err = cudaMemset(data_, 0, size_); err != cudaSuccess) {
    cudaFree(data_);
    Check(err, "cudaMemset(fabric area)");
  }
  dmabuf_fd_ = ExportDmabuf(data_, size_, ordinal);
}

DeviceMemory::~DeviceMemory() {
  if (dmabuf_fd_ >= 0) close(dmabuf_fd_);
  if (data_) {
    int previous = 0;
    cudaGetDevice(&previous);
    cudaSetDevice(ordinal_);
    cudaFree(data_);
    cudaSetDevice(previous);
  }
}

namespace {
// One cudaMemcpyAsync on a fresh non-blocking stream, waited for; the range is checked against the allocation.
void CopyOnOwnStream(void* dst, const void* src, size_t n, int ordinal) {
  DeviceScope scope(ordinal);
  cudaStream_t stream = nullptr;
  Check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreateWithFlags");
  cudaError_t err = cudaMemcpyAsync(dst, src, n, cudaMemcpyDefault, stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
  cudaStreamDestroy(stream);
  Check(err, "cudaMemcpyAsync(DeviceMemory)");
}
}  // namespace

void DeviceMemory::Upload(size_t offset, const void* src, size_t n) const {
  if (offset > size_ || n > size_ - offset) Throw(ErrorCode::kInvalidArgument, "DeviceMemory.upload: out of range");
  CopyOnOwnStream(data_ + offset, src, n, ordinal_);
}

void DeviceMemory::Download(size_t offset, void* dst, size_t n) const {
  if (offset > size_ || n > size_ - offset) Throw(ErrorCode::kInvalidArgument, "DeviceMemory.download: out of range");
  CopyOnOwnStream(dst, data_ + offset, n, ordinal_);
}

RdmaVisibility VisibilityOf(int ordinal) {
  int ordering = 0, options = 0;
  Check(cudaDeviceGetAttribute(&ordering, cudaDevAttrGPUDirectRDMAWritesOrdering, ordinal),
        "cudaDeviceGetAttribute(GPUDirectRDMAWritesOrdering)");
  if (ordering >= cudaGPUDirectRDMAWritesOrderingOwner) return RdmaVisibility::kOrdered;
  Check(cudaDeviceGetAttribute(&options, cudaDevAttrGPUDirectRDMAFlushWritesOptions, ordinal),
        "cudaDeviceGetAttribute(GPUDirectRDMAFlushWritesOptions)");
  return (options & cudaFlushGPUDirectRDMAWritesOptionHost) ? RdmaVisibility::kFlush : RdmaVisibility::kUnavailable;
}

const char* VisibilityName(RdmaVisibility v) {
  switch (v) {
    case RdmaVisibility::kOrdered: return "ordered by the GPU (no flush needed)";
    case RdmaVisibility::kFlush: return "flushed by the proxy before each arrival flag";
    case RdmaVisibility::kUnavailable: return "not ordered and not flushable on this GPU";
  }
  return "?";
}

void FlushRdmaWrites() {
  Check(cudaDeviceFlushGPUDirectRDMAWrites(cudaFlushGPUDirectRDMAWritesTargetCurrentDevice,
                                           cudaFlushGPUDirectRDMAWritesToOwner),
        "cudaDeviceFlushGPUDirectRDMAWrites");
}

}  // namespace jax_moe::cuda
