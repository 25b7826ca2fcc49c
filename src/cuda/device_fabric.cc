#include "cuda/device_fabric.h"

#include <cuda_runtime.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include "common/error.h"
#include "common/log.h"
#include "cuda/cuda_scope.h"
#include "fabric/nic_topology.h"
#include "fabric/numa_memory.h"
#include "proxy/imm.h"

namespace jax_moe::cuda {
namespace {

// Credits still owed to us are waited for at most this long when the fabric goes.
constexpr double kDrainBoundS = 5.0;
constexpr uint32_t kIdMask = 0x3fff;  // bit 14 tells the combine channels apart, bit 15 is beyond the immediates

// The (GPU, immediate id) of the fabrics alive in this process: the fabrics of one GPU share its engine, so two with
// the same id there would count each other's arrivals (one Communicator has a fabric per GPU, each on its own engine).
std::mutex& LiveMu() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}
std::set<std::pair<int, uint32_t>>& LiveIds() {
  static std::set<std::pair<int, uint32_t>>* ids = new std::set<std::pair<int, uint32_t>>;
  return *ids;
}

// What a fabric's writes read and write: kept past the fabric when some of them never completed (KeepUntilClosed).
struct Areas {
  std::vector<std::unique_ptr<PinnedBuffer>> buffers;
  std::vector<std::unique_ptr<DeviceMemory>> hbm;
  std::vector<std::shared_ptr<fabric::MemoryRegion>> regions;  // deregistered first, then the memory freed
};

// The core the progress thread of GPU `ordinal`'s engine runs on, or -1 (not pinned). $JAX_MOE_PROXY_CPUS="c0,c1,...":
// core c[ordinal % count]; unset or "none": not pinned. Not pinned by default: the process cannot see which cores
// other processes' proxies took (one process per GPU, or several on one GPU, each see their GPU as ordinal 0), and two
// busy-polling proxies on one core would take turns on it.
int ProxyCpu(int ordinal) {
  const char* env = std::getenv("JAX_MOE_PROXY_CPUS");
  if (env == nullptr || *env == 0 || std::string(env) == "none") return -1;
  std::vector<int> cpus;
  std::stringstream in(env);
  std::string item;
  while (std::getline(in, item, ',')) {
    char* end = nullptr;
    const long v = std::strtol(item.c_str(), &end, 10);
    Require(end != item.c_str() && *end == 0 && v >= 0 && v < CPU_SETSIZE,
            "JAX_MOE_PROXY_CPUS must be \"none\" or a comma-separated list of core numbers, got \"" +
                std::string(env) + "\"");
    cpus.push_back(int(v));
  }
  Require(!cpus.empty(), "JAX_MOE_PROXY_CPUS is empty");
  return cpus[size_t(ordinal) % cpus.size()];
}

}  // namespace

AreaMemory ParseAreaMemory(const std::string& name) {
  if (name == "auto" || name.empty()) return AreaMemory::kAuto;
  if (name == "device") return AreaMemory::kDevice;
  if (name == "host") return AreaMemory::kHost;
  if (name == "staged") return AreaMemory::kStaged;
  Throw(ErrorCode::kInvalidArgument,
        "jax_moe cuda: fabric_memory must be \"auto\", \"device\", \"host\" or \"staged\", got \"" + name + "\"");
}

DeviceFabric::DeviceFabric(const MoeShape& shape, int rank, uint32_t comm_id, const std::vector<int32_t>& nodes,
                           int ordinal, const std::string& provider, double timeout_s, AreaMemory memory, bool held)
    : shape_(shape), rank_(rank), timeout_s_(timeout_s), slots_(proxy::RegionSlots::OtherNodes(nodes)),
      ordinal_(ordinal), provider_(provider), id_(comm_id & kIdMask) {
  const int64_t n = shape.num_ranks;
  Require(int64_t(nodes.size()) == n && rank >= 0 && rank < n, "DeviceFabric: one node per rank");
  remote_.resize(n);
  for (int64_t p = 0; p < n; ++p) {
    remote_[p] = nodes[p] != nodes[rank];
    if (remote_[p]) remote_peers_.push_back({int(p), slots_.Slot(rank, p)});
  }
  Require(n <= proxy::kMaxRanks, "DeviceFabric: too many ranks for the immediates");
  {
    std::lock_guard<std::mutex> lock(LiveMu());
    Require(LiveIds().insert({ordinal_, id_}).second,
            "jax_moe cuda: Communicator " + std::to_string(comm_id) + " has ranks on other nodes, like a live one whose "
            "id is equal modulo " + std::to_string(kIdMask + 1) + ": free Communicators no longer used");
  }
  try {
    fabric::EngineOptions options;
    options.busy_poll = true;  // the proxy thread of a GPU spins: every microsecond it naps is on the data path
    // Providers that copy GPU memory themselves carry our GPU areas only where asked (Open): not asking them for
    // FI_HMEM otherwise keeps shm's single-copy path for the host areas.
    hmem_engine_ = CopiesGpuMemory(provider) && memory == AreaMemory::kDevice;
    options.host_memory_only = CopiesGpuMemory(provider) && !hmem_engine_;
    options.progress_cpu = proxy_cpu_ = ProxyCpu(ordinal);
    char bus[32] = {};  // the GPU's PCI address: its engine opens the NICs nearest to it (fabric/nic_topology.h)
    if (cudaDeviceGetPCIBusId(bus, sizeof(bus), ordinal) == cudaSuccess) {
      options.pci_bus_id = bus;
      // Not pinned to a core: kept on the GPU's NUMA node, where its polls and copies stay on the GPU's socket.
      if (proxy_cpu_ < 0) options.progress_cpus = proxy_cpus_ = fabric::PciLocalCpus(bus);
      numa_node_ = fabric::PciNumaNode(bus);  // and its pinned areas too (fabric/numa_memory.h)
    } else {
      cudaGetLastError();
    }
    engine_ = proxy::AcquireEngine(EngineKey(), provider, options);
    Require(engine_->max_imm() == UINT32_MAX, "DeviceFabric: the fabric provider does not carry 32-bit immediates");
    Open(n, rank, memory, held);
  } catch (...) {
    streams_.clear();
    engine_.reset();
    std::lock_guard<std::mutex> lock(LiveMu());
    LiveIds().erase({ordinal_, id_});
    throw;
  }
}

std::pair<Area, std::shared_ptr<fabric::MemoryRegion>> DeviceFabric::NewArea(size_t bytes, bool staged) {
  Area area;
  area.bytes = bytes;
  std::shared_ptr<fabric::MemoryRegion> mr;
  if (on_gpu_) {
    area.hbm = std::make_unique<DeviceMemory>(bytes, ordinal_);
    fabric::MemorySpec spec;
    spec.device = ordinal_;
    spec.dmabuf_fd = area.hbm->dmabuf_fd();
    try {
      mr = engine_->Register(area.hbm->data(), bytes, spec);
    } catch (const jax_moe::Error& e) {
      Throw(e.code(), std::string("jax_moe cuda: fabric_memory=\"device\": ") + e.what());
    }
  } else {
    area.pinned = std::make_unique<PinnedBuffer>(bytes, numa_node_);
    mr = engine_->Register(area.pinned->host(), bytes);
    if (staged) area.mirror = std::make_unique<DeviceMemory>(bytes, ordinal_);
  }
  return {std::move(area), std::move(mr)};
}

std::string DeviceFabric::WhyNotDeviceMemory(bool asked, bool held) const {
  const std::string provider = "provider " + engine_->provider();
  const std::string copies = provider + " copies GPU memory with CUDA calls on the proxy thread";
  if (copies_gpu_memory()) {
    if (!asked) return copies + " (only where fabric_memory=\"device\" asks, under CUDA_MODULE_LOADING=EAGER)";
    if (!engine_->supports_device_memory()) return provider + " did not grant FI_HMEM";
    if (LazyModuleLoading()) {
      return copies + ", which do not complete while a receive kernel waits for them under CUDA's lazy module "
                      "loading (set CUDA_MODULE_LOADING=EAGER before the process first uses CUDA)";
    }
    if (!held) {
      return copies + ", which the command-buffer handlers (JAX_MOE_CUDA_COMMAND_BUFFERS=1) can leave behind a full "
                      "launch queue";
    }
    return "";
  }
  if (!engine_->supports_device_memory()) return provider + " did not grant FI_HMEM";
  return asked ? "" : "GPU memory on the wire has not run on an RDMA NIC yet: fabric_memory=\"device\" opts in";
}

void DeviceFabric::Open(int64_t n, int rank, AreaMemory memory, bool held) {
  // GPU memory only when asked for (fabric_memory="device"): the NIC then writes the rows where the receive kernels
  // read them (HBM), instead of into host memory that every kernel read crosses PCIe for. "auto" takes the fastest
  // verified path, staged (pinned host memory on the wire, HBM for the kernels) where it can run, else host, and says
  // why not GPU memory (docs/cuda.md, "GPU memory on the wire"):
  // - shm and tcp copy GPU memory with cudaMemcpy on the proxy thread. Such a copy does not finish while a receive
  //   kernel waits for it if it must first load a module (CUDA's lazy loading waits for the running kernels) or
  //   find room in a launch queue that the host filled; so, as "staged", "device" there needs eager loading and
  //   the plain handlers, which hold the host back (cuda/run_ahead.h). It opts in: "auto" never takes it.
  // - efa and verbs move HBM by DMA without CUDA calls on that thread, but have not run on an RDMA NIC yet.
  on_gpu_ = memory == AreaMemory::kDevice;
  fallback_ = WhyNotDeviceMemory(on_gpu_, held);
  if (on_gpu_ && !fallback_.empty()) {
    Throw(ErrorCode::kUnavailable, "jax_moe cuda: fabric_memory=\"device\" is not possible here: " + fallback_ +
                                       "; use fabric_memory=\"host\" (pinned host memory), or a provider and a "
                                       "libfabric built with CUDA that grant FI_HMEM");
  }
  if (memory != AreaMemory::kAuto) fallback_.clear();  // the reason is for "auto" only: nothing fell back otherwise
  if (on_gpu_) visibility_ = VisibilityOf(ordinal_);
  bool staged = memory == AreaMemory::kStaged;
  if (memory == AreaMemory::kAuto) {  // staged only where it cannot stall: eager loading, a held host (stage_copies.h)
    if (!held) {
      fallback_ += "; host memory, not staged: the command-buffer handlers (JAX_MOE_CUDA_COMMAND_BUFFERS=1) do not hold "
                   "the host back, which the staged copies need";
    } else if (LazyModuleLoading()) {
      fallback_ += "; host memory, not staged: CUDA loads modules lazily, or its loading mode could not be read (set "
                   "CUDA_MODULE_LOADING=EAGER before the process first uses CUDA to stage through HBM)";
    } else {
      staged = true;
      fallback_ += "; staged through HBM instead";
    }
  }
  if (staged && LazyModuleLoading()) {
    Throw(ErrorCode::kUnavailable,
          "jax_moe cuda: fabric_memory=\"staged\" needs CUDA's eager module loading: set CUDA_MODULE_LOADING=EAGER in "
          "the environment before the process first uses CUDA (under lazy loading, the default, a kernel loaded at its "
          "first launch holds up the proxy's copies while a receive kernel waits for them), or use "
          "fabric_memory=\"host\"");
  }
  if (staged) stage_ = std::make_unique<StageCopies>(ordinal_, 2 * kFabricStreams);  // per stream: sends, arrivals
  // Streams: dispatch, combine channel 0, combine channel 1. The two combine channels share the immediate kinds and
  // differ in their id (bit 14), so their arrivals and credits are counted apart.
  const uint32_t id = id_;
  const proxy::ImmKind data[] = {proxy::ImmKind::kDispatchData, proxy::ImmKind::kCombineData,
                                 proxy::ImmKind::kCombineData};
  const proxy::ImmKind credit[] = {proxy::ImmKind::kDispatchCredit, proxy::ImmKind::kCombineCredit,
                                   proxy::ImmKind::kCombineCredit};
  const char* names[] = {"dispatch", "combine", "combine (gradient channel)"};
  streams_.resize(kFabricStreams);
  for (int i = 0; i < kFabricStreams; ++i) {
    Stream& st = streams_[i];
    st.region = i == 0 ? FabricDispatchRegion(shape_) : FabricCombineRegion(shape_, i - 1);
    st.comm_id = id | (i == 2 ? 0x4000u : 0u);
    const proxy::Lanes lanes = LanesOf(st.region);  // regions for the ranks on other nodes only
    st.words = std::make_unique<PinnedBuffer>(sizeof(uint64_t) * (proxy::kBellWords + kFabricLanes * n), numa_node_);
    std::tie(st.send, st.send_mr) = NewArea(lanes.buffer_bytes(), staged);
    std::tie(st.recv, st.recv_mr) = NewArea(lanes.buffer_bytes(), staged);
    proxy::ChannelConfig config;
    config.name = names[i];
    config.data_kind = data[i];
    config.credit_kind = credit[i];
    config.comm_id = st.comm_id;
    config.rank = rank;
    config.lanes = lanes;
    config.slots = slots_;
    st.channel = std::make_unique<proxy::Channel>(
        config, remote_, engine_, &here_,
        [](uint64_t) -> proxy::Block { Throw(ErrorCode::kInternal, "DeviceFabric: the device packs its regions"); },
        mu_, cv_);
  }
  if (on_gpu_ && visibility_ == RdmaVisibility::kUnavailable) {
    JAX_MOE_LOG(kWarn, "jax_moe cuda: GPU %d neither orders nor flushes GPUDirect RDMA writes; a NIC's writes may "
                "reach the receive kernels late (fabric_memory=\"host\" avoids it)", ordinal_);
  }
}

int DeviceFabric::AreasNumaNodeGranted() const {
  return streams_.empty() || !streams_[0].recv.pinned ? -1 : streams_[0].recv.pinned->node();
}

int DeviceFabric::AreasNumaNode() const {
  if (streams_.empty() || !streams_[0].recv.pinned) return -1;
  return fabric::NumaNodeOf(streams_[0].recv.pinned->host());
}

std::string DeviceFabric::MemoryName() const {
  if (streams_.empty()) return "none";
  const char* how = fabric::RegistrationName(streams_[0].recv_mr->registration());
  if (on_gpu_) return std::string("gpu, registered as ") + how;
  if (stage_) return std::string("staged: pinned host memory on the wire, registered as ") + how +
                     ", and HBM for the kernels, a copy engine between";
  return std::string("pinned host memory mapped into the GPU, registered as ") + how;
}

std::string DeviceFabric::VisibilityName() const {
  return on_gpu_ ? cuda::VisibilityName(visibility_) : "n/a";
}

DeviceFabric::~DeviceFabric() {
  if (pump_) pump_->Drain(timeout_s_ < kDrainBoundS ? timeout_s_ : kDrainBoundS);
  pump_.reset();
  stage_.reset();  // waits for its copies: they read and write the areas freed below
  // Our writes (not the engine's: it is shared) must be done before the areas they read are freed.
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  bool left = false;
  for (Stream& st : streams_) {
    try {
      while (st.channel && st.channel->SendsInFlight() > 0 && std::chrono::steady_clock::now() < end)
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      left |= st.channel && st.channel->SendsInFlight() > 0;
    } catch (const std::exception&) {  // a closed engine: nothing of ours is left in it
    }
  }
  if (left) {
    // Writes that never completed (a peer that died): the shared engine may still post or complete them, and peers
    // may still write into our receive areas. Their memory stays registered until the engine itself is closed.
    auto areas = std::make_shared<Areas>();
    for (Stream& st : streams_) {
      areas->buffers.push_back(std::move(st.words));
      for (Area* a : {&st.send, &st.recv}) {
        if (a->pinned) areas->buffers.push_back(std::move(a->pinned));
        if (a->hbm) areas->hbm.push_back(std::move(a->hbm));
        if (a->mirror) areas->hbm.push_back(std::move(a->mirror));
      }
      areas->regions.push_back(std::move(st.send_mr));
      areas->regions.push_back(std::move(st.recv_mr));
    }
    try {
      proxy::KeepUntilClosed(EngineKey(), provider_, areas);
    } catch (const std::exception&) {  // not open: nothing can use them any more
    }
  }
  streams_.clear();  // channels (peer sets, banked immediates), then registrations and pinned memory
  engine_.reset();
  std::lock_guard<std::mutex> lock(LiveMu());
  LiveIds().erase({ordinal_, id_});
}

std::vector<std::string> DeviceFabric::Descriptors() const {
  std::vector<std::string> out;
  for (const Stream& st : streams_) out.push_back(st.recv_mr->descriptor().Serialize());
  return out;
}

void DeviceFabric::Connect(const std::vector<RemoteEndpoint>& peers, std::function<std::string(int64_t)> name) {
  Require(!pump_, "DeviceFabric: connected twice");
  std::vector<const RemoteEndpoint*> by_rank(shape_.num_ranks, nullptr);
  for (const RemoteEndpoint& e : peers) {
    Require(e.rank >= 0 && e.rank < shape_.num_ranks && remote_[e.rank] && !by_rank[e.rank],
            "DeviceFabric: an endpoint for a rank that is not remote, or twice");
    Require(e.receive.size() == size_t(kFabricStreams), "DeviceFabric: one receive area per stream");
    by_rank[e.rank] = &e;
  }
  std::vector<fabric::PeerId> ids;
  std::vector<std::vector<fabric::RegionDescriptor>> regions(kFabricStreams);
  for (int32_t p : streams_[0].channel->remote_ranks()) {
    const RemoteEndpoint* e = by_rank[p];
    Require(e != nullptr, "DeviceFabric: no endpoint was published for rank " + std::to_string(p));
    ids.push_back(engine_->Connect(e->address, timeout_s_));
    for (int i = 0; i < kFabricStreams; ++i) {
      regions[i].push_back(fabric::RegionDescriptor::Parse(e->receive[i]));
      // Its lanes hold a region per rank not on its node: as many as ours only where the nodes are of one size.
      const uint64_t want = uint64_t(kFabricLanes * slots_.Slots(p)) * streams_[i].region;
      Require(regions[i].back().size == want, "DeviceFabric: rank " + std::to_string(p) + " registered areas of " +
                                                  std::to_string(regions[i].back().size) + " bytes where " +
                                                  std::to_string(want) + " were expected (configs or nodes differ?)");
    }
  }
  std::vector<proxy::Pump::Link> links;
  for (int i = 0; i < kFabricStreams; ++i) {
    Stream& st = streams_[i];
    st.channel->Connect(ids, std::move(regions[i]));
    uint64_t* words = reinterpret_cast<uint64_t*>(st.words->host());
    links.push_back({st.channel.get(), st.send_mr.get(), words, words + proxy::kBellWords});
  }
  // Before an arrival flag: a NIC's RDMA writes into GPU memory need a flush only where the GPU does not order them
  // (visibility_); providers that copy GPU memory themselves never get GPU areas (Open). Staged: the copy engine
  // brings a round's rows into HBM before its flag, and takes the device's rows out of HBM before the post.
  proxy::Pump::Hooks hooks;
  if (stage_) {
    hooks.before_post = [this](size_t link, uint64_t round) { return StageSend(link, round); };
    hooks.before_arrival = [this](size_t link, uint64_t round) { return StageArrival(link, round); };
  } else if (on_gpu_ && visibility_ == RdmaVisibility::kFlush) {
    const int ordinal = ordinal_;
    hooks.before_arrival = [ordinal](size_t, uint64_t) {  // on the engine's progress thread, which serves this GPU only
      static thread_local int current = -1;
      if (current != ordinal) {
        Check(cudaSetDevice(ordinal), "cudaSetDevice(proxy thread)");
        current = ordinal;
      }
      FlushRdmaWrites();
      return true;
    };
  }
  if (const char* env = std::getenv("JAX_MOE_FABRIC_INSPECT"); env != nullptr && std::string(env) == "1") {
    // Each round once, when the device side is ready with it (the hooks are asked again until they are).
    auto logged = std::make_shared<std::vector<uint64_t>>(2 * kFabricStreams, 0);
    auto post = std::move(hooks.before_post);
    hooks.before_post = [this, post, logged](size_t link, uint64_t round) {
      if (post && !post(link, round)) return false;
      if ((*logged)[2 * link] < round) Inspect(link, round, /*received=*/false);
      (*logged)[2 * link] = round;
      return true;
    };
    auto arrival = std::move(hooks.before_arrival);
    hooks.before_arrival = [this, arrival, logged](size_t link, uint64_t round) {
      const auto t0 = std::chrono::steady_clock::now();
      if (arrival && !arrival(link, round)) return false;
      const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (ms > 1) JAX_MOE_LOG(kWarn, "inspect: the wait before flagging round %llu took %.1f ms", (unsigned long long)round, ms);
      if ((*logged)[2 * link + 1] < round) Inspect(link, round, /*received=*/true);
      (*logged)[2 * link + 1] = round;
      const fabric::EngineStats es = engine_->Stats();  // a provider call that blocked shows as a long phase
      JAX_MOE_LOG(kWarn, "inspect: longest progress phases so far: poll %.1f ms, hooks %.1f ms, post %.1f ms",
                  es.longest_poll_ns / 1e6, es.longest_hooks_ns / 1e6, es.longest_post_ns / 1e6);
      return true;
    };
  }
  pump_ = std::make_unique<proxy::Pump>(std::move(links), timeout_s_, std::move(name), false, std::move(hooks));
}

// Staged, before posting `round` of stream `link`: each remote rank's region, as many bytes as the device wrote for it
// (its byte words, written before it rang), from the HBM mirror into the registered host area.
bool DeviceFabric::StageSend(size_t link, uint64_t round) {
  const Stream& st = streams_[link];
  return stage_->Ready(int(2 * link), round, /*to_device=*/false, [&] {
    const proxy::Lanes lanes = LanesOf(st.region);
    const uint64_t* bytes =
        reinterpret_cast<const uint64_t*>(st.words->host()) + proxy::kBellWords + lanes.Lane(round) * shape_.num_ranks;
    std::vector<StageCopies::Copy> copies;
    for (const RemotePeer& r : remote_peers_) {
      const uint64_t at = lanes.Offset(round, r.slot), n = __atomic_load_n(bytes + r.rank, __ATOMIC_ACQUIRE);
      copies.push_back({st.send.pinned->host() + at, st.send.mirror->data() + at, size_t(n < st.region ? n : st.region)});
    }
    return copies;
  });
}

// Staged, before flagging `round` of stream `link`: each remote sender's region, as many bytes as its header says it
// holds, from the registered host area into the HBM mirror the receive kernel reads.
bool DeviceFabric::StageArrival(size_t link, uint64_t round) {
  const Stream& st = streams_[link];
  return stage_->Ready(int(2 * link + 1), round, /*to_device=*/true, [&] {
    const proxy::Lanes lanes = LanesOf(st.region);
    std::vector<StageCopies::Copy> copies;
    for (const RemotePeer& r : remote_peers_) {
      const uint64_t at = lanes.Offset(round, r.slot);
      copies.push_back({st.recv.mirror->data() + at, st.recv.pinned->host() + at,
                        size_t(ArrivedBytes(link, st.recv.pinned->host() + at))});
    }
    return copies;
  });
}

// The bytes a received region holds, as the sender computed them (kernels: fabric.cu for dispatch, combine.cu), from
// its header's rows clamped to the shape; a header that is not ours: the header alone (the kernel reports it).
uint64_t DeviceFabric::ArrivedBytes(size_t link, const uint8_t* region) const {
  proxy::RegionHeader h{};
  std::memcpy(&h, region, sizeof(h));
  const uint64_t bound = streams_[link].region;
  if (h.magic != proxy::kRegionMagic) return FabricHeaderBytes(shape_);
  const int64_t most = link == 0 ? shape_.max_tokens : FabricCombineRows(shape_, int(link) - 1);
  const int64_t rows = h.rows < 0 ? 0 : (h.rows > most ? most : h.rows);
  const uint64_t n = link == 0 ? FabricDispatchBytes(shape_, rows) : FabricCombineBytes(shape_, rows);
  return n < bound ? n : bound;
}

// Reads, as a copy engine sees them (GPU memory: on a non-blocking stream of its own), the headers of `round`'s
// regions in stream `link`'s send area (before the pump posts them) or receive area (before it raises their arrival),
// and logs every one that is not that round's from the expected rank: where GPU memory on the wire goes wrong.
void DeviceFabric::Inspect(size_t link, uint64_t round, bool received) const {
  const Stream& st = streams_[link];
  const proxy::Lanes lanes = LanesOf(st.region);
  const Area& area = received ? st.recv : st.send;
  for (const RemotePeer& r : remote_peers_) {
    const int p = r.rank;
    const uint64_t at = lanes.Offset(round, r.slot);  // p's region in either area: ours to it, or its
    proxy::RegionHeader h{};
    if (area.hbm) {
      area.hbm->Download(at, &h, sizeof(h));
    } else {
      std::memcpy(&h, area.pinned->host() + at, sizeof(h));
    }
    // Without the counts check: a dispatch region's counts are entries per expert, its rows token records.
    std::string wrong = proxy::CheckHeader(h, shape_, st.comm_id, round, received ? p : rank_, false);
    if (wrong.empty() && link > 0 && h.rows > FabricCombineRows(shape_, int(link) - 1)) {  // channel 1: a row a token
      wrong = "announced " + std::to_string(h.rows) + " rows, more than the " +
              std::to_string(FabricCombineRows(shape_, int(link) - 1)) + " this channel's region holds";
    }
    const double now = std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
    JAX_MOE_LOG(kWarn, "inspect %.6f %s %s round %llu %s rank %d: %s (seq %llu, rows %d)", now,
                link == 0 ? "dispatch" : "combine", received ? "arrived" : "posting", (unsigned long long)round,
                received ? "from" : "to", p, wrong.empty() ? "ok" : wrong.c_str(), (unsigned long long)h.seq, h.rows);
  }
}

std::vector<uint64_t> DeviceFabric::RegionBytes() const {
  std::vector<uint64_t> out;
  for (const Stream& st : streams_) out.push_back(st.region);
  return out;
}

void DeviceFabric::Fill(KernelArgs& a) const {
  for (unsigned& w : a.remote) w = 0;
  a.num_remote = 0;
  for (int p = 0; p < shape_.num_ranks; ++p) {
    if (!remote_[p]) continue;
    a.remote[p >> 5] |= 1u << (p & 31);
    ++a.num_remote;
  }
  for (int i = 0; i < kFabricStreams; ++i) {
    const Stream& st = streams_[i];
    FabricArgs& f = a.fab[i];
    f.send = st.send.kernel();
    f.recv = st.recv.kernel();
    f.bell = reinterpret_cast<unsigned long long*>(st.words->device());
    f.bytes = f.bell + proxy::kBellWords;
    f.region = st.region;
    f.comm_id = st.comm_id;
  }
}

std::string DeviceFabric::Error() const { return pump_ ? pump_->error() : std::string(); }

uint64_t DeviceFabric::Rung(size_t link) const {
  const uint64_t* bell = reinterpret_cast<const uint64_t*>(streams_.at(link).words->host());
  return __atomic_load_n(bell + proxy::kRung, __ATOMIC_ACQUIRE);  // the GPU writes it over PCIe
}

uint64_t DeviceFabric::BytesAllocated() const {
  uint64_t total = 0;
  for (const Stream& st : streams_) total += st.words->size() + st.send.allocated() + st.recv.allocated();
  return total;
}

std::vector<std::array<int64_t, 3>> DeviceFabric::Trace(int stream) const {
  return pump_ && stream >= 0 ? pump_->Trace(size_t(stream)) : std::vector<std::array<int64_t, 3>>{};
}

}  // namespace jax_moe::cuda
