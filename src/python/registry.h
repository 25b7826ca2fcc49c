// Binding files register their part of `jax_moe._core` here, so adding a binding never touches the module.
#pragma once
#include <nanobind/nanobind.h>

#include <string>
#include <utility>
#include <vector>

namespace jax_moe::py {

using RegisterFn = void (*)(nanobind::module_&);

// Registration order follows the name, so the module layout does not depend on link order.
std::vector<std::pair<std::string, RegisterFn>>& Registry();

struct Registrar {
  Registrar(const char* name, RegisterFn fn) { Registry().emplace_back(name, fn); }
};

}  // namespace jax_moe::py

#define JAX_MOE_PY_REGISTER(name, fn) static ::jax_moe::py::Registrar jax_moe_registrar_##name(#name, fn)
