// vattn::silu_and_mul: a gated MLP's activation, silu(gate) * up, over the fused gate/up
// projection's output ([rows, 2 x width], gate first) in one pass, as vLLM's silu_and_mul.
// torch runs it as two operators with a [rows, width] temporary between them, at about 0.8 ms
// for a 2,000-token bf16 prompt step of the default model, 4% of an offline run.
//
// Numerics follow the two operators: silu in float32, rounded to the dtype, then the product
// in float32, rounded. exp is Cephes' (fast_exp.h, ~1e-7 relative) where torch's is Sleef's.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's false positive on the intrinsics' internal _mm256_undefined_si256() (ragged_attention.cpp's too).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#include "fast_exp.h"
#include "narrow_floats.h"
#include "widest_simd.h"

namespace {

// One row, one float at a time: the scalar and AVX2 bodies (the build's baseline ISA), which
// GCC vectorizes.
template <typename T>
void activate_row(const T* gate, const T* up, T* dst, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) {
    const float x = widen(gate[i]);
    const float silu = widen(narrow<T>(x / (1.0f + fast_exp(-x))));
    dst[i] = narrow<T>(silu * widen(up[i]));
  }
}

#if defined(__x86_64__)
// The AVX-512 body in intrinsics, 16 values a vector, at about half the instructions GCC made of
// the loop above (its clamps and selects; fast_exp16 has scalef for them): 0.77x its time for a
// 1,941-row bf16 prompt step on an AMX Xeon, 2 threads. The same numerics: exp to ~1e-7 (its sums
// fused), silu rounded to T; bf16 equal to torch's two operators on 6.3M random values.
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
AVX512_TARGET inline __m512 load16(const float* p, __mmask16 live) { return _mm512_maskz_loadu_ps(live, p); }
AVX512_TARGET inline __m512 load16(const c10::BFloat16* p, __mmask16 live) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(live, p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
// x's bf16 rounding (to nearest even) in 32-bit lanes. A NaN stays a NaN: every NaN here comes
// from bf16 values or arithmetic, so its low 16 bits are zero and the rounding cannot carry.
AVX512_TARGET inline __m512i round_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  return _mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7FFF)), odd);
}
AVX512_TARGET inline __m512 to_precision(__m512 x, float) { return x; }
AVX512_TARGET inline __m512 to_precision(__m512 x, c10::BFloat16) {
  return _mm512_castsi512_ps(_mm512_and_si512(round_bf16(x), _mm512_set1_epi32(static_cast<int>(0xFFFF0000u))));
}
AVX512_TARGET inline void store16(float* p, __mmask16 live, __m512 x) { _mm512_mask_storeu_ps(p, live, x); }
AVX512_TARGET inline void store16(c10::BFloat16* p, __mmask16 live, __m512 x) {
  _mm256_mask_storeu_epi16(p, live, _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bf16(x), 16)));
}

template <typename T>
AVX512_TARGET void activate_row_avx512(const T* gate, const T* up, T* dst, int64_t width) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t i = 0; i < width; i += 16) {
    const __mmask16 live = width - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (width - i)) - 1);
    const __m512 x = load16(gate + i, live);
    const __m512 e = fast_exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 silu = to_precision(_mm512_div_ps(x, _mm512_add_ps(one, e)), T{});
    store16(dst + i, live, _mm512_mul_ps(silu, load16(up + i, live)));
  }
}
#undef AVX512_TARGET
#endif

template <typename T>
void activate(const T* gate_up, int64_t stride, T* out, int64_t rows, int64_t width) {
  auto row = activate_row<T>;
#if defined(__x86_64__)
  if (widest_simd() == "avx512") row = activate_row_avx512<T>;
#endif
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / width), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) row(gate_up + r * stride, gate_up + r * stride + width, out + r * width, width);
  });
}

at::Tensor silu_and_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "gate_up must be a CPU [rows, 2 x width] tensor, rows dense");
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  // No float16: its conversions are calls GCC does not vectorize (14x slower than torch's).
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "silu_and_mul", AT_DISPATCH_CASE(at::kFloat, [&] {
                       activate<scalar_t>(gate_up.const_data_ptr<scalar_t>(), gate_up.stride(0),
                                          out.mutable_data_ptr<scalar_t>(), rows, width);
                     }) AT_DISPATCH_CASE(at::kBFloat16, [&] {
                       activate<scalar_t>(gate_up.const_data_ptr<scalar_t>(), gate_up.stride(0),
                                          out.mutable_data_ptr<scalar_t>(), rows, width);
                     }));
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) { m.def("silu_and_mul(Tensor gate_up) -> Tensor"); }

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("silu_and_mul", &silu_and_mul); }
