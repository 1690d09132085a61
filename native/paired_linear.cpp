// vattn::paired_linear: grouped_linear's weights (8-bit, or 4-bit with mins, in groups of 32
// inputs) multiplied in 16-bit integers, on AVX-512 VNNI or AVX2.
//
// Decoding a batch of requests is compute-bound once weights are widened to float32 in
// registers (~270 GFLOP/s here, against oneDNN's fp32 ~400). VNNI's vpdpwssd does 32
// multiply-adds of int16 pairs per instruction, twice a float32 FMA's 16, and int16 holds an
// int8 or 4-bit weight exactly. So each row's activations are quantized per group of 32 to
// int16 (one float scale per group: the largest magnitude maps to 32767, an error of at most
// 1/65534 of it, well under bfloat16's rounding), each group's dot products are summed in
// int32, and scaled to float once per group:
//
//   y[r, n] = sum_g  sa[r, g] * (d[n, g] * sum_k qa[r, k] * qw[n, k]  +  m[n, g] * sum_k qa[r, k])
//
// with w = d * qw + m (m = 0 for 8-bit weights). The kernel keeps 16 outputs per vector: the
// weights are stored paired (serving.linear.PairedWeight), for each tile of 16 outputs and each
// group, input pair by input pair, the 16 outputs' two inputs side by side; widened to int16
// they are one vector, and each row's pair of activations is broadcast against it. No
// horizontal sums, and the per-group scaling costs 2-3 instructions per 16 outputs and row,
// against 16 multiply-adds.
//
// AVX2 has no vpdpwssd: vpmaddwd sums each pair's two products in int32 and an add accumulates
// them, 8 outputs a vector (a tile in two halves). That is float32 FMA's rate of multiply-adds,
// but a weight costs one widening instruction per 16 products instead of three per 8 (widen,
// convert, scale) in grouped_linear. Both bodies are compiled into every build and chosen per
// call by the caller (from the CPU's flags or ATEN_CPU_CAPABILITY; one the CPU lacks is refused).
#include <ATen/core/Tensor.h>
#include <ATen/ops/dot.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>
#include <vector>

#include "paired_weight.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 warns that the AVX-512 intrinsics' internal _mm512_undefined_*() "is" or "may be" used
// uninitialized (a false positive: the mask selects every lane).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

constexpr int64_t kGroup = 32;  // inputs per scale
constexpr int64_t kTile = 16;   // outputs per vector
constexpr int64_t kPairs = kGroup / 2;
constexpr int64_t kRows = 6;      // AVX-512 rows per block: 2 tiles x 2 x 6 accumulators stay in registers
constexpr int64_t kRowsAvx2 = 3;  // AVX2: 2 halves x 2 x 3 of its 16 registers (4 or 6 rows spill: 5-20% slower)

struct Problem {
  const int32_t* words;     // [m, groups, Format::kSteps]: each row's quantized activations, two int16 or four int8 per int32
  const float* row_scales;  // [m, groups]
  const float* row_sums;    // [m, groups]: scale * sum of the group's quantized activations
  const int32_t* offsets;   // [m, groups]: 128 * sum of the group's int8 activations (Int8Quads), or null
  const uint8_t* weight;    // [tiles, groups, Format::kSteps, Format::kBytes]
  const float* scales;      // [tiles, groups, kTile]
  const float* mins;        // [tiles, groups, kTile] (4-bit) or null
  const float* bias;        // [out] or null
  float* y;                 // [m, out]
  int64_t m, groups, out;
};

#if defined(__x86_64__)
#define VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))
#define AVX2 __attribute__((target("avx2,fma")))

// A weight format: kSteps activation words per group, each multiplied into a tile by one
// instruction (dot) against kBytes of weights (widened by widen).
struct Int8Pairs {
  static constexpr int64_t kSteps = kPairs;
  static constexpr int64_t kBytes = 2 * kTile;  // 16 outputs x 2 inputs, int8
  static constexpr bool kMins = false, kOffset = false;
  VNNI static __m512i widen(const uint8_t* pair) {
    return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(pair)));
  }
  VNNI static __m512i dot(__m512i sum, __m512i activations, __m512i weights) {
    return _mm512_dpwssd_epi32(sum, activations, weights);
  }
  AVX2 static __m256i widen_half(const uint8_t* pair, int64_t half) {
    return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + kTile * half)));
  }
};

struct NibblePairs {
  static constexpr int64_t kSteps = kPairs;
  static constexpr int64_t kBytes = kTile;  // 16 outputs, one byte each: first input low, second high
  static constexpr bool kMins = true, kOffset = false;
  VNNI static __m512i dot(__m512i sum, __m512i activations, __m512i weights) {
    return _mm512_dpwssd_epi32(sum, activations, weights);
  }
  VNNI static __m512i widen(const uint8_t* pair) {
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair)));
    // (b | b << 12) & 0x000F000F: the low nibble in the low int16, the high nibble in the high one.
    return _mm512_ternarylogic_epi32(bytes, _mm512_slli_epi32(bytes, 12), _mm512_set1_epi32(0x000F000F), 0xA8);
  }
  AVX2 static __m256i widen_half(const uint8_t* pair, int64_t half) {
    const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair + kTile / 2 * half)));
    return _mm256_and_si256(_mm256_or_si256(bytes, _mm256_slli_epi32(bytes, 12)), _mm256_set1_epi32(0x000F000F));
  }
};

// llama.cpp's Q8_0 arithmetic, activations in int8 too: vpdpbusd does 64 multiply-adds of
// unsigned x signed bytes per instruction, twice vpdpwssd's, on weights stored as q + 128
// (unsigned, 0..255) four inputs x 16 outputs a vector with no widening. Each group's sum then
// carries 128 * the sum of its activations, subtracted in int32 (exact) before scaling.
struct Int8Quads {
  static constexpr int64_t kSteps = kGroup / 4;
  static constexpr int64_t kBytes = 4 * kTile;
  static constexpr bool kMins = false, kOffset = true;
  VNNI static __m512i widen(const uint8_t* quad) { return _mm512_loadu_si512(quad); }
  VNNI static __m512i dot(__m512i sum, __m512i activations, __m512i weights) {
    return _mm512_dpbusd_epi32(sum, weights, activations);
  }
};

// Rows [row, row + R) of the T tiles from t (outputs [16 t, 16 (t + T))): T tiles share each
// broadcast of a row's activations.
template <class Format, int64_t T, int64_t R>
VNNI void tile_rows(const Problem& p, int64_t row, int64_t t) {
  const int64_t words = p.groups * Format::kSteps;
  __m512 sum[T][R];
  for (int64_t j = 0; j < T; ++j)
    for (int64_t r = 0; r < R; ++r) sum[j][r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m512i dot[T][R];
    for (int64_t j = 0; j < T; ++j)
      for (int64_t r = 0; r < R; ++r) dot[j][r] = _mm512_setzero_si512();
    // Unrolled: as a loop, GCC 12 copied every accumulator to another register and back around
    // each vpdpbusd/vpdpwssd (24 vector moves to 12 dot products on the ports they share); the q8_0
    // preset's prompt projections took 1.2-1.5x as long (64 offline prompts on an Intel Xeon without AMX).
#pragma GCC unroll 16
    for (int64_t k = 0; k < Format::kSteps; ++k) {
      __m512i w[T];
      for (int64_t j = 0; j < T; ++j)
        w[j] = Format::widen(p.weight + (((t + j) * p.groups + g) * Format::kSteps + k) * Format::kBytes);
      for (int64_t r = 0; r < R; ++r) {
        const __m512i a = _mm512_set1_epi32(p.words[(row + r) * words + g * Format::kSteps + k]);
        for (int64_t j = 0; j < T; ++j) dot[j][r] = Format::dot(dot[j][r], a, w[j]);
      }
    }
    if constexpr (Format::kOffset)
      for (int64_t r = 0; r < R; ++r) {
        const __m512i offset = _mm512_set1_epi32(p.offsets[(row + r) * p.groups + g]);
        for (int64_t j = 0; j < T; ++j) dot[j][r] = _mm512_sub_epi32(dot[j][r], offset);
      }
    for (int64_t j = 0; j < T; ++j) {
      const int64_t at = ((t + j) * p.groups + g) * kTile;
      const __m512 scale = _mm512_loadu_ps(p.scales + at);
      for (int64_t r = 0; r < R; ++r) {
        const __m512 row_scale = _mm512_set1_ps(p.row_scales[(row + r) * p.groups + g]);
        sum[j][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[j][r]), _mm512_mul_ps(scale, row_scale), sum[j][r]);
      }
      if constexpr (Format::kMins) {
        const __m512 min = _mm512_loadu_ps(p.mins + at);
        for (int64_t r = 0; r < R; ++r)
          sum[j][r] = _mm512_fmadd_ps(min, _mm512_set1_ps(p.row_sums[(row + r) * p.groups + g]), sum[j][r]);
      }
    }
  }
  for (int64_t j = 0; j < T; ++j) {
    const __m512 bias = p.bias ? _mm512_loadu_ps(p.bias + (t + j) * kTile) : _mm512_setzero_ps();
    for (int64_t r = 0; r < R; ++r)
      _mm512_storeu_ps(p.y + (row + r) * p.out + (t + j) * kTile, _mm512_add_ps(sum[j][r], bias));
  }
}

// Rows [row, row + R) of tile t on AVX2: its two halves of 8 outputs share each broadcast.
template <class Format, int64_t R>
AVX2 void tile_rows_avx2(const Problem& p, int64_t row, int64_t t) {
  const int64_t half_in = p.groups * kPairs;
  __m256 sum[2][R];
  for (int64_t h = 0; h < 2; ++h)
    for (int64_t r = 0; r < R; ++r) sum[h][r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < p.groups; ++g) {
    __m256i dot[2][R];
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t r = 0; r < R; ++r) dot[h][r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < kPairs; ++k) {
      const uint8_t* pair = p.weight + ((t * p.groups + g) * kPairs + k) * Format::kBytes;
      const __m256i w[2] = {Format::widen_half(pair, 0), Format::widen_half(pair, 1)};
      for (int64_t r = 0; r < R; ++r) {
        const __m256i a = _mm256_set1_epi32(p.words[(row + r) * half_in + g * kPairs + k]);
        for (int64_t h = 0; h < 2; ++h) dot[h][r] = _mm256_add_epi32(dot[h][r], _mm256_madd_epi16(a, w[h]));
      }
    }
    for (int64_t h = 0; h < 2; ++h) {
      const int64_t at = (t * p.groups + g) * kTile + 8 * h;
      const __m256 scale = _mm256_loadu_ps(p.scales + at);
      for (int64_t r = 0; r < R; ++r) {
        const __m256 row_scale = _mm256_set1_ps(p.row_scales[(row + r) * p.groups + g]);
        sum[h][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[h][r]), _mm256_mul_ps(scale, row_scale), sum[h][r]);
      }
      if constexpr (Format::kMins) {
        const __m256 min = _mm256_loadu_ps(p.mins + at);
        for (int64_t r = 0; r < R; ++r)
          sum[h][r] = _mm256_fmadd_ps(min, _mm256_set1_ps(p.row_sums[(row + r) * p.groups + g]), sum[h][r]);
      }
    }
  }
  for (int64_t h = 0; h < 2; ++h) {
    const __m256 bias = p.bias ? _mm256_loadu_ps(p.bias + t * kTile + 8 * h) : _mm256_setzero_ps();
    for (int64_t r = 0; r < R; ++r)
      _mm256_storeu_ps(p.y + (row + r) * p.out + t * kTile + 8 * h, _mm256_add_ps(sum[h][r], bias));
  }
}

// block(rows, row) for rows [row, row + rows) of the m, in blocks of Rows (the last one smaller);
// rows is a std::integral_constant, so that each block size is its own unrolled body.
template <int64_t R, class Block>
void last_rows(int64_t left, int64_t row, const Block& block) {
  if constexpr (R > 0) {
    if (left == R) return block(std::integral_constant<int64_t, R>{}, row);
    last_rows<R - 1>(left, row, block);
  }
}

template <int64_t Rows, class Block>
void all_rows(int64_t m, const Block& block) {
  int64_t row = 0;
  for (; row + Rows <= m; row += Rows) block(std::integral_constant<int64_t, Rows>{}, row);
  if (row < m) last_rows<Rows - 1>(m - row, row, block);
}

template <class Format>
void multiply(const Problem& p, bool avx512) {
  // AVX-512: pairs of tiles split over threads (an odd last tile alone); AVX2: tiles. A
  // thread's tiles (32 outputs x in bytes, or half that) stay in L1 while every block of rows
  // reads them.
  const int64_t tiles = p.out / kTile;
  if constexpr (requires(const uint8_t* bytes) { Format::widen_half(bytes, 0); }) {  // not Int8Quads
    if (!avx512) {
      at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t)
          all_rows<kRowsAvx2>(p.m, [&](auto rows, int64_t row) { tile_rows_avx2<Format, rows>(p, row, t); });
      });
      return;
    }
  }
  at::parallel_for(0, (tiles + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t t = 2 * pair;
      if (t + 1 < tiles)
        all_rows<kRows>(p.m, [&](auto rows, int64_t row) { tile_rows<Format, 2, rows>(p, row, t); });
      else
        all_rows<kRows>(p.m, [&](auto rows, int64_t row) { tile_rows<Format, 1, rows>(p, row, t); });
    }
  });
}

// Groups [begin, end) of rows' inputs (group i is inputs 32 i .. 32 i + 31 of the flattened
// rows): scale = max |x| / top, q = round(x / scale) as Q, and the sum of q's: for int16 (top
// 32767) scale * sum(q) in sums, for int8 (top 127, llama.cpp's Q8_0 activations) 128 * sum(q)
// in offsets, the int32 that Int8Quads' unsigned weights add.
template <typename Q>
VNNI void quantize_groups(const float* x, int64_t begin, int64_t end, Q* q, float* scales, float* sums, int32_t* offsets) {
  constexpr float top = std::is_same_v<Q, int16_t> ? 32767.0f : 127.0f;
  for (int64_t i = begin; i < end; ++i) {
    const __m512 lo = _mm512_loadu_ps(x + i * kGroup), hi = _mm512_loadu_ps(x + i * kGroup + 16);
    const float largest = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? top / largest : 0.0f);
    const __m512i q_lo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inverse));  // to nearest, ties to even
    const __m512i q_hi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inverse));
    const int32_t total = _mm512_reduce_add_epi32(_mm512_add_epi32(q_lo, q_hi));
    scales[i] = largest / top;
    if constexpr (std::is_same_v<Q, int16_t>) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup), _mm512_cvtsepi32_epi16(q_lo));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup + 16), _mm512_cvtsepi32_epi16(q_hi));
      sums[i] = scales[i] * static_cast<float>(total);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup), _mm512_cvtsepi32_epi8(q_lo));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + i * kGroup + 16), _mm512_cvtsepi32_epi8(q_hi));
      offsets[i] = 128 * total;
    }
  }
}

AVX2 void quantize_groups_avx2(const float* x, int64_t begin, int64_t end, int16_t* q, float* scales, float* sums) {
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  for (int64_t i = begin; i < end; ++i) {
    __m256 v[4];
    for (int64_t j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + i * kGroup + 8 * j);
    const __m256 top = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], magnitude), _mm256_and_ps(v[1], magnitude)),
                                     _mm256_max_ps(_mm256_and_ps(v[2], magnitude), _mm256_and_ps(v[3], magnitude)));
    __m128 four = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    four = _mm_max_ps(four, _mm_movehl_ps(four, four));
    const float largest = _mm_cvtss_f32(_mm_max_ss(four, _mm_movehdup_ps(four)));
    const __m256 inverse = _mm256_set1_ps(largest > 0.0f ? 32767.0f / largest : 0.0f);
    __m256i n[4];
    for (int64_t j = 0; j < 4; ++j) n[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse));  // ties to even
    // packs works within 128-bit lanes: 0xD8 puts the quarters back in input order.
    for (int64_t j = 0; j < 2; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i * kGroup + 16 * j),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(n[2 * j], n[2 * j + 1]), 0xD8));
    const __m256i total = _mm256_add_epi32(_mm256_add_epi32(n[0], n[1]), _mm256_add_epi32(n[2], n[3]));
    __m128i half = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0x4E));
    half = _mm_add_epi32(half, _mm_shuffle_epi32(half, 0xB1));
    scales[i] = largest / 32767.0f;
    sums[i] = scales[i] * static_cast<float>(_mm_cvtsi128_si32(half));
  }
}
#endif

at::Tensor paired_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                         const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits,
                         bool avx512, int64_t activation_bits) {
#if defined(__x86_64__)
  TORCH_CHECK(!avx512 || (__builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vnni")),
              "this CPU has no AVX-512 VNNI: call paired_linear with avx512=False");
  TORCH_CHECK(activation_bits == 16 || activation_bits == 8, "activation_bits must be 16 or 8, got ", activation_bits);
  TORCH_CHECK(activation_bits == 16 || (avx512 && bits == 8),
              "int8 activations run on AVX-512 VNNI with 8-bit weights (quads) only");
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "paired_linear needs AVX2 and FMA, which this CPU lacks: use grouped_linear");
  const auto [tiles, groups, out, in] = check_paired_weight(x, weight, scales, mins, bias, bits);
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor result = at::empty({m, out}, rows.options());
  const bool int8 = activation_bits == 8;
  at::Tensor quantized = at::empty({m, in}, rows.options().dtype(int8 ? at::kChar : at::kShort));
  at::Tensor row_scales = at::empty({m, groups}, rows.options()), row_sums = at::empty({m, groups}, rows.options());
  at::Tensor offsets = at::empty({int8 ? m : 0, groups}, rows.options().dtype(at::kInt));
  if (m > 0) {
    at::parallel_for(0, m * groups, 64, [&](int64_t begin, int64_t end) {
      const float* from = rows.const_data_ptr<float>();
      float *scales_out = row_scales.mutable_data_ptr<float>(), *sums_out = row_sums.mutable_data_ptr<float>();
      if (int8)
        quantize_groups(from, begin, end, quantized.mutable_data_ptr<int8_t>(), scales_out, sums_out,
                        offsets.mutable_data_ptr<int32_t>());
      else if (avx512)
        quantize_groups(from, begin, end, quantized.mutable_data_ptr<int16_t>(), scales_out, sums_out, nullptr);
      else
        quantize_groups_avx2(from, begin, end, quantized.mutable_data_ptr<int16_t>(), scales_out, sums_out);
    });
    const Problem p{static_cast<const int32_t*>(quantized.const_data_ptr()),
                    row_scales.const_data_ptr<float>(),
                    row_sums.const_data_ptr<float>(),
                    int8 ? offsets.const_data_ptr<int32_t>() : nullptr,
                    static_cast<const uint8_t*>(weight.const_data_ptr()),
                    scales.const_data_ptr<float>(),
                    mins ? mins->const_data_ptr<float>() : nullptr,
                    bias ? bias->const_data_ptr<float>() : nullptr,
                    result.mutable_data_ptr<float>(),
                    m,
                    groups,
                    out};
    if (int8)
      multiply<Int8Quads>(p, true);
    else if (bits == 8)
      multiply<Int8Pairs>(p, avx512);
    else
      multiply<NibblePairs>(p, avx512);
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return result.view(shape);
#else
  (void)x, (void)weight, (void)scales, (void)mins, (void)bias, (void)bits, (void)avx512, (void)activation_bits;
  TORCH_CHECK(false, "paired_linear needs AVX2 or AVX-512 VNNI (x86-64): use grouped_linear");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) {
  m.def(
      "paired_linear(Tensor x, Tensor weight, Tensor scales, Tensor? mins, Tensor? bias, int bits, bool avx512, "
      "int activation_bits=16) -> Tensor");
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("paired_linear", &paired_linear); }
