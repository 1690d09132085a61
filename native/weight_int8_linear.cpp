// vattn::weight_int8_linear: x @ weight.T (+ bias) with int8 weights in groups of 32 inputs,
// one float32 scale per group (llama.cpp's Q8_0 layout, with a wider scale), and float32
// activations: weight-only quantization, so the answers stay those of the float model.
//
// Decoding is bound by the bytes of weights read, so the few-row path reads each int8
// weight once per block of rows, widens it to float in registers (scale applied there)
// and multiplies in float32: a quarter of fp32's bytes and no rounding of the activations.
// It has an AVX-512 and an AVX2 body, both compiled into every build and chosen per call
// (`avx512`, from the CPU's flags or ATEN_CPU_CAPABILITY): a machine without AVX-512 never
// runs an instruction it lacks. Many rows (prefill) are compute-bound instead: tiles of
// weights are widened into a per-thread buffer and multiplied by torch's float GEMM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 warns that _mm512_cvtepi8_epi32's internal _mm512_undefined_epi32() "may be used
// uninitialized" (a false positive: the mask selects every lane).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace {

constexpr int64_t kGroup = 32;     // inputs per scale
constexpr int64_t kFewRows = 64;   // up to this many rows: the register kernel; more: tiles + GEMM
constexpr int64_t kTile = 128;     // at most this many outputs widened at a time on the GEMM path

struct Problem {
  const float* x;         // [m, in]
  const int8_t* weight;   // [out, in]
  const float* scales;    // [out, in / kGroup]
  const float* bias;      // [out] or null
  float* y;               // [m, out]
  int64_t m, in, out;
};

template <int64_t R>
void rows_scalar(const Problem& p, int64_t row, int64_t n) {
  const int8_t* w = p.weight + n * p.in;
  const float* s = p.scales + n * (p.in / kGroup);
  float acc[R] = {};
  for (int64_t g = 0; g < p.in / kGroup; ++g) {
    float part[R] = {};
    for (int64_t k = g * kGroup; k < (g + 1) * kGroup; ++k)
      for (int64_t r = 0; r < R; ++r) part[r] += static_cast<float>(w[k]) * p.x[(row + r) * p.in + k];
    for (int64_t r = 0; r < R; ++r) acc[r] += part[r] * s[g];
  }
  for (int64_t r = 0; r < R; ++r) p.y[(row + r) * p.out + n] = acc[r] + (p.bias ? p.bias[n] : 0.0f);
}

#if defined(__x86_64__)
template <int64_t R>
__attribute__((target("avx512f,avx512bw"))) void rows_avx512(const Problem& p, int64_t row, int64_t n) {
  const int8_t* w = p.weight + n * p.in;
  const float* s = p.scales + n * (p.in / kGroup);
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0, k = 0; k < p.in; ++g, k += kGroup) {
    const __m512 scale = _mm512_set1_ps(s[g]);
    const __m512 lo = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k)))), scale);
    const __m512 hi = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + k + 16)))),
        scale);
    for (int64_t r = 0; r < R; ++r) {
      const float* x = p.x + (row + r) * p.in + k;
      acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x), acc[r]);
      acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) p.y[(row + r) * p.out + n] = _mm512_reduce_add_ps(acc[r]) + (p.bias ? p.bias[n] : 0.0f);
}

__attribute__((target("avx2,fma"))) inline __m256 widen8(const int8_t* w) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w))));
}

__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

template <int64_t R>
__attribute__((target("avx2,fma"))) void rows_avx2(const Problem& p, int64_t row, int64_t n) {
  const int8_t* w = p.weight + n * p.in;
  const float* s = p.scales + n * (p.in / kGroup);
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0, k = 0; k < p.in; ++g, k += kGroup) {
    const __m256 scale = _mm256_set1_ps(s[g]);
    __m256 ws[4];
    for (int64_t j = 0; j < 4; ++j) ws[j] = _mm256_mul_ps(widen8(w + k + 8 * j), scale);
    for (int64_t r = 0; r < R; ++r) {
      const float* x = p.x + (row + r) * p.in + k;
      for (int64_t j = 0; j < 4; ++j) acc[r] = _mm256_fmadd_ps(ws[j], _mm256_loadu_ps(x + 8 * j), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) p.y[(row + r) * p.out + n] = sum8(acc[r]) + (p.bias ? p.bias[n] : 0.0f);
}
#endif

enum class Isa { kScalar, kAvx2, kAvx512 };

template <int64_t R>
void rows(const Problem& p, int64_t row, int64_t n, Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return rows_avx512<R>(p, row, n);
  if (isa == Isa::kAvx2) return rows_avx2<R>(p, row, n);
#endif
  rows_scalar<R>(p, row, n);
}

template <int64_t Block>
void rows_left(const Problem& p, int64_t row, int64_t n, Isa isa) {
  if constexpr (Block > 0) {
    if (p.m - row == Block) return rows<Block>(p, row, n, isa);
    rows_left<Block - 1>(p, row, n, isa);
  }
}

template <int64_t Block>
void blocks_of_rows(const Problem& p, Isa isa) {
  // Outputs split over threads; within a thread's outputs, every block of rows reuses the
  // same weights (hot in L1) before the next. `Block` rows share each widened weight.
  at::parallel_for(0, p.out, 16, [&](int64_t begin, int64_t end) {
    int64_t row = 0;
    for (; row + Block <= p.m; row += Block)
      for (int64_t n = begin; n < end; ++n) rows<Block>(p, row, n, isa);
    if (row < p.m)
      for (int64_t n = begin; n < end; ++n) rows_left<Block - 1>(p, row, n, isa);
  });
}

void few_rows(const Problem& p, Isa isa) {
  // AVX-512 has 32 vector registers: 8 rows' sums beside the widened weights; AVX2 has 16.
  if (isa == Isa::kAvx512) return blocks_of_rows<8>(p, isa);
  blocks_of_rows<8>(p, isa);
}

void many_rows(const Problem& p, const at::Tensor& x_rows) {
  // As many tiles for every thread, each a multiple of 16 outputs and at most kTile.
  const int64_t threads = at::get_num_threads(), groups = p.in / kGroup;
  const int64_t balanced = threads * ((p.out + threads * kTile - 1) / (threads * kTile));
  const int64_t tile = ((p.out + balanced - 1) / balanced + 15) / 16 * 16;
  const int64_t tiles = (p.out + tile - 1) / tile;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::Tensor wide = at::empty({tile, p.in}, x_rows.options());
    float* dst = wide.mutable_data_ptr<float>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * tile, count = std::min(tile, p.out - first);
      for (int64_t n = 0; n < count; ++n)
        for (int64_t g = 0; g < groups; ++g) {
          const float scale = p.scales[(first + n) * groups + g];
          const int8_t* w = p.weight + (first + n) * p.in + g * kGroup;
          for (int64_t k = 0; k < kGroup; ++k) dst[n * p.in + g * kGroup + k] = static_cast<float>(w[k]) * scale;
        }
      const at::Tensor part = at::mm(x_rows, wide.narrow(0, 0, count).t());  // [m, count], one thread
      const float* src = part.const_data_ptr<float>();
      for (int64_t r = 0; r < p.m; ++r)
        for (int64_t n = 0; n < count; ++n)
          p.y[r * p.out + first + n] = src[r * count + n] + (p.bias ? p.bias[first + n] : 0.0f);
    }
  });
}

at::Tensor weight_int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                              const std::optional<at::Tensor>& bias, bool avx512, bool avx2) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "weight must be contiguous int8 [out, in]");
  const int64_t out = weight.size(0), in = weight.size(1);
  TORCH_CHECK(in % kGroup == 0, "weight's inputs must be a multiple of ", kGroup, ", got ", in);
  TORCH_CHECK(x.size(-1) == in, "x's last dimension must match weight's inputs");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.numel() == out * (in / kGroup),
              "scales must be contiguous float32 [out, in / 32]");
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == out && bias->is_contiguous()),
              "bias must be float32 [out]");
#if defined(__x86_64__)
  TORCH_CHECK(!avx512 || __builtin_cpu_supports("avx512bw"), "this CPU has no AVX-512: call with avx512=False");
  TORCH_CHECK(!avx2 || (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")),
              "this CPU has no AVX2: call with avx2=False");
#else
  TORCH_CHECK(!avx512 && !avx2, "AVX kernels exist only on x86-64");
#endif
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  at::Tensor result = at::empty({rows.size(0), out}, rows.options());
  const Problem p{rows.const_data_ptr<float>(), weight.const_data_ptr<int8_t>(), scales.const_data_ptr<float>(),
                  bias ? bias->const_data_ptr<float>() : nullptr, result.mutable_data_ptr<float>(), rows.size(0),
                  in, out};
  if (p.m > kFewRows)
    many_rows(p, rows);
  else if (p.m > 0)
    few_rows(p, avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kScalar);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return result.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) {
  m.def(
      "weight_int8_linear(Tensor x, Tensor weight, Tensor scales, Tensor? bias, bool avx512, bool avx2) -> Tensor");
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("weight_int8_linear", &weight_int8_linear); }
