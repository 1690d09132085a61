// Cephes' expf: e^x = 2^k * e^r with |r| <= ln2/2 and a degree-5 polynomial for e^r (about
// 1e-7 relative error). The attention kernel's SIMD bodies evaluate it with intrinsics
// (attention_avx2.h, attention_avx512.h); `fast_exp` is the same sum written one float at a time, branch-free, so
// that loops over it vectorize at the build's baseline ISA.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

// x at or below -87 gives e^-87 (1.6e-38); above 88.72, where e^x leaves float's range, infinity.
// k is rounded by adding and taking away 1.5 x 2^23 (nearbyint is a call GCC will not vectorize).
inline float fast_exp(float x) {
  const float low = x < -87.0f ? -87.0f : x;
  const float clamped = low > 88.0f ? 88.0f : low;
  const float k = (clamped * kLog2e + 12582912.0f) - 12582912.0f;
  const float r = (clamped - k * kLn2High) - k * kLn2Low;
  float y = ((((kExpPoly[0] * r + kExpPoly[1]) * r + kExpPoly[2]) * r + kExpPoly[3]) * r + kExpPoly[4]) * r + kExpPoly[5];
  y = y * (r * r) + (r + 1.0f);
  const float e = y * std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
  return x > 88.72f ? INFINITY : e;
}

#if defined(__x86_64__)
// The same on 16 floats at once (AVX-512; the kernels' AVX-512 bodies).
__attribute__((target("avx512f,avx2,fma"))) inline __m512 fast_exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT);
  x = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x);
  x = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Low), x);
  __m512 y = _mm512_set1_ps(kExpPoly[0]);
  for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, k);
}
#endif
