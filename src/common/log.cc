#include "common/log.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>

namespace jax_moe {
namespace {

LogLevel ParseLevel() {
  const char* env = std::getenv("JAX_MOE_LOG");
  if (env == nullptr) return LogLevel::kWarn;
  if (!std::strcmp(env, "error")) return LogLevel::kError;
  if (!std::strcmp(env, "info")) return LogLevel::kInfo;
  if (!std::strcmp(env, "debug")) return LogLevel::kDebug;
  return LogLevel::kWarn;
}

}  // namespace

bool LogEnabled(LogLevel level) {
  static const LogLevel threshold = ParseLevel();
  return static_cast<int>(level) <= static_cast<int>(threshold);
}

void LogWrite(LogLevel level, const char* file, int line, const std::string& message) {
  static std::mutex mu;
  static const char* names[] = {"E", "W", "I", "D"};
  const char* base = std::strrchr(file, '/');
  std::lock_guard<std::mutex> lock(mu);
  std::fprintf(stderr, "[jax_moe %s %s:%d] %s\n", names[static_cast<int>(level)], base ? base + 1 : file, line,
               message.c_str());
}

}  // namespace jax_moe
