// Minimal leveled logging to stderr. Level from JAX_MOE_LOG (error|warn|info|debug; default warn).
#pragma once
#include <sstream>

namespace jax_moe {

enum class LogLevel { kError = 0, kWarn = 1, kInfo = 2, kDebug = 3 };

bool LogEnabled(LogLevel level);
void LogWrite(LogLevel level, const char* file, int line, const std::string& message);

}  // namespace jax_moe

#define JAX_MOE_LOG(level, expr)                                                        \
  do {                                                                                  \
    if (::jax_moe::LogEnabled(::jax_moe::LogLevel::level)) {                            \
      std::ostringstream jax_moe_log_os_;                                               \
      jax_moe_log_os_ << expr;                                                          \
      ::jax_moe::LogWrite(::jax_moe::LogLevel::level, __FILE__, __LINE__, jax_moe_log_os_.str()); \
    }                                                                                   \
  } while (0)
