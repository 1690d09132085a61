// vattn::grouped_linear: x @ W.T (+ bias) with W quantized in groups of 32 inputs, activations
// in float32 (weight-only quantization: the answers stay those of the weights as stored).
//
//   bits 8 (llama.cpp's Q8_0 layout): 32 int8 per group,            w = scale * q
//   bits 4 (Q4_1; Q4_0 with min = -8 * scale): 16 bytes per group,  w = scale * q + min,
//          q in 0..15, byte j holding input j in its low nibble and input j + 16 in its high one
//
// Decoding is bound by the bytes of weights read, so the few-row path reads each weight once
// per block of 8 rows, widens it to float in registers and multiplies in float32. It has an
// AVX-512 and an AVX2 body, both compiled into every build and chosen per call (from the CPU's
// flags or ATEN_CPU_CAPABILITY, by the caller; one the CPU lacks is refused): a machine
// without AVX-512 never runs an instruction it lacks. Many rows (prefill) are compute-bound
// instead: balanced tiles of weights are widened into a per-thread buffer and multiplied by
// torch's GEMM, in float32, or with `bf16_many_rows` in bfloat16 (float accumulation, outputs
// rounded to bfloat16: about 4x float32's speed where the CPU has AVX512_BF16).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 warns that the AVX-512 intrinsics' internal _mm512_undefined_*() "is" or "may be" used
// uninitialized (a false positive: the mask selects every lane).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

constexpr int64_t kGroup = 32;     // inputs per scale
constexpr int64_t kFewRows = 64;   // up to this many rows: the register kernel; more: tiles + GEMM
constexpr int64_t kTile = 128;     // at most this many outputs widened at a time on the GEMM path

struct Problem {
  const float* x;         // [m, in]
  const uint8_t* weight;  // [out, groups * Format::kBytes]
  const float* scales;    // [out, groups]
  const float* mins;      // [out, groups] (4-bit) or null
  const float* bias;      // [out] or null
  float* y;               // [m, out]
  int64_t m, in, out;
  int64_t groups() const { return in / kGroup; }
};

struct Int8 {
  static constexpr int64_t kBytes = 32;
  static float value(const uint8_t* group, int64_t k) { return static_cast<float>(static_cast<int8_t>(group[k])); }
#if defined(__x86_64__)
  __attribute__((target("avx512f,avx512bw"))) static __m512 widen16(const uint8_t* group, int64_t half) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group + 16 * half));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
  }
  __attribute__((target("avx2,fma"))) static __m256 widen8(const uint8_t* group, int64_t quarter) {
    const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 8 * quarter));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
  }
#endif
};

struct Nibbles {
  static constexpr int64_t kBytes = 16;
  static float value(const uint8_t* group, int64_t k) {
    return static_cast<float>(k < 16 ? group[k] & 0x0F : group[k - 16] >> 4);
  }
#if defined(__x86_64__)
  __attribute__((target("avx512f,avx512bw"))) static __m512 widen16(const uint8_t* group, int64_t half) {
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(group));
    if (half) bytes = _mm_srli_epi16(bytes, 4);
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, _mm_set1_epi8(0x0F))));
  }
  __attribute__((target("avx2,fma"))) static __m256 widen8(const uint8_t* group, int64_t quarter) {
    __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(group + 8 * (quarter % 2)));
    if (quarter >= 2) bytes = _mm_srli_epi16(bytes, 4);
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_and_si128(bytes, _mm_set1_epi8(0x0F))));
  }
#endif
};

template <class Format>
float weight_at(const Problem& p, int64_t n, int64_t g, int64_t k) {
  const float q = Format::value(p.weight + (n * p.groups() + g) * Format::kBytes, k);
  const int64_t at = n * p.groups() + g;
  return p.mins ? q * p.scales[at] + p.mins[at] : q * p.scales[at];
}

float bias_at(const Problem& p, int64_t n) { return p.bias ? p.bias[n] : 0.0f; }

template <class Format, int64_t R>
void rows_scalar(const Problem& p, int64_t row, int64_t n) {
  float acc[R] = {};
  for (int64_t g = 0; g < p.groups(); ++g)
    for (int64_t k = 0; k < kGroup; ++k) {
      const float w = weight_at<Format>(p, n, g, k);
      for (int64_t r = 0; r < R; ++r) acc[r] += w * p.x[(row + r) * p.in + g * kGroup + k];
    }
  for (int64_t r = 0; r < R; ++r) p.y[(row + r) * p.out + n] = acc[r] + bias_at(p, n);
}

#if defined(__x86_64__)
template <class Format, int64_t R>
__attribute__((target("avx512f,avx512bw"))) void rows_avx512(const Problem& p, int64_t row, int64_t n) {
  __m512 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups(); ++g) {
    const int64_t at = n * p.groups() + g;
    const uint8_t* group = p.weight + at * Format::kBytes;
    const __m512 scale = _mm512_set1_ps(p.scales[at]), min = _mm512_set1_ps(p.mins ? p.mins[at] : 0.0f);
    __m512 w[2];
    for (int64_t h = 0; h < 2; ++h) w[h] = _mm512_fmadd_ps(Format::widen16(group, h), scale, min);
    for (int64_t r = 0; r < R; ++r) {
      const float* x = p.x + (row + r) * p.in + g * kGroup;
      for (int64_t h = 0; h < 2; ++h) acc[r] = _mm512_fmadd_ps(w[h], _mm512_loadu_ps(x + 16 * h), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) p.y[(row + r) * p.out + n] = _mm512_reduce_add_ps(acc[r]) + bias_at(p, n);
}

__attribute__((target("avx2,fma"))) inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
}

template <class Format, int64_t R>
__attribute__((target("avx2,fma"))) void rows_avx2(const Problem& p, int64_t row, int64_t n) {
  __m256 acc[R];
  for (int64_t r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups(); ++g) {
    const int64_t at = n * p.groups() + g;
    const uint8_t* group = p.weight + at * Format::kBytes;
    const __m256 scale = _mm256_set1_ps(p.scales[at]), min = _mm256_set1_ps(p.mins ? p.mins[at] : 0.0f);
    __m256 w[4];
    for (int64_t j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(Format::widen8(group, j), scale, min);
    for (int64_t r = 0; r < R; ++r) {
      const float* x = p.x + (row + r) * p.in + g * kGroup;
      for (int64_t j = 0; j < 4; ++j) acc[r] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + 8 * j), acc[r]);
    }
  }
  for (int64_t r = 0; r < R; ++r) p.y[(row + r) * p.out + n] = sum8(acc[r]) + bias_at(p, n);
}
#endif

enum class Isa { kScalar, kAvx2, kAvx512 };

template <class Format, int64_t R>
void rows(const Problem& p, int64_t row, int64_t n, Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::kAvx512) return rows_avx512<Format, R>(p, row, n);
  if (isa == Isa::kAvx2) return rows_avx2<Format, R>(p, row, n);
#endif
  rows_scalar<Format, R>(p, row, n);
}

template <class Format, int64_t Block>
void rows_left(const Problem& p, int64_t row, int64_t n, Isa isa) {
  if constexpr (Block > 0) {
    if (p.m - row == Block) return rows<Format, Block>(p, row, n, isa);
    rows_left<Format, Block - 1>(p, row, n, isa);
  }
}

template <class Format>
void few_rows(const Problem& p, Isa isa) {
  // Outputs split over threads; within a thread's outputs, every block of 8 rows reuses the
  // same weights (hot in L1) before the next. 8 rows' sums and the widened weights fit both
  // AVX-512's 32 vector registers and AVX2's 16.
  constexpr int64_t kBlock = 8;
  at::parallel_for(0, p.out, 16, [&](int64_t begin, int64_t end) {
    int64_t row = 0;
    for (; row + kBlock <= p.m; row += kBlock)
      for (int64_t n = begin; n < end; ++n) rows<Format, kBlock>(p, row, n, isa);
    if (row < p.m)
      for (int64_t n = begin; n < end; ++n) rows_left<Format, kBlock - 1>(p, row, n, isa);
  });
}

template <class Format>
void many_rows(const Problem& p, const at::Tensor& x_rows, bool bf16) {
  // As many tiles for every thread, each a multiple of 16 outputs and at most kTile.
  const int64_t threads = at::get_num_threads();
  const int64_t balanced = threads * ((p.out + threads * kTile - 1) / (threads * kTile));
  const int64_t tile = ((p.out + balanced - 1) / balanced + 15) / 16 * 16;
  const int64_t tiles = (p.out + tile - 1) / tile;
  const at::Tensor x_gemm = bf16 ? x_rows.to(at::kBFloat16) : x_rows;
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::Tensor wide = at::empty({tile, p.in}, x_rows.options());
    float* dst = wide.mutable_data_ptr<float>();
    for (int64_t t = begin; t < end; ++t) {
      const int64_t first = t * tile, count = std::min(tile, p.out - first);
      for (int64_t n = 0; n < count; ++n)
        for (int64_t g = 0; g < p.groups(); ++g)
          for (int64_t k = 0; k < kGroup; ++k) dst[n * p.in + g * kGroup + k] = weight_at<Format>(p, first + n, g, k);
      const at::Tensor tile_weights = wide.narrow(0, 0, count);
      const at::Tensor part = bf16 ? at::mm(x_gemm, tile_weights.to(at::kBFloat16).t()).to(at::kFloat)
                                   : at::mm(x_gemm, tile_weights.t());  // [m, count], one thread
      const float* src = part.const_data_ptr<float>();
      for (int64_t r = 0; r < p.m; ++r)
        for (int64_t n = 0; n < count; ++n) p.y[r * p.out + first + n] = src[r * count + n] + bias_at(p, first + n);
    }
  });
}

template <class Format>
void run(const Problem& p, const at::Tensor& x_rows, Isa isa, bool bf16) {
  if (p.m > kFewRows)
    many_rows<Format>(p, x_rows, bf16);
  else if (p.m > 0)
    few_rows<Format>(p, isa);
}

at::Tensor grouped_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
                          bool avx512, bool avx2, bool bf16_many_rows) {
  TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4, got ", bits);
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "x must be a float32 CPU tensor");
  TORCH_CHECK(scales.dim() == 2 && scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "scales must be contiguous float32 [out, groups]");
  const int64_t out = scales.size(0), groups = scales.size(1), in = groups * kGroup;
  const int64_t bytes = bits == 8 ? Int8::kBytes : Nibbles::kBytes;
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == out && weight.size(1) == groups * bytes && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kByte || weight.scalar_type() == at::kChar),
              "weight must be contiguous uint8/int8 [out, groups * ", bytes, "]");
  TORCH_CHECK(bits == 4 || !mins, "mins belong to 4-bit weights only");
  TORCH_CHECK(!mins || (mins->scalar_type() == at::kFloat && mins->is_contiguous() && mins->sizes() == scales.sizes()),
              "mins must be contiguous float32 [out, groups]");
  TORCH_CHECK(x.size(-1) == in, "x's last dimension must be the weight's ", in, " inputs, got ", x.size(-1));
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
  const Problem p{rows.const_data_ptr<float>(),
                  static_cast<const uint8_t*>(weight.const_data_ptr()),
                  scales.const_data_ptr<float>(),
                  mins ? mins->const_data_ptr<float>() : nullptr,
                  bias ? bias->const_data_ptr<float>() : nullptr,
                  result.mutable_data_ptr<float>(),
                  rows.size(0),
                  in,
                  out};
  const Isa isa = avx512 ? Isa::kAvx512 : avx2 ? Isa::kAvx2 : Isa::kScalar;
  if (bits == 8)
    run<Int8>(p, rows, isa, bf16_many_rows);
  else
    run<Nibbles>(p, rows, isa, bf16_many_rows);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return result.view(shape);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) {
  m.def(
      "grouped_linear(Tensor x, Tensor weight, Tensor scales, Tensor? mins, Tensor? bias, int bits, bool avx512, "
      "bool avx2, bool bf16_many_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("grouped_linear", &grouped_linear); }
