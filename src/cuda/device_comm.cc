#include "cuda/device_comm.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "common/error.h"
#include "common/log.h"
#include "cuda/cuda_scope.h"
#include "cuda/run_ahead.h"
#include "kernels/fabric_kernels.h"

namespace jax_moe::cuda {
namespace {

using LocalDevices = std::map<int, std::shared_ptr<DeviceComm>>;

std::mutex& RegistryMutex() {
  static std::mutex mu;
  return mu;
}
// Never destroyed: Communicators left at exit must not be torn down by static destructors (their proxies' engines
// after libfabric may have finalized); the Python module's exit hook calls DestroyAllComms before that.
std::map<int64_t, LocalDevices>& Registry() {
  static auto* groups = new std::map<int64_t, LocalDevices>();
  return *groups;
}

std::shared_ptr<DeviceComm> Lookup(int64_t id, int ordinal) {
  std::lock_guard<std::mutex> lock(RegistryMutex());
  auto g = Registry().find(id);
  if (g == Registry().end()) return nullptr;
  auto d = g->second.find(ordinal);
  return d == g->second.end() ? nullptr : d->second;
}

std::shared_ptr<DeviceComm> MustFind(int64_t id, int ordinal) {
  auto dev = Lookup(id, ordinal);
  if (!dev) {
    Throw(ErrorCode::kInvalidArgument,
          "jax_moe cuda: no Communicator " + std::to_string(id) + " on device " + std::to_string(ordinal));
  }
  return dev;
}

}  // namespace

DeviceComm::~DeviceComm() {
  if (ordinal < 0) return;
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(ordinal);
  cudaDeviceSynchronize();  // no kernel of this Communicator may still run
  for (void* p : ipc_mapped) cudaIpcCloseMemHandle(p);
  if (args.base) cudaFree(args.base);
  cudaGetLastError();
  cudaSetDevice(previous);
}

size_t BufferBytes(const MoeShape& shape) { return MakeLayout(shape).total; }

void CreateComm(int64_t id, const MoeShape& shape, const std::vector<std::pair<int, int>>& devices,
                 long long timeout_ns) {
  Require(shape.num_ranks >= 1 && shape.local_experts >= 1 && shape.experts_per_token >= 1 && shape.max_tokens >= 1, "jax_moe cuda: bad comm shape");
  if (*shape.Problem()) Throw(ErrorCode::kInvalidArgument, std::string("jax_moe cuda: ") + shape.Problem());
  // Kernels stride XLA's packed [rows, hidden] buffers by the 16-byte aligned row sizes: they must already be aligned.
  Require(shape.x_bytes() % 16 == 0 && (int64_t(shape.hidden) * shape.y_itemsize) % 16 == 0,
          "jax_moe cuda: row sizes must be multiples of 16 bytes");
  Require(shape.scale_bytes() % 4 == 0, "jax_moe cuda: scale rows must be whole float32s");
  Require(shape.experts_per_token <= 32, "jax_moe cuda: at most 32 experts per token (one warp lane each)");
  Require(shape.num_ranks <= kMaxRanks, "jax_moe cuda: at most 128 ranks (one thread per peer waits on its flag)");
  Require(int64_t(shape.num_ranks) * shape.max_tokens * shape.experts_per_token < (int64_t(1) << 31),
          "jax_moe cuda: ranks x max_tokens x experts_per_token must fit the int32 route");
  Require(!devices.empty(), "jax_moe cuda: a Communicator needs a local device");
  const char* trace = std::getenv("JAX_MOE_CUDA_TRACE");
  std::shared_ptr<unsigned long long> words;  // kHostWords per device, in `devices` order
  {
    DeviceScope scope(devices.front().first);
    void* host = nullptr;
    Check(cudaHostAlloc(&host, sizeof(unsigned long long) * kHostWords * devices.size(),
                        cudaHostAllocMapped | cudaHostAllocPortable),
          "cudaHostAlloc");
    words.reset(static_cast<unsigned long long*>(host), [](unsigned long long* p) { cudaFreeHost(p); });
    std::memset(host, 0, sizeof(unsigned long long) * kHostWords * devices.size());
  }
  LocalDevices comm;
  for (const auto& [ordinal, rank] : devices) {
    Require(rank >= 0 && rank < shape.num_ranks, "jax_moe cuda: rank out of range");
    Require(comm.count(ordinal) == 0, "jax_moe cuda: a device is listed twice");
    DeviceScope scope(ordinal);
    auto dev = std::make_shared<DeviceComm>();
    dev->ordinal = ordinal;
    KernelArgs& a = dev->args;
    a.s = shape;
    a.rank = rank;
    a.lay = MakeLayout(a.s);
    a.timeout_ns = timeout_ns;
    dev->timeout_s = double(timeout_ns) * 1e-9;
    a.trace = trace != nullptr && trace[0] == '1';
    Check(cudaDeviceGetAttribute(&a.num_sms, cudaDevAttrMultiProcessorCount, ordinal), "cudaDeviceGetAttribute");
    void* base = nullptr;
    Check(cudaMalloc(&base, a.lay.total), "cudaMalloc");
    a.base = static_cast<uint8_t*>(base);
    Check(cudaMemset(base, 0, a.lay.total), "cudaMemset");
    dev->host_words = words;
    dev->host_error = words.get() + kHostWords * comm.size();
    void* mapped = nullptr;
    Check(cudaHostGetDevicePointer(&mapped, dev->host_error, 0), "cudaHostGetDevicePointer");
    a.error = static_cast<unsigned long long*>(mapped);
    a.timeout = a.error + kTimeoutWord;
    a.error_ack = a.error + kAckWord;
    Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
    comm[ordinal] = std::move(dev);
  }
  // A timeout on one device ends the Communicator on every device of this process (the others would otherwise launch
  // kernels that wait the full timeout for a device that launches nothing).
  std::vector<const unsigned long long*> timeouts;
  for (const auto& [ordinal, dev] : comm) timeouts.push_back(dev->host_error + kTimeoutWord);
  for (auto& [ordinal, dev] : comm) dev->comm_timeouts = timeouts;
  std::lock_guard<std::mutex> lock(RegistryMutex());
  Require(Registry().count(id) == 0, "jax_moe cuda: Communicator " + std::to_string(id) + " exists already");
  Registry()[id] = std::move(comm);
}

std::string ExportBuffer(int64_t id, int ordinal) {
  auto dev = MustFind(id, ordinal);
  DeviceScope scope(ordinal);
  cudaIpcMemHandle_t handle;
  Check(cudaIpcGetMemHandle(&handle, dev->args.base), "cudaIpcGetMemHandle");
  return std::string(reinterpret_cast<const char*>(&handle), sizeof(handle));
}

void ConnectComm(int64_t id, int ordinal, const std::vector<PeerSpec>& peers) {
  auto dev = MustFind(id, ordinal);
  KernelArgs& a = dev->args;
  Require(static_cast<int>(peers.size()) == a.s.num_ranks, "jax_moe cuda: need one peer entry per rank");
  DeviceScope scope(ordinal);
  std::vector<uint8_t*> table(a.s.num_ranks, nullptr);
  dev->names.assign(a.s.num_ranks, "");
  dev->remote.assign(a.s.num_ranks, false);
  for (int i = 0; i < a.s.num_ranks; ++i) {
    const PeerSpec& p = peers[i];
    Require(p.rank == i, "jax_moe cuda: peers must be listed in rank order");
    dev->names[i] = "rank " + std::to_string(i) + (p.where.empty() ? "" : " (" + p.where + ")");
    switch (p.kind) {
      case PeerKind::kSelf:
        Require(i == a.rank, "jax_moe cuda: 'self' peer at another rank");
        table[i] = a.base;
        break;
      case PeerKind::kLocalDevice: {
        auto other = MustFind(id, p.ordinal);
        int can = 0;
        Check(cudaDeviceCanAccessPeer(&can, ordinal, p.ordinal), "cudaDeviceCanAccessPeer");
        Require(can == 1, "jax_moe cuda: device " + std::to_string(ordinal) + " cannot access device " +
                              std::to_string(p.ordinal) + " (no NVLink/P2P)");
        cudaError_t err = cudaDeviceEnablePeerAccess(p.ordinal, 0);
        if (err == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else {
          Check(err, "cudaDeviceEnablePeerAccess");
        }
        table[i] = other->args.base;
        break;
      }
      case PeerKind::kIpc: {
        Require(p.ipc.size() == sizeof(cudaIpcMemHandle_t), "jax_moe cuda: bad IPC handle size");
        cudaIpcMemHandle_t handle;
        std::memcpy(&handle, p.ipc.data(), sizeof(handle));
        void* mapped = nullptr;
        Check(cudaIpcOpenMemHandle(&mapped, handle, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
        dev->ipc_mapped.push_back(mapped);
        table[i] = static_cast<uint8_t*>(mapped);
        break;
      }
      case PeerKind::kRemote:
        Require(i != a.rank, "jax_moe cuda: this rank cannot be remote");
        dev->remote[i] = true;  // no pointer: the kernels never address its buffer
        break;
      default:
        Throw(ErrorCode::kInvalidArgument, "jax_moe cuda: unknown peer kind");
    }
  }
  Check(cudaMemcpy(a.base + a.lay.peers, table.data(), sizeof(uint8_t*) * table.size(), cudaMemcpyHostToDevice),
        "cudaMemcpy(peers)");
  bool any_remote = false;
  for (bool r : dev->remote) any_remote |= r;
  dev->connected = !any_remote;  // else once its fabric is connected
}

std::pair<std::string, std::vector<std::string>> OpenFabric(int64_t id, int ordinal, const std::string& provider,
                                                             const std::vector<int32_t>& nodes, AreaMemory memory,
                                                             bool held) {
  auto dev = MustFind(id, ordinal);
  Require(!dev->fabric, "jax_moe cuda: the fabric of a device is opened once");
  Require(!dev->remote.empty(), "jax_moe cuda: connect the device before opening its fabric");
  const int rank = dev->args.rank;
  Require(nodes.size() == dev->remote.size(), "jax_moe cuda: open_fabric needs one node per rank");
  for (size_t p = 0; p < nodes.size(); ++p) {
    Require((nodes[p] != nodes[rank]) == dev->remote[p],
            "jax_moe cuda: the nodes given to open_fabric disagree with the peers connected (rank " +
                std::to_string(p) + ")");
  }
  // The remote ranks' index keeps 32 bits per local expert and warp in shared memory (kernels/fabric.cu).
  int smem = 0;
  Check(cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, ordinal), "cudaDeviceGetAttribute");
  const MoeShape& s = dev->args.s;
  if (IndexSharedBytes(s) > size_t(smem)) {
    Throw(ErrorCode::kInvalidArgument, "jax_moe cuda: " + std::to_string(s.local_experts) +
                                           " experts per rank are too many for ranks on other nodes on this GPU (the "
                                           "index keeps 32 bits per expert and warp in a block's " +
                                           std::to_string(smem) + " bytes of shared memory): use more ranks");
  }
  DeviceScope scope(ordinal);
  dev->fabric = std::make_unique<DeviceFabric>(dev->args.s, rank, static_cast<uint32_t>(id), nodes, ordinal, provider,
                                               dev->timeout_s, memory, held);
  return {dev->fabric->Address(), dev->fabric->Descriptors()};
}

void ConnectFabric(int64_t id, int ordinal, const std::vector<RemoteEndpoint>& peers) {
  auto dev = MustFind(id, ordinal);
  Require(dev->fabric != nullptr, "jax_moe cuda: open the device's fabric before connecting it");
  std::vector<std::string> names = dev->names;
  dev->fabric->Connect(peers, [names](int64_t r) {
    return r >= 0 && r < int64_t(names.size()) ? names[r] : "rank " + std::to_string(r);
  });
  dev->fabric->Fill(dev->args);
  dev->connected = true;
}

namespace {

// Waits until no peer will write into `dev`'s buffer again: the peers' last acknowledgements of this device's sends
// (the only writes a peer makes after this device has received every round it sent) have arrived. Bounded by
// `deadline`: a peer that is gone or out of step is given up on (also after a timeout: a late peer may still ack).
void AwaitPeerAcks(const DeviceComm& dev, std::chrono::steady_clock::time_point deadline) {
  const KernelArgs& a = dev.args;
  LocalSync local;
  std::vector<unsigned long long> flags(size_t(kFlagKinds) * a.s.num_ranks);
  if (cudaSetDevice(dev.ordinal) != cudaSuccess ||
      cudaMemcpy(&local, a.base + a.lay.local, sizeof(local), cudaMemcpyDeviceToHost) != cudaSuccess) {
    cudaGetLastError();
    return;
  }
  for (;;) {
    if (cudaMemcpy(flags.data(), a.base + a.lay.flags, flags.size() * sizeof(flags[0]), cudaMemcpyDeviceToHost) !=
        cudaSuccess) {
      cudaGetLastError();
      return;
    }
    int missing = -1;
    for (int p = 0; p < a.s.num_ranks && missing < 0; ++p) {
      if (p < int(dev.remote.size()) && dev.remote[p]) continue;  // its proxy's credits: the fabric drains them
      if (flags[size_t(kDispatchAck) * a.s.num_ranks + p] < local.epoch[kDispatchSend]) missing = p;
      for (int ch = 0; ch < kCombineChannels; ++ch)
        if (flags[size_t(kCombineAck + 2 * ch) * a.s.num_ranks + p] < local.epoch[kCombineSend + 2 * ch]) missing = p;
    }
    if (missing < 0) return;
    if (std::chrono::steady_clock::now() > deadline) {
      JAX_MOE_LOG(kWarn, "jax_moe cuda: freeing a Communicator's buffer on device %d although rank %d never "
                  "acknowledged its last round", int(dev.ordinal), int(missing));
      return;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

}  // namespace

void DestroyComm(int64_t id) {
  LocalDevices doomed;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    auto g = Registry().find(id);
    if (g == Registry().end()) return;
    doomed = std::move(g->second);
    Registry().erase(g);
  }
  // Outside the lock. A handler that found a device before the Communicator left the registry may still be launching on
  // it: wait until `doomed` is the only holder of every device (a handler holds its device for one call), so that
  // nothing is launched after the synchronisation below.
  // Then its recorded sends are forgotten (no run-ahead hold of another Communicator locks it from then on: no
  // handler holds it, so none records a send after ForgetSends), and once more until a hold that locked it just before
  // has let go (cuda/run_ahead.h).
  for (const auto& [ordinal, dev] : doomed) {
    while (dev.use_count() > 1) std::this_thread::yield();
    ForgetSends(ordinal, dev.get());
    while (dev.use_count() > 1) std::this_thread::yield();
  }
  std::atomic_thread_fence(std::memory_order_acquire);
  // Two phases: every device of the Communicator is quiet before any buffer is freed, since a kernel on one device may
  // still write into another's buffer (an acknowledgement at the end of a receive).
  int previous = 0;
  cudaGetDevice(&previous);
  long long bound_ns = 5'000'000'000LL;  // one bound for the whole comm, whatever its number of devices
  for (const auto& [ordinal, dev] : doomed) {
    bound_ns = std::min(bound_ns, dev->args.timeout_ns);
    if (cudaSetDevice(ordinal) != cudaSuccess || cudaDeviceSynchronize() != cudaSuccess) cudaGetLastError();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(bound_ns);
  for (const auto& [ordinal, dev] : doomed) AwaitPeerAcks(*dev, deadline);
  for (const auto& [ordinal, dev] : doomed) dev->fabric.reset();  // drains its credits (bounded), then lets go
  cudaSetDevice(previous);
  doomed.clear();
}

void DestroyAllComms() {
  std::vector<int64_t> ids;
  {
    std::lock_guard<std::mutex> lock(RegistryMutex());
    for (const auto& [id, devices] : Registry()) ids.push_back(id);
  }
  for (int64_t id : ids) DestroyComm(id);
  proxy::CloseIdleEngines();  // the GPUs' engines, before libfabric finalizes
}

std::shared_ptr<const DeviceComm> FindDevice(int64_t id, int ordinal) { return Lookup(id, ordinal); }

std::vector<unsigned long long> ReadTrace(int64_t id, int ordinal) {
  auto dev = MustFind(id, ordinal);
  DeviceScope scope(ordinal);
  std::vector<unsigned long long> out(size_t(kTraceRing) * kHalves * kTracePoints);
  Check(cudaMemcpy(out.data(), dev->args.base + dev->args.lay.trace, out.size() * sizeof(out[0]),
                   cudaMemcpyDeviceToHost),
        "cudaMemcpy(trace)");
  return out;
}

}  // namespace jax_moe::cuda
