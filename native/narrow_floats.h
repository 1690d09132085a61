// Float32 <-> 16-bit floats one element at a time, written so that loops over them
// vectorize: c10::BFloat16's own conversions are scalar calls (a branch on NaN), which made
// the bfloat16 rotary embedding and RMSNorm ~20x slower than their float32 versions.
// bfloat16 rounds to nearest even and keeps a NaN a NaN, exactly as torch's conversion does.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <bit>
#include <cstdint>

inline float widen(float x) { return x; }
inline float widen(c10::Half x) { return static_cast<float>(x); }
inline float widen(c10::BFloat16 x) { return std::bit_cast<float>(static_cast<uint32_t>(x.x) << 16); }

template <typename T>
inline T narrow(float x) {
  return static_cast<T>(x);
}

template <>
inline c10::BFloat16 narrow<c10::BFloat16>(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const auto rounded = static_cast<uint16_t>((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
  const bool nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  return c10::BFloat16(nan ? static_cast<uint16_t>(0x7FC0) : rounded, c10::BFloat16::from_bits());
}
