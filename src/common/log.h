// Minimal leveled logging to stderr. Level from JAX_MOE_LOG (error|warn|info|debug; default warn).
// printf-style (see format.h for why there are no iostreams).
#pragma once
#include <string>

#include "common/format.h"

namespace jax_moe {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void LogWrite(LogLevel level, const char* file, int line, const std::string& message);

}  // namespace jax_moe

#define JAX_MOE_LOG(level, ...)                                                                  \
  do {                                                                                           \
    if (::jax_moe::LogEnabled(::jax_moe::LogLevel::level))                                       \
      ::jax_moe::LogWrite(::jax_moe::LogLevel::level, __FILE__, __LINE__, ::jax_moe::Format(__VA_ARGS__)); \
  } while (0)
