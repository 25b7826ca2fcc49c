// `jax_moe._core.fabric._testing`: hooks for unit tests of the device-independent fabric logic.
#include <nanobind/nanobind.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include "common/deadline.h"
#include "fabric/descriptor.h"
#include "fabric/imm.h"
#include "fabric/imm_counter.h"
#include "fabric/wire.h"
#include "python/registry.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace jax_moe::py {
namespace {

using namespace jax_moe::fabric;

nb::bytes B(const std::string& s) { return nb::bytes(s.data(), s.size()); }
std::string S(const nb::bytes& b) { return std::string(b.c_str(), b.size()); }

void RegisterFabricTesting(nb::module_& m) {
  nb::module_ t = nb::module_(m.attr("fabric")).def_submodule("_testing", "test hooks (not a public API)");
  t.def("imm_encode", [](uint32_t slot, uint32_t user) { return EncodeImm(slot, user); });
  t.def("imm_decode", [](uint32_t imm) { return std::make_pair(ImmSlot(imm), ImmUser(imm)); });
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

  t.attr("HAVE_VERBS") = false;
}

}  // namespace
}  // namespace jax_moe::py

JAX_MOE_PY_REGISTER(fabric_testing, jax_moe::py::RegisterFabricTesting);
