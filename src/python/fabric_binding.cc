// `jax_moe._core.fabric`: the TransferEngine for Python. jax_moe/fabric.py wraps it with input checks
// (numpy arrays, dtypes) and is the public surface; this file only converts types and errors.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "common/error.h"
#include "fabric/transfer_engine.h"
#include "python/registry.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_moe::py {
namespace {

using fabric::MemoryRegion;
using fabric::RegionDescriptor;
using fabric::TransferEngine;
using Offsets = nb::ndarray<const int64_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::bytes ToBytes(const std::string& s) { return nb::bytes(s.data(), s.size()); }
std::string FromBytes(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

struct Region {
  std::shared_ptr<MemoryRegion> mr;
};

std::vector<uint64_t> Unsigned(const Offsets& a, const char* name) {
  std::vector<uint64_t> out(a.shape(0));
  for (size_t i = 0; i < out.size(); ++i) {
    int64_t v = a.data()[i];
    Require(v >= 0, std::string(name) + "[" + std::to_string(i) + "] is negative");
    out[i] = static_cast<uint64_t>(v);
  }
  return out;
}

class Engine {
 public:
  Engine(const std::string& provider, int num_nics, int progress_cpu, bool busy_poll, bool fake_device_memory,
         bool host_memory_only) {
    fabric::EngineOptions o;
    o.fake_device_memory = fake_device_memory;
    o.host_memory_only = host_memory_only;
    o.provider = provider;
    o.num_nics = num_nics;
    o.progress_cpu = progress_cpu;
    o.busy_poll = busy_poll;
    eng_ = std::make_unique<TransferEngine>(o);
  }
  TransferEngine& e() {
    if (!eng_) Throw(ErrorCode::kClosed, "TransferEngine is closed");
    return *eng_;
  }
  void Close() {
    if (eng_) eng_->Close();
  }

 private:
  std::unique_ptr<TransferEngine> eng_;
};

void TranslateErrors() {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* type = PyExc_RuntimeError;
      switch (e.code()) {
        case ErrorCode::kInvalidArgument: type = PyExc_ValueError; break;
        case ErrorCode::kTimeout: type = PyExc_TimeoutError; break;
        case ErrorCode::kPeerFailed: type = PyExc_ConnectionError; break;
        default: break;
      }
      PyErr_SetString(type, e.what());
    }
  });
}

void RegisterFabric(nb::module_& m) {
  nb::module_ f = m.def_submodule("fabric", "TransferEngine: RDMA writes with immediates (libfabric/ibverbs)");
  TranslateErrors();
  f.attr("MAX_IMM") = fabric::kMaxWideImm;
  f.attr("MAX_PACKED_IMM") = fabric::kMaxPackedImm;
  f.attr("MAX_PEERS") = fabric::kMaxPeers;

  nb::class_<Region>(f, "MemoryRegion")
      .def("descriptor", [](const Region& r) { return ToBytes(r.mr->descriptor().Serialize()); })
      .def_prop_ro("ptr", [](const Region& r) { return reinterpret_cast<uintptr_t>(r.mr->data()); })
      .def_prop_ro("nbytes", [](const Region& r) { return r.mr->size(); })
      .def_prop_ro("device", [](const Region& r) { return r.mr->device(); })
      .def_prop_ro("registration", [](const Region& r) { return std::string(fabric::RegistrationName(r.mr->registration())); });

  nb::class_<Engine>(f, "Engine")
      .def(nb::init<const std::string&, int, int, bool, bool, bool>(), "provider"_a = "auto", "num_nics"_a = 1,
           "progress_cpu"_a = -1, "busy_poll"_a = false, "fake_device_memory"_a = false, "host_memory_only"_a = false,
           nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("supports_device_memory", [](Engine& s) { return s.e().supports_device_memory(); })
      .def("address", [](Engine& s) { return ToBytes(s.e().Address()); })
      .def_prop_ro("provider", [](Engine& s) { return s.e().provider(); })
      .def_prop_ro("num_nics", [](Engine& s) { return s.e().num_nics(); })
      .def_prop_ro("max_imm", [](Engine& s) { return s.e().max_imm(); })
      .def("register_ptr",
           [](Engine& s, uintptr_t ptr, uint64_t nbytes, int device, int dmabuf_fd, uint64_t dmabuf_offset) {
             fabric::MemorySpec mem;
             mem.device = device;
             mem.dmabuf_fd = dmabuf_fd;
             mem.dmabuf_offset = dmabuf_offset;
             nb::gil_scoped_release nogil;
             return Region{s.e().Register(reinterpret_cast<void*>(ptr), nbytes, mem)};
           },
           "ptr"_a, "nbytes"_a, "device"_a = -1, "dmabuf_fd"_a = -1, "dmabuf_offset"_a = 0)
      .def("connect",
           [](Engine& s, nb::bytes address, double timeout_s) {
             std::string a = FromBytes(address);
             nb::gil_scoped_release nogil;
             return s.e().Connect(a, timeout_s);
           },
           "address"_a, "timeout_s"_a = 30.0)
      .def("peer_set",
           [](Engine& s, const std::vector<uint32_t>& peers, const std::vector<nb::bytes>& descriptors) {
             std::vector<RegionDescriptor> regions;
             for (const auto& d : descriptors) regions.push_back(RegionDescriptor::Parse(FromBytes(d)));
             nb::gil_scoped_release nogil;
             return s.e().CreatePeerSet(peers, regions);
           },
           "peers"_a, "descriptors"_a)
      .def("peer_set_size", [](Engine& s, uint32_t set) { return s.e().PeerSetSize(set); })
      .def("scatter",
           [](Engine& s, uint32_t set, const Region& r, Offsets src, Offsets len, Offsets dst,
              std::optional<uint32_t> imm) {
             Require(src.shape(0) == len.shape(0) && len.shape(0) == dst.shape(0),
                     "scatter: src_offsets, lengths and dst_offsets must have the same length");
             auto so = Unsigned(src, "src_offsets"), ln = Unsigned(len, "lengths"), dof = Unsigned(dst, "dst_offsets");
             nb::gil_scoped_release nogil;
             s.e().Scatter(set, *r.mr, so.data(), ln.data(), dof.data(), so.size(), imm);
           },
           "peer_set"_a, "region"_a, "src_offsets"_a, "lengths"_a, "dst_offsets"_a, "imm"_a.none())
      .def("barrier", [](Engine& s, uint32_t set, uint32_t imm) { s.e().Barrier(set, imm); }, "peer_set"_a, "imm"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("write",
           [](Engine& s, uint32_t peer, const Region& r, uint64_t src_offset, uint64_t length, nb::bytes descriptor,
              uint64_t dst_offset, std::optional<uint32_t> imm) {
             RegionDescriptor d = RegionDescriptor::Parse(FromBytes(descriptor));
             nb::gil_scoped_release nogil;
             s.e().Write(peer, *r.mr, src_offset, length, d, dst_offset, imm);
           },
           "peer"_a, "region"_a, "src_offset"_a, "length"_a, "descriptor"_a, "dst_offset"_a, "imm"_a.none() = nb::none())
      .def("wait_imm",
           [](Engine& s, uint32_t imm, uint64_t count, double timeout_s) { s.e().WaitImm(imm, count, timeout_s); },
           "imm"_a, "count"_a, "timeout_s"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("wait_imm_from",
           [](Engine& s, uint32_t imm, const std::vector<uint32_t>& peers, double timeout_s) {
             nb::gil_scoped_release nogil;
             s.e().WaitImmFrom(imm, peers, timeout_s);
           },
           "imm"_a, "peers"_a, "timeout_s"_a)
      .def("wait_sends", [](Engine& s, double timeout_s) { s.e().WaitSends(timeout_s); }, "timeout_s"_a,
           nb::call_guard<nb::gil_scoped_release>())
      .def("try_consume_imm", [](Engine& s, uint32_t imm, uint64_t count) { return s.e().TryConsumeImm(imm, count); })
      .def("banked_imm", [](Engine& s, uint32_t imm) { return s.e().BankedImm(imm); })
      .def("sends_in_flight",
           [](Engine& s, std::optional<uint32_t> set) { return set ? s.e().SendsInFlight(*set) : s.e().SendsInFlight(); },
           "peer_set"_a.none() = nb::none())
      .def("discard_imms", [](Engine& s, uint32_t mask, uint32_t value) { return s.e().DiscardImms(mask, value); },
           "mask"_a, "value"_a)
      .def("destroy_peer_set", [](Engine& s, uint32_t set) { s.e().DestroyPeerSet(set); }, "peer_set"_a)
      .def("peers",
           [](Engine& s) {
             nb::list out;
             for (const auto& p : s.e().Peers()) {
               nb::dict d;
               d["id"] = p.id;
               d["label"] = p.label;
               d["nic"] = p.nic;
               d["failed"] = p.failed;
               d["failure"] = p.failure;
               out.append(d);
             }
             return out;
           })
      .def("stats",
           [](Engine& s) {
             auto st = s.e().Stats();
             nb::dict d;
             d["writes_posted"] = st.writes_posted;
             d["writes_completed"] = st.writes_completed;
             d["write_errors"] = st.write_errors;
             d["imms_per_nic"] = st.imms_per_nic;
             d["notices_apart"] = st.notices_apart;
             d["progress_passes"] = st.progress_passes;
             d["progress_ns"] = st.progress_ns;
             d["poll_ns"] = st.poll_ns;
             d["hooks_ns"] = st.hooks_ns;
             d["post_ns"] = st.post_ns;
             d["longest_poll_ns"] = st.longest_poll_ns;
             d["longest_hooks_ns"] = st.longest_hooks_ns;
             d["longest_post_ns"] = st.longest_post_ns;
             return d;
           })
      .def("close", &Engine::Close, nb::call_guard<nb::gil_scoped_release>());
}

}  // namespace
}  // namespace jax_moe::py

JAX_MOE_PY_REGISTER(fabric, jax_moe::py::RegisterFabric);
