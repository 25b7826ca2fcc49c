// printf-style formatting into std::string. The library never uses iostreams: on some systems (Ubuntu 24.04 with
// jaxlib 0.11) formatting a number through std::ostream in our extension crashed the process inside libstdc++'s
// locale facets, and an error path must never take the user's process down.
#pragma once
#include <string>

namespace jax_moe {

std::string Format(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace jax_moe
