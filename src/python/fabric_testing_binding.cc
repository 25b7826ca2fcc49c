// `jax_moe._core.fabric._testing`: hooks for unit tests of the device-independent fabric logic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>

#include "common/deadline.h"
#include "common/error.h"
#include "fabric/descriptor.h"
#include "fabric/imm.h"
#include "fabric/imm_counter.h"
#include "fabric/nic_topology.h"
#include "fabric/numa_memory.h"
#include "fabric/wire.h"
#include "python/registry.h"
#ifdef JAX_MOE_HAVE_IBVERBS
#include <arpa/inet.h>

#include "fabric/verbs/handshake.h"
#include "fabric/verbs/rc_state.h"
#include "fabric/verbs/wr_template.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_moe::py {
namespace {

using namespace jax_moe::fabric;

nb::bytes B(const std::string& s) { return nb::bytes(s.data(), s.size()); }
std::string S(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

#ifdef JAX_MOE_HAVE_IBVERBS
nb::dict Actions(const verbs::RcActions& a) {
  nb::dict d;
  d["create_local_qps"] = a.create_local_qps;
  d["connect_qps"] = a.connect_qps;
  d["flush_parked"] = a.flush_parked;
  d["fail_parked"] = a.fail_parked;
  return d;
}

void RegisterVerbsHooks(nb::module_& t) {
  using namespace jax_moe::fabric::verbs;
  t.def("verbs_ud_address", [](nb::bytes gid, uint16_t lid, uint32_t qpn, uint32_t qkey, uint8_t port, uint8_t gid_index) {
    UdAddress a;
    Require(gid.size() == 16, "gid must be 16 bytes");
    std::memcpy(a.gid.data(), gid.c_str(), 16);
    a.lid = lid, a.qpn = qpn, a.qkey = qkey, a.port = port, a.gid_index = gid_index;
    return B(a.Serialize());
  });
  t.def("verbs_ud_address_parse", [](nb::bytes b) {
    UdAddress a = UdAddress::Parse(S(b));
    nb::dict d;
    d["gid"] = nb::bytes(reinterpret_cast<const char*>(a.gid.data()), 16);
    d["lid"] = a.lid, d["qpn"] = a.qpn, d["qkey"] = a.qkey, d["port"] = a.port, d["gid_index"] = a.gid_index;
    return d;
  });
  using Entry = std::tuple<uint32_t, uint32_t, uint32_t, uint32_t, uint8_t>;
  t.def("verbs_blob", [](std::vector<Entry> nics) {
    ConnectBlob b;
    for (const auto& e : nics) {
      b.nics.push_back({std::get<0>(e), std::get<1>(e), std::get<2>(e), std::get<3>(e), std::get<4>(e)});
    }
    return B(b.Serialize());
  });
  t.def("verbs_blob_parse", [](nb::bytes raw) {
    std::vector<Entry> out;
    for (const auto& e : ConnectBlob::Parse(S(raw)).nics) out.emplace_back(e.msg_qpn, e.msg_psn, e.rma_qpn, e.rma_psn, e.mtu);
    return out;
  });
  // Every ibv_post_send a write of `length` bytes turns into: a list of chains, each a list of WRs.
  t.def("verbs_write_chains", [](uint32_t rkey, uint64_t remote_base, uint32_t lkey, uint64_t max_chunk, uint64_t local,
                                 uint64_t length, uint64_t remote_offset, std::optional<uint32_t> imm, uint64_t wr_id) {
    WriteChain chain(rkey, remote_base, lkey, max_chunk);
    nb::list posts;
    uint64_t done = 0;
    do {
      size_t count = 0;
      uint64_t consumed = 0;
      ibv_send_wr* head = chain.Patch(local + done, length - done, remote_offset + done, imm, wr_id, &count, &consumed);
      nb::list wrs;
      size_t walked = 0;
      for (ibv_send_wr* w = head; w != nullptr; w = w->next, ++walked) {
        nb::dict d;
        d["opcode"] = w->opcode == IBV_WR_RDMA_WRITE_WITH_IMM ? "write_imm" : (w->opcode == IBV_WR_RDMA_WRITE ? "write" : "other");
        d["addr"] = w->num_sge ? w->sg_list->addr : 0;
        d["length"] = w->num_sge ? w->sg_list->length : 0;
        d["lkey"] = w->sg_list->lkey;
        d["num_sge"] = w->num_sge;
        d["remote_addr"] = w->wr.rdma.remote_addr;
        d["rkey"] = w->wr.rdma.rkey;
        d["imm"] = ntohl(w->imm_data);
        d["signaled"] = (w->send_flags & IBV_SEND_SIGNALED) != 0;
        d["wr_id"] = w->wr_id;
        wrs.append(d);
      }
      Require(walked == count, "chain length mismatch");
      posts.append(wrs);
      done += consumed;
    } while (done < length);
    return posts;
  }, "rkey"_a, "remote_base"_a, "lkey"_a, "max_chunk"_a, "local"_a, "length"_a, "remote_offset"_a, "imm"_a.none(), "wr_id"_a);

  using Conn = RcConnection<int>;
  nb::class_<Conn>(t, "RcConnection")
      .def(nb::init<>())
      .def_prop_ro("state", [](const Conn& c) { return std::string(RcStateName(c.state())); })
      .def_prop_ro("failure", &Conn::failure)
      .def_prop_ro("parked", &Conn::parked)
      .def("create_local", [](Conn& c) { return Actions(c.CreateLocal()); })
      .def("remote_info", [](Conn& c, uint32_t msg_qpn, uint32_t rma_qpn) {
        RcEndpointInfo e;
        e.msg_qpn = msg_qpn, e.rma_qpn = rma_qpn, e.mtu = 3;
        return Actions(c.RemoteInfo(e));
      })
      .def("fail", [](Conn& c, const std::string& why) { return Actions(c.Fail(why)); })
      .def("submit", &Conn::Submit)
      .def("take_parked", &Conn::TakeParked);
}
#endif

void RegisterFabricTesting(nb::module_& m) {
  nb::module_ t = nb::module_(m.attr("fabric")).def_submodule("_testing", "test hooks (not a public API)");
  t.def("imm_encode", [](uint32_t peer_id, uint32_t user) { return EncodeImm(peer_id, user); });
  t.def("imm_decode", [](uint32_t imm) { return std::make_pair(ImmPeerId(imm), ImmUser(imm)); });
  t.def("descriptor_serialize",
        [](uint64_t owner, uint64_t base, uint64_t size, uint32_t flags, std::vector<uint64_t> keys) {
          RegionDescriptor d;
          d.owner = owner, d.base = base, d.size = size, d.flags = flags, d.keys = keys;
          return B(d.Serialize());
        });
  t.def("descriptor_parse", [](nb::bytes b) {
    RegionDescriptor d = RegionDescriptor::Parse(S(b));
    nb::dict out;
    out["owner"] = d.owner, out["base"] = d.base, out["size"] = d.size, out["flags"] = d.flags, out["keys"] = d.keys;
    return out;
  });
  t.def("address_parse", [](nb::bytes b) {
    EngineAddress a = EngineAddress::Parse(S(b));
    nb::dict out;
    out["nonce"] = a.nonce;
    out["provider"] = a.provider;
    nb::list nics;
    for (const auto& n : a.nics) nics.append(B(n));
    out["nics"] = nics;
    return out;
  });

  // NIC choice by PCIe topology (nic_topology.h), against fake sysfs trees.
  t.def("normalize_pci_bus_id", &NormalizePciBusId, "bus_id"_a);
  t.def("pci_sysfs_path", &PciSysfsPath, "bus_id"_a, "sysfs_root"_a = "/sys");
  t.def("infiniband_sysfs_path", &InfinibandSysfsPath, "ibv_name"_a, "sysfs_root"_a = "/sys");
  t.def("rank_nics", &RankNics, "gpu_path"_a, "nic_paths"_a);
  t.def("nearest_nics_by_path", &NearestNics, "gpu_path"_a, "nic_paths"_a);
  t.def("nearest_nics", &NicsForGpu, "gpu_bus_id"_a, "nic_bus_ids"_a, "sysfs_root"_a = "/sys");
  t.def("order_nics_for_gpu", &OrderNicsForGpu, "who"_a, "gpu_bus_id"_a, "names"_a, "paths"_a, "opened"_a,
        "sysfs_root"_a = "/sys");
  t.def("parse_cpu_list", &ParseCpuList, "list"_a);
  t.def("pci_local_cpus", &PciLocalCpus, "bus_id"_a, "sysfs_root"_a = "/sys");
  t.def("pci_numa_node", &PciNumaNode, "bus_id"_a, "sysfs_root"_a = "/sys");
  // NumaMemory of `bytes` preferring `node`: (the node granted, the node that holds its first and its last page).
  t.def(
      "numa_memory_nodes",
      [](size_t bytes, int node) {
        NumaMemory m(bytes, node);
        const uint8_t* p = static_cast<const uint8_t*>(m.data());
        return std::make_tuple(m.node(), NumaNodeOf(p), NumaNodeOf(p + m.size() - 1));
      },
      "bytes"_a, "node"_a);

  nb::class_<ImmCounter>(t, "ImmCounter")
      .def(nb::init<>())
      .def("add", &ImmCounter::Add, "imm"_a, "peer"_a)
      .def("banked", &ImmCounter::Banked)
      .def("wait",
           [](ImmCounter& c, uint32_t imm, uint64_t count, double timeout_s) {
             std::map<uint32_t, uint64_t> seen;
             bool ok;
             {
               nb::gil_scoped_release nogil;
               ok = c.Wait(imm, count, Deadline::After(timeout_s), &seen);
             }
             return std::make_pair(ok, seen);
           })
      .def("wait_from", [](ImmCounter& c, uint32_t imm, std::vector<uint32_t> peers, double timeout_s) {
        std::vector<uint32_t> missing;
        bool ok;
        {
          nb::gil_scoped_release nogil;
          ok = c.WaitFrom(imm, peers, 1, Deadline::After(timeout_s), &missing);
        }
        return std::make_pair(ok, missing);
      });

#ifdef JAX_MOE_HAVE_IBVERBS
  RegisterVerbsHooks(t);
  t.attr("HAVE_VERBS") = true;
#else
  t.attr("HAVE_VERBS") = false;
#endif
}

}  // namespace
}  // namespace jax_moe::py

JAX_MOE_PY_REGISTER(fabric_testing, jax_moe::py::RegisterFabricTesting);
