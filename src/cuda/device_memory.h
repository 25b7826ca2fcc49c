// GPU memory the NIC reads and writes (GPUDirect RDMA): the fabric areas of ranks on other nodes when the engine
// can register device memory, and buffers the benchmark registers to time the engine on the same memory.
#pragma once
#include <cstddef>
#include <cstdint>

namespace jax_moe::cuda {

// cudaMalloc'd, zeroed memory of one GPU, with a dmabuf of it where the driver exports one (the fd stays open until
// the memory is freed: a registration made through it must go first). Freed on destruction.
class DeviceMemory {
 public:
  DeviceMemory(size_t bytes, int ordinal);
  ~DeviceMemory();
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  int ordinal() const { return ordinal_; }
  // A dmabuf of [data(), data() + size()) rounded up to whole host pages, or -1 (no dmabuf support here).
  int dmabuf_fd() const { return dmabuf_fd_; }
  // Copies into / out of [offset, offset + n) on a non-blocking stream, as a kernel on XLA's streams would see the
  // memory: not ordered after the legacy stream, where providers make their own copies (tests of the wire use it).
  void Upload(size_t offset, const void* src, size_t n) const;
  void Download(size_t offset, void* dst, size_t n) const;

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int ordinal_ = 0;
  int dmabuf_fd_ = -1;
};

// What a host thread that saw a NIC's write into this GPU's memory complete must do before it tells a running kernel.
enum class RdmaVisibility {
  kOrdered,      // the GPU orders such writes before its own later reads (cudaDevAttrGPUDirectRDMAWritesOrdering >=
                 // owner): a flush would be a no-op
  kFlush,        // cudaDeviceFlushGPUDirectRDMAWrites (to the owner) first
  kUnavailable,  // neither ordered nor flushable: nothing the host can do (logged and reported)
};
RdmaVisibility VisibilityOf(int ordinal);
const char* VisibilityName(RdmaVisibility v);
// Flushes the current device's GPUDirect RDMA writes to its own kernels (call with the device current).
void FlushRdmaWrites();

}  // namespace jax_moe::cuda
