// `jax_moe._core.cpu`: set-up of the "cpu" backend's CpuComm objects and its XLA FFI handler capsules.
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "cpu/cpu_comm.h"
#include "proxy/engine_pool.h"
#include "ffi/cpu_handlers.h"
#include "python/registry.h"

namespace nb = nanobind;
using jax_moe::cpu::CpuComm;

namespace {

using TableRow = std::tuple<int64_t, int32_t, int32_t, int32_t>;  // device id, process, group, rank
using EndpointRow = std::tuple<int32_t, int32_t, nb::bytes, nb::bytes, nb::bytes>;

std::shared_ptr<CpuComm> Get(uint32_t comm_id) {
  auto comm = jax_moe::cpu::FindComm(comm_id);
  if (!comm) throw nb::value_error(("jax_moe: no CpuComm with id " + std::to_string(comm_id)).c_str());
  return comm;
}

std::string Str(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

void Create(uint32_t comm_id, nb::dict shape, const std::vector<TableRow>& table, int32_t process, double timeout_s,
            const std::string& provider) {
  jax_moe::cpu::CommOptions options;
  auto get = [&](const char* key) {  // the shape's fields are int32 (kernels index with 32-bit math)
    const int64_t v = nb::cast<int64_t>(shape[key]);
    if (v < 0 || v > INT32_MAX) throw nb::value_error((std::string("jax_moe: ") + key + " out of range").c_str());
    return int32_t(v);
  };
  options.shape.num_ranks = get("num_ranks");
  options.shape.num_experts = get("num_experts");
  options.shape.local_experts = get("local_experts");
  options.shape.experts_per_token = get("experts_per_token");
  options.shape.hidden = get("hidden");
  options.shape.max_tokens = get("max_tokens");
  options.shape.x_itemsize = get("x_itemsize");
  options.shape.num_scales = get("num_scales");
  options.comm_id = comm_id;
  options.timeout_s = timeout_s;
  options.provider = provider;
  std::vector<jax_moe::cpu::RankInfo> rows;
  for (const auto& [device, proc, group, rank] : table) rows.push_back({device, proc, group, rank});
  std::shared_ptr<CpuComm> comm;
  {
    nb::gil_scoped_release release;
    comm = std::make_shared<CpuComm>(options, rows, process);
  }
  jax_moe::cpu::RegisterComm(std::move(comm));
}

std::vector<EndpointRow> Endpoints(uint32_t comm_id) {
  std::vector<EndpointRow> out;
  for (const auto& e : Get(comm_id)->LocalEndpoints()) {
    out.emplace_back(e.group, e.rank, nb::bytes(e.address.data(), e.address.size()),
                     nb::bytes(e.dispatch_region.data(), e.dispatch_region.size()),
                     nb::bytes(e.combine_region.data(), e.combine_region.size()));
  }
  return out;
}

void Connect(uint32_t comm_id, const std::vector<EndpointRow>& rows) {
  std::vector<jax_moe::cpu::Endpoint> remote;
  for (const auto& [group, rank, address, dreg, creg] : rows) {
    remote.push_back({group, rank, Str(address), Str(dreg), Str(creg)});
  }
  auto comm = Get(comm_id);
  nb::gil_scoped_release release;
  comm->Connect(remote);
}

void Release(uint32_t comm_id) {
  nb::gil_scoped_release release;  // ~CpuComm waits (bounded) for peers' last credits
  jax_moe::cpu::ReleaseComm(comm_id);
}

// At interpreter exit, before jax's own exit hooks and static destructors: wait for programs still running (they call
// into the CpuComms), then release every CpuComm and close the engines, so that no endpoint (shm region) outlives us.
void ReleaseAll() {
  nb::object modules = nb::module_::import_("sys").attr("modules");
  if (!modules.attr("get")("jax").is_none()) {
    try {
      nb::module_::import_("jax").attr("effects_barrier")();
    } catch (const std::exception&) {  // a failed program: its error was reported where it was awaited
    }
  }
  nb::gil_scoped_release release;
  jax_moe::cpu::ReleaseAllComms();
}

nb::capsule Capsule(XLA_FFI_Error* (*fn)(XLA_FFI_CallFrame*)) { return nb::capsule(reinterpret_cast<void*>(fn)); }

void RegisterCpu(nb::module_& m) {
  nb::module_ cpu = m.def_submodule("cpu", "The 'cpu' backend: dispatch/combine over shared memory and TransferEngine");
  cpu.def("create", &Create, nb::arg("comm_id"), nb::arg("shape"), nb::arg("table"), nb::arg("process"),
          nb::arg("timeout_s"), nb::arg("provider"),
          "Allocates and registers the buffers of this process's ranks of Communicator `comm_id`.");
  cpu.def("endpoints", &Endpoints, "(group, rank, engine address, dispatch region, combine region) per local rank");
  cpu.def("connect", &Connect, "Connects to the endpoints of the ranks in other processes.");
  cpu.def("bytes_allocated", [](uint32_t comm_id) { return Get(comm_id)->BytesAllocated(); });
  cpu.def("set_hosts", [](uint32_t comm_id, const std::vector<std::string>& hosts) { Get(comm_id)->SetHosts(hosts); },
          "The host of every process (index = process index), named in error messages.");
  cpu.def("release", &Release, "Releases Communicator `comm_id` of this process (no-op if there is none).");
  cpu.def("release_all", &ReleaseAll,
          "Releases every CpuComm and closes the idle engines; registered with atexit when the module loads.");
  cpu.def("live_comms", [] { return jax_moe::cpu::CpuComm::Live(); }, "CpuComms alive in this process.");
  cpu.def("open_engines", [] { return jax_moe::proxy::OpenEngines(); },
          "TransferEngines the cpu backend holds open (in use, or lingering after their last CpuComm).");
  cpu.def("handlers", [] {
    nb::dict d;
    d["dispatch_send"] = Capsule(JaxMoeCpuDispatchSend);
    d["dispatch_recv"] = Capsule(JaxMoeCpuDispatchRecv);
    d["combine_send"] = Capsule(JaxMoeCpuCombineSend);
    d["combine_recv"] = Capsule(JaxMoeCpuCombineRecv);
    d["timestamp"] = Capsule(JaxMoeCpuTimestamp);
    return d;
  });
  nb::module_::import_("atexit").attr("register")(cpu.attr("release_all"));
}

}  // namespace

JAX_MOE_PY_REGISTER(cpu, RegisterCpu);
