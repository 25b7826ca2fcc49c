// The `jax_moe._core` module: build information, then every registered binding.
#include <algorithm>

#include "python/registry.h"

namespace nb = nanobind;

namespace jax_moe::py {

std::vector<std::pair<std::string, RegisterFn>>& Registry() {
  static std::vector<std::pair<std::string, RegisterFn>> registry;
  return registry;
}

}  // namespace jax_moe::py

namespace {

nb::dict BuildInfo() {
  nb::dict info;
#ifdef JAX_MOE_HAVE_LIBFABRIC
  info["libfabric"] = JAX_MOE_LIBFABRIC_VERSION;
#else
  info["libfabric"] = nb::none();
#endif
#ifdef JAX_MOE_HAVE_IBVERBS
  info["ibverbs"] = JAX_MOE_IBVERBS_VERSION;
#else
  info["ibverbs"] = nb::none();
#endif
#ifdef JAX_MOE_HAVE_CUDA
  info["cuda_archs"] = JAX_MOE_CUDA_ARCHS;
#else
  info["cuda_archs"] = nb::none();
#endif
  nb::list parts;
  for (const auto& entry : jax_moe::py::Registry()) parts.append(nb::str(entry.first.c_str()));
  info["bindings"] = parts;
  return info;
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "jax_moe native extension";
  auto& registry = jax_moe::py::Registry();
  std::sort(registry.begin(), registry.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  for (const auto& entry : registry) entry.second(m);
  m.def("build_info", &BuildInfo, "What this build of jax_moe._core includes.");
}
