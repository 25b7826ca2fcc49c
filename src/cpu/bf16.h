// bfloat16 <-> float32 on the host, rounding to nearest even like XLA's convert.
#pragma once
#include <cstdint>
#include <cstring>

namespace jax_moe::cpu {

inline float Bf16ToFloat(uint16_t v) {
  const uint32_t bits = uint32_t(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7f800000u) == 0x7f800000u && (bits & 0x007fffffu)) return uint16_t((bits >> 16) | 0x40);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return uint16_t(bits >> 16);
}

}  // namespace jax_moe::cpu
