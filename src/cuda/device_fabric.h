// The ranks of a device's Communicator that sit on other nodes: reached through the host proxy (proxy::Pump) and the
// TransferEngine instead of NVLink. Per round stream (dispatch, combine channel 0, 1) the device gets a send area and
// a receive area of pinned host memory mapped into the GPU (registered with the engine; tcp and shm cannot reach GPU
// memory), and the bell and byte words the kernels and the pump share (kernels/moe_layout.h, "ranks on other nodes").
// The pump runs on the engine's progress thread: it sees the bells, posts the regions with immediates, counts the
// arrivals, raises the flags the receive kernels wait on and returns the credits. Every Communicator of a GPU shares
// that GPU's engine (proxy/engine_pool.h): one busy-polling proxy thread per GPU and provider, whatever the number of
// MoE layers, optionally pinned to a core ($JAX_MOE_PROXY_CPUS).
#pragma once
#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/device_memory.h"
#include "cuda/pinned_buffer.h"
#include "cuda/stage_copies.h"
#include "fabric/transfer_engine.h"
#include "kernels/moe_layout.h"
#include "proxy/channel.h"
#include "proxy/engine_pool.h"
#include "proxy/pump.h"
#include "proxy/region_header.h"

namespace jax_moe::cuda {

// One fabric area (a stream's send or receive regions): in GPU memory where the engine registers device memory (the
// NIC reads and writes HBM, the kernels too), else in pinned host memory, which the kernels either map (host) or
// reach through a mirror in HBM that a copy engine keeps in step (staged).
struct Area {
  std::unique_ptr<PinnedBuffer> pinned;
  std::unique_ptr<DeviceMemory> hbm;
  std::unique_ptr<DeviceMemory> mirror;  // staged: what the kernels read and write
  size_t bytes = 0;  // registered and used (the allocation may be larger)
  uint8_t* kernel() const { return hbm ? hbm->data() : mirror ? mirror->data() : pinned->device(); }
  void* registered() const { return hbm ? static_cast<void*>(hbm->data()) : static_cast<void*>(pinned->host()); }
  size_t allocated() const { return (hbm ? hbm->size() : pinned->size()) + (mirror ? mirror->size() : 0); }
};

// Where the fabric areas of a device live: "device" (GPU memory, or an error saying why not), "host" (pinned host
// memory mapped into the GPU), "staged" (pinned host memory on the wire, HBM for the kernels, a copy engine between),
// "auto" (see DeviceFabric::Open).
enum class AreaMemory { kAuto, kDevice, kHost, kStaged };
AreaMemory ParseAreaMemory(const std::string& name);

// One remote rank as the other process published it.
struct RemoteEndpoint {
  int rank = 0;
  std::string address;                  // its engine
  std::vector<std::string> receive;     // [kFabricStreams] its receive areas' descriptors
};

class DeviceFabric {
 public:
  // nodes[p]: the node of rank p (rank p is remote where it is not ours); the areas hold regions for the ranks on
  // other nodes only (proxy::RegionSlots::OtherNodes). comm_id: the Communicator's id (its low 14 bits tag the
  // immediates; no two live fabrics of a process may share them). ordinal: the GPU (its engine is shared with the
  // GPU's other fabrics). held: the host is held back from running far ahead of this fabric's rounds (the plain
  // handlers; not the command-buffer ones), which "auto" needs before it stages through HBM.
  DeviceFabric(const MoeShape& shape, int rank, uint32_t comm_id, const std::vector<int32_t>& nodes, int ordinal,
               const std::string& provider, double timeout_s, AreaMemory memory = AreaMemory::kAuto,
               bool held = false);
  // Drains (bounded), stops the pump, waits for its own writes (bounded), gives the engine its peer sets and banked
  // immediates back, frees the areas, then lets go of the engine.
  ~DeviceFabric();
  DeviceFabric(const DeviceFabric&) = delete;
  DeviceFabric& operator=(const DeviceFabric&) = delete;

  std::string Address() const { return engine_->Address(); }
  std::string provider() const { return engine_->provider(); }
  // The core the GPU's proxy thread was asked to run on (-1: not pinned); the engine's first user chose it.
  int proxy_cpu() const { return proxy_cpu_; }
  // Where the proxy thread may run when not pinned to one core: the GPU's NUMA node (empty: anywhere).
  const std::vector<int>& proxy_cpus() const { return proxy_cpus_; }
  // The GPU's NUMA node, which its pinned areas prefer (-1: unknown); the node that preference was granted for (-1:
  // none asked, or mbind refused: default placement); and the node that holds the first page of its first receive
  // area as the kernel reports it (-1: in GPU memory, or not reported).
  int numa_node() const { return numa_node_; }
  int AreasNumaNodeGranted() const;
  int AreasNumaNode() const;
  std::vector<std::string> Descriptors() const;  // [kFabricStreams] our receive areas
  // Connects to the remote ranks (every one of them, in any order) and starts the pump; `name(rank)` for errors.
  void Connect(const std::vector<RemoteEndpoint>& peers, std::function<std::string(int64_t)> name);
  // The kernels' view: remote mask and areas.
  void Fill(KernelArgs& a) const;
  // Empty while the pump serves; else why it stopped.
  std::string Error() const;
  ErrorCode ErrorCodeOf() const { return pump_ ? pump_->error_code() : ErrorCode::kInternal; }
  uint64_t BytesAllocated() const;
  // Regions a lane of our areas holds: one per rank on another node.
  int64_t regions_per_lane() const { return slots_.Slots(rank_); }
  // Per stream: a region's bytes (each area is kFabricLanes lanes of regions_per_lane() regions).
  std::vector<uint64_t> RegionBytes() const;
  // Where the areas live and how the engine registered them ("gpu, cuda (dmabuf)", "host, ..."), and, when GPU
  // memory was wanted and not used, why.
  bool on_gpu() const { return on_gpu_; }
  bool staged() const { return stage_ != nullptr; }
  std::string MemoryName() const;
  const std::string& fallback_reason() const { return fallback_; }
  // Whether the proxy thread calls CUDA (the staged copies, GPUDirect flushes): the handlers then bound how far the
  // host runs ahead of the GPU (cuda/run_ahead.h).
  bool proxy_calls_cuda() const {
    return stage_ != nullptr || (on_gpu_ && (copies_gpu_memory() || visibility_ == RdmaVisibility::kFlush));
  }
  // The last round of stream `link` (0 dispatch, 1 + channel) whose bell this GPU rang; 0 before the first.
  uint64_t Rung(size_t link) const;
  // What the proxy does so that NIC writes into GPU memory are visible to the kernels (areas on the GPU only).
  std::string VisibilityName() const;
  // Per round of a stream (0 dispatch, 1 and 2 the combine channels): when the pump saw the bell, posted, flagged
  // arrival (steady-clock ns).
  std::vector<std::array<int64_t, 3>> Trace(int stream) const;

 private:
  void Open(int64_t n, int rank, AreaMemory memory, bool held);  // the streams' areas, registrations and channels
  // Why the areas cannot be GPU memory on this engine ("" where they can): `asked`, fabric_memory="device"; `held`,
  // the handlers hold the host back (cuda/run_ahead.h).
  std::string WhyNotDeviceMemory(bool asked, bool held) const;
  // The provider moves GPU memory with cudaMemcpy on the proxy thread (shm, tcp), not with a NIC's DMA: possible only
  // where CUDA loads eagerly and the host is held back (Open says why).
  static bool CopiesGpuMemory(const std::string& provider) { return provider == "shm" || provider == "tcp"; }
  bool copies_gpu_memory() const { return CopiesGpuMemory(engine_->provider()); }
  // $JAX_MOE_FABRIC_INSPECT=1: logs the headers of a round's regions before posting / flagging them.
  void Inspect(size_t link, uint64_t round, bool received) const;
  // A stream's area of `bytes` and its registration, on the GPU when on_gpu_ (with an HBM mirror when staged).
  std::pair<Area, std::shared_ptr<fabric::MemoryRegion>> NewArea(size_t bytes, bool staged);
  // The pump's hooks (Connect): the copy engine's work for a round of stream `link` before it is posted / flagged.
  bool StageSend(size_t link, uint64_t round);
  bool StageArrival(size_t link, uint64_t round);
  uint64_t ArrivedBytes(size_t link, const uint8_t* region) const;  // what a received region's header says it holds
  // Our areas' lanes for regions of `region` bytes: a region per rank on another node (slots_).
  proxy::Lanes LanesOf(uint64_t region) const { return {slots_.Slots(rank_), kFabricLanes, region}; }
  struct Stream {
    std::unique_ptr<PinnedBuffer> words;  // bell (kBellWords), then bytes [kFabricLanes][N] (by rank)
    Area send, recv;
    std::shared_ptr<fabric::MemoryRegion> send_mr, recv_mr;
    std::unique_ptr<proxy::Channel> channel;
    uint64_t region = 0;
    uint32_t comm_id = 0;
  };
  MoeShape shape_;
  int rank_;
  double timeout_s_;
  std::vector<bool> remote_;
  proxy::RegionSlots slots_;  // whose region is where in every rank's areas
  struct RemotePeer {
    int rank;
    int64_t slot;  // its region's in our areas
  };
  std::vector<RemotePeer> remote_peers_;  // the remote ranks in rank order, their slots found once (not per round)
  int ordinal_;
  std::string provider_;
  int proxy_cpu_ = -1;
  std::vector<int> proxy_cpus_;
  int numa_node_ = -1;
  bool on_gpu_ = false;
  std::string fallback_;           // why GPU memory was wanted and not used
  RdmaVisibility visibility_ = RdmaVisibility::kOrdered;
  uint32_t id_;  // comm_id & kIdMask, reserved on this GPU's engine while this fabric lives
  // proxy/engine_pool.h. An engine asked for FI_HMEM on a copying provider is kept apart: shm drops its single-copy
  // path for host memory once FI_HMEM is granted, which the Communicators with host areas would pay for.
  std::string EngineKey() const { return "cuda:" + std::to_string(ordinal_) + (hmem_engine_ ? "+hmem" : ""); }
  bool hmem_engine_ = false;  // set before the engine is acquired
  proxy::NoPeersHere here_;
  std::mutex mu_;
  std::condition_variable cv_;
  // Members in teardown order, last first (the destructor also orders it explicitly): the pump goes before the
  // channels, the channels and registrations before the engine handle.
  std::vector<Stream> streams_;
  std::unique_ptr<StageCopies> stage_;  // staged: after the streams (its destructor waits for its copies)
  std::shared_ptr<fabric::TransferEngine> engine_;
  std::unique_ptr<proxy::Pump> pump_;
};

}  // namespace jax_moe::cuda
