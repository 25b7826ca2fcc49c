// `jax_moe._core.cuda`: the CUDA FFI handler capsules and the Communicator set-up the Python backend drives.
// Compiled only into CUDA builds (JAX_MOE_HAVE_CUDA); elsewhere the submodule is absent and the backend says why.
#ifdef JAX_MOE_HAVE_CUDA
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cuda/cuda_scope.h"
#include "cuda/device_error.h"
#include "cuda/device_comm.h"
#include "cuda/device_fabric.h"
#include "cuda/device_memory.h"
#include "cuda/launch.h"
#include "ffi/cuda/handlers.h"
#include "cuda/peer_bandwidth.h"
#include "python/registry.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using jax_moe::cuda::MoeShape;

template <typename Fn>
nb::capsule Capsule(Fn* fn) {
  return nb::capsule(reinterpret_cast<void*>(fn));
}

// The shape of a Communicator from the binding's arguments; the host runtime checks it (CreateComm).
MoeShape Shape(int n, int l, int r, int max_tokens, int hidden, int x_itemsize, int num_scales, int y_itemsize) {
  MoeShape s;
  s.num_ranks = n;
  s.num_experts = n * l;
  s.local_experts = l;
  s.experts_per_token = r;
  s.max_tokens = max_tokens;
  s.hidden = hidden;
  s.x_itemsize = x_itemsize;
  s.num_scales = num_scales;
  s.y_itemsize = y_itemsize;
  return s;
}

void RegisterCuda(nb::module_& m) {
  nb::module_ cuda = m.def_submodule("cuda", "CUDA dispatch/combine: FFI handlers and per-Communicator buffers");
  // GPU memory for the fabric benchmark: the engine timed on the memory the areas use (TransferEngine.register_ptr
  // with device= and dmabuf_fd=).
  nb::class_<jax_moe::cuda::DeviceMemory>(cuda, "DeviceMemory")
      .def(nb::init<size_t, int>(), "nbytes"_a, "ordinal"_a = 0)
      .def_prop_ro("ptr", [](const jax_moe::cuda::DeviceMemory& m) { return reinterpret_cast<uintptr_t>(m.data()); })
      .def_prop_ro("nbytes", &jax_moe::cuda::DeviceMemory::size)
      .def_prop_ro("ordinal", &jax_moe::cuda::DeviceMemory::ordinal)
      .def_prop_ro("dmabuf_fd", &jax_moe::cuda::DeviceMemory::dmabuf_fd)
      .def(
          "upload",
          [](const jax_moe::cuda::DeviceMemory& m, size_t offset, nb::bytes data) {
            m.Upload(offset, data.c_str(), data.size());
          },
          "offset"_a, "data"_a, "Copies bytes in at offset (on a non-blocking stream of its own)")
      .def(
          "download",
          [](const jax_moe::cuda::DeviceMemory& m, size_t offset, size_t n) {
            if (offset > m.size() || n > m.size() - offset) {
              jax_moe::Throw(jax_moe::ErrorCode::kInvalidArgument, "DeviceMemory.download: out of range");
            }
            std::string out(n, '\0');
            m.Download(offset, out.data(), n);
            return nb::bytes(out.data(), out.size());
          },
          "offset"_a, "nbytes"_a, "The bytes at [offset, offset + nbytes) (read on a non-blocking stream of its own)");
  cuda.def("handlers", []() {
    nb::dict d;
    d["jax_moe_cuda_dispatch_send"] = Capsule(JaxMoeCudaDispatchSend);
    d["jax_moe_cuda_dispatch_recv"] = Capsule(JaxMoeCudaDispatchRecv);
    d["jax_moe_cuda_combine_send"] = Capsule(JaxMoeCudaCombineSend);
    d["jax_moe_cuda_combine_recv"] = Capsule(JaxMoeCudaCombineRecv);
    d["jax_moe_cuda_timestamp"] = Capsule(JaxMoeCudaTimestamp);
    d["jax_moe_cuda_dispatch_send_graph"] = Capsule(JaxMoeCudaDispatchSendGraph);
    d["jax_moe_cuda_dispatch_recv_graph"] = Capsule(JaxMoeCudaDispatchRecvGraph);
    d["jax_moe_cuda_combine_send_graph"] = Capsule(JaxMoeCudaCombineSendGraph);
    d["jax_moe_cuda_combine_recv_graph"] = Capsule(JaxMoeCudaCombineRecvGraph);
    d["jax_moe_cuda_timestamp_graph"] = Capsule(JaxMoeCudaTimestampGraph);
    d["jax_moe_cuda_dispatch"] = Capsule(JaxMoeCudaDispatch);
    d["jax_moe_cuda_combine"] = Capsule(JaxMoeCudaCombine);
    d["jax_moe_cuda_dispatch_graph"] = Capsule(JaxMoeCudaDispatchGraph);
    d["jax_moe_cuda_combine_graph"] = Capsule(JaxMoeCudaCombineGraph);
    return d;
  });
  cuda.def(
      "buffer_bytes",
      [](int n, int l, int r, int max_tokens, int hidden, int x_itemsize, int num_scales, int y_itemsize) {
        return jax_moe::cuda::BufferBytes(Shape(n, l, r, max_tokens, hidden, x_itemsize, num_scales, y_itemsize));
      },
      "Bytes of one device's buffer for a configuration.");
  cuda.def(
      "create_comm",
      [](int64_t id, int n, int l, int r, int max_tokens, int hidden, int x_itemsize, int num_scales, int y_itemsize,
         const std::vector<std::pair<int, int>>& devices, double timeout_s) {
        jax_moe::cuda::CreateComm(id, Shape(n, l, r, max_tokens, hidden, x_itemsize, num_scales, y_itemsize),
                                   devices, static_cast<long long>(timeout_s * 1e9));
      },
      "Allocates the Communicator's buffers on the given local (ordinal, rank) devices.");
  cuda.def("export_buffer",
           [](int64_t id, int ordinal) {
             std::string h = jax_moe::cuda::ExportBuffer(id, ordinal);
             return nb::bytes(h.data(), h.size());
           });
  cuda.def(
      "connect",
      [](int64_t id, int ordinal, const std::vector<std::tuple<int, int, int, nb::bytes, std::string>>& peers) {
        std::vector<jax_moe::cuda::PeerSpec> specs;
        for (const auto& [rank, kind, peer_ordinal, ipc, where] : peers) {
          jax_moe::cuda::PeerSpec p;
          p.rank = rank;
          p.kind = static_cast<jax_moe::cuda::PeerKind>(kind);
          p.ordinal = peer_ordinal;
          p.ipc.assign(ipc.c_str(), ipc.size());
          p.where = where;
          specs.push_back(std::move(p));
        }
        jax_moe::cuda::ConnectComm(id, ordinal, specs);
      },
      "peers: (rank, kind 0=self 1=local device 2=ipc 3=remote, peer ordinal, ipc handle bytes, where the rank runs), in "
      "rank order.");
  cuda.def(
      "open_fabric",
      [](int64_t id, int ordinal, const std::string& provider, const std::string& memory, bool held,
         const std::vector<int32_t>& nodes) {
        std::pair<std::string, std::vector<std::string>> opened;
        {
          nb::gil_scoped_release release;  // registers the areas, starts the engine
          opened =
              jax_moe::cuda::OpenFabric(id, ordinal, provider, nodes, jax_moe::cuda::ParseAreaMemory(memory), held);
        }
        std::vector<nb::bytes> areas;
        for (const std::string& d : opened.second) areas.emplace_back(d.data(), d.size());
        return std::make_tuple(nb::bytes(opened.first.data(), opened.first.size()), areas);
      },
      "id"_a, "ordinal"_a, "provider"_a, "memory"_a, "held"_a, "nodes"_a,
      "For a device with ranks on other nodes: its engine, areas (memory: \"auto\", \"device\", \"host\", "
      "\"staged\"; held: the plain handlers, which hold the host back, will launch its rounds, so \"auto\" may stage; "
      "nodes: every rank's node, the areas holding regions for other nodes' ranks only) and host proxy. Returns "
      "(engine address, [receive area descriptor per stream]).");
  cuda.def(
      "connect_fabric",
      [](int64_t id, int ordinal, const std::vector<std::tuple<int, nb::bytes, std::vector<nb::bytes>>>& peers) {
        std::vector<jax_moe::cuda::RemoteEndpoint> endpoints;
        for (const auto& [rank, address, areas] : peers) {
          jax_moe::cuda::RemoteEndpoint e;
          e.rank = rank;
          e.address.assign(address.c_str(), address.size());
          for (const nb::bytes& d : areas) e.receive.emplace_back(d.c_str(), d.size());
          endpoints.push_back(std::move(e));
        }
        nb::gil_scoped_release release;  // the handshakes wait for the peers
        jax_moe::cuda::ConnectFabric(id, ordinal, endpoints);
      },
      "peers: (rank, engine address, [receive area descriptor per stream]) of every remote rank of the device.");
  cuda.def(
      "fabric_info",
      [](int64_t id, int ordinal) {
        auto dev = jax_moe::cuda::FindDevice(id, ordinal);
        nb::dict d;
        if (!dev || !dev->fabric) return d;
        d["provider"] = dev->fabric->provider();
        d["memory"] = dev->fabric->MemoryName();
        d["on_gpu"] = dev->fabric->on_gpu();
        d["staged"] = dev->fabric->staged();
        d["fallback"] = dev->fabric->fallback_reason();
        d["visibility"] = dev->fabric->VisibilityName();
        d["bytes"] = dev->fabric->BytesAllocated();
        d["remote_ranks"] = dev->args.num_remote;
        d["regions_per_lane"] = dev->fabric->regions_per_lane();
        d["lanes"] = jax_moe::cuda::kFabricLanes;
        nb::list regions;
        for (uint64_t region : dev->fabric->RegionBytes()) regions.append(region);
        d["region_bytes"] = regions;
        d["proxy_cpu"] = dev->fabric->proxy_cpu();
        d["proxy_cpus"] = dev->fabric->proxy_cpus();
        d["numa_node"] = dev->fabric->numa_node();
        d["areas_numa_node_granted"] = dev->fabric->AreasNumaNodeGranted();
        d["areas_numa_node"] = dev->fabric->AreasNumaNode();
        return d;
      },
      "The fabric of a device ({} without remote ranks): provider, where its areas live, their bytes and regions per "
      "lane (one per remote rank), lanes and per stream a region's bytes, "
      "the core of "
      "its proxy thread (-1: not pinned), the GPU's NUMA node and the one its pinned areas landed on (-1: unknown).");
  cuda.def(
      "fabric_trace",
      [](int64_t id, int ordinal, int rounds, int stream) {
        auto dev = jax_moe::cuda::FindDevice(id, ordinal);
        std::vector<std::tuple<int64_t, int64_t, int64_t>> out;
        if (!dev || !dev->fabric) return out;
        auto t = dev->fabric->Trace(stream);
        for (int i = 0; i < rounds && i < int(t.size()); ++i) out.emplace_back(t[i][0], t[i][1], t[i][2]);
        return out;
      },
      "id"_a, "ordinal"_a, "rounds"_a, "stream"_a = 0,
      "Per round of a stream (0 dispatch, 1 combine, 2 the combine's gradient channel) of a device's proxy: (bell "
      "seen, posted, arrival flagged), steady-clock ns (0: not yet).");
  // Without the GIL: teardown waits for the devices (and, bounded, for the peers' last acknowledgements).
  cuda.def("destroy_comm", &jax_moe::cuda::DestroyComm, nb::call_guard<nb::gil_scoped_release>());
  // At interpreter exit, before jax's own exit hooks: programs still running call into the Communicators.
  cuda.def("destroy_all", []() {
    nb::object modules = nb::module_::import_("sys").attr("modules");
    if (!modules.attr("get")("jax").is_none()) {
      try {
        nb::module_::import_("jax").attr("effects_barrier")();
      } catch (const std::exception&) {  // a failed program: its error was reported where it was awaited
      }
    }
    nb::gil_scoped_release release;
    jax_moe::cuda::DestroyAllComms();
  });
  nb::module_::import_("atexit").attr("register")(cuda.attr("destroy_all"));
  cuda.def(
      "take_error",
      [](int64_t id, int ordinal) {
        auto dev = jax_moe::cuda::FindDevice(id, ordinal);
        return dev ? jax_moe::cuda::TakeError(*dev).message : std::string();
      },
      "Reads and clears a device's error word (what the next recv half would report); '' when clear.");
  cuda.def(
      "launch_shapes",
      [](int64_t id, int ordinal, int tokens) {
        auto dev = jax_moe::cuda::FindDevice(id, ordinal);
        nb::dict d;
        if (!dev) return d;
        for (const auto& s : jax_moe::cuda::LaunchShapes(*dev, tokens)) {
          d[s.name] = std::make_tuple(s.blocks, s.threads);
        }
        d["sms"] = dev->args.num_sms;
        return d;
      },
      "Per half (blocks, threads per block) of its NVLink kernel for `tokens` tokens, and the device's SM count.");
  cuda.def(
      "testing_write_list",
      [](int64_t id, int ordinal, int sender, int expert, const std::vector<int32_t>& values) {
        auto dev = jax_moe::cuda::FindDevice(id, ordinal);
        if (!dev) throw std::invalid_argument("no such Communicator on this device");
        const auto& a = dev->args;
        if (sender < 0 || sender >= a.s.num_ranks || expert < 0 || expert >= a.s.local_experts ||
            values.size() > static_cast<size_t>(a.s.max_tokens))
          throw std::invalid_argument("sender, expert or the number of values out of range");
        jax_moe::cuda::DeviceScope scope(ordinal);
        // The slot the next dispatch_recv reads: that of the receive half's next epoch.
        jax_moe::cuda::LocalSync local{};
        if (cudaMemcpy(&local, a.base + a.lay.local, sizeof(local), cudaMemcpyDeviceToHost) != cudaSuccess) {
          (void)cudaGetLastError();
          throw std::runtime_error("cudaMemcpy of the device's epochs failed");
        }
        const size_t slot =
            jax_moe::cuda::RoundSlot(local.epoch[jax_moe::cuda::kDispatchRecv] + 1) * a.lay.dispatch_slot;
        uint8_t* at = a.base + a.lay.list + slot +
                      sizeof(int32_t) * (static_cast<size_t>(sender) * a.s.local_experts + expert) * a.s.max_tokens;
        if (cudaMemcpy(at, values.data(), sizeof(int32_t) * values.size(), cudaMemcpyHostToDevice) != cudaSuccess) {
          (void)cudaGetLastError();
          throw std::runtime_error("cudaMemcpy into the list failed");
        }
      },
      "Tests only: overwrites the start of list[sender][expert] in the device's receive area that its next "
      "dispatch_recv reads (what a faulty peer could write), while no kernel of the Communicator runs.");
  cuda.def("read_trace", &jax_moe::cuda::ReadTrace,
           "Device-side trace of a device: flat [64 epochs][halves][start, waited, work, end] %globaltimer ns "
           "(JAX_MOE_CUDA_TRACE=1 when the Communicator was made).");
  cuda.def("trace_shape", []() {
    return std::make_tuple(jax_moe::cuda::kTraceRing, jax_moe::cuda::kHalves, jax_moe::cuda::kTracePoints);
  });
  cuda.def("peer_copy_bandwidth", &jax_moe::cuda::PeerCopyBandwidth,
           "cudaMemcpyPeerAsync bytes/s from device src to dst (src == dst: a device-local copy).");
  cuda.def("host_read_bandwidth", &jax_moe::cuda::HostReadBandwidth, nb::call_guard<nb::gil_scoped_release>(),
           "(copy engine, kernel in place, kernel in place after the CPU wrote it) bytes/s at which device "
           "`ordinal` reads pinned host memory.");
}

}  // namespace

JAX_MOE_PY_REGISTER(cuda, RegisterCuda);
#endif  // JAX_MOE_HAVE_CUDA
