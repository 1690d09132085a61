// vattn::widened_linear: paired_linear's weights (8-bit, or 4-bit with mins, in groups of 32
// inputs, stored tile by tile: serving.model.weights.PairedWeight) multiplied in float32, on AVX2.
//
// paired_linear quantizes the activations to int16 and multiplies in integers: float32's rate of
// multiply-adds on AVX2, at a rounding of the activations. For many rows (a prompt) the weight's
// widening costs next to nothing against the rows' multiply-adds, so this kernel widens each tile
// of 16 outputs once to float32 (w = d * q + m, as GGUF's dequantization and transformers' compute
// it: d * q is exact in float32, so the fused multiply-add rounds once, as they do), then runs
// tiled_linear's float32 body (native/float_tiles.h) over every row. The product is then the
// float32 one of the dequantized weights: a GGUF's blocks give its fp32 model's answers, at fp32's
// speed for prompts and in the file's bytes.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "float_tiles.h"
#include "narrow_floats.h"
#include "paired_weight.h"

namespace {

constexpr int64_t kGroup = 32;  // inputs per scale
constexpr int64_t kTile = 16;   // outputs per tile
constexpr int64_t kPairs = kGroup / 2;
constexpr int64_t kBatchBytes = 1 << 20;   // a thread's widened tiles at a time (a batch)
constexpr int64_t kChunkBytes = 192 << 10;  // activations of one chunk of rows
constexpr int64_t kHotBytes = 512 << 10;    // activations of every row, within L2: tiles one at a time

#if defined(__x86_64__)
#define AVX2 __attribute__((target("avx2,fma")))

// One tile's weights as float32 `[groups * 32, 16]` from its paired bytes (`[groups, 16 pairs,
// 16 outputs x 2 inputs]`, int8; or `[groups, 16 pairs, 16 outputs]`, a byte each, the pair's
// first input in the low nibble) and its `[groups, 16]` scales (and mins).
template <int64_t Bits>
AVX2 void widen_tile(const uint8_t* weight, const float* scales, const float* mins, int64_t groups, float* tile) {
  constexpr int64_t kBytes = Bits == 8 ? 2 * kTile : kTile;
  for (int64_t g = 0; g < groups; ++g)
    for (int64_t h = 0; h < 2; ++h) {  // outputs 8 h .. 8 h + 7
      const __m256 scale = _mm256_loadu_ps(scales + g * kTile + 8 * h);
      const __m256 min = Bits == 4 ? _mm256_loadu_ps(mins + g * kTile + 8 * h) : _mm256_setzero_ps();
      for (int64_t k = 0; k < kPairs; ++k) {
        const uint8_t* pair = weight + (g * kPairs + k) * kBytes;
        __m256i first, second;  // the pair's two inputs' q for the 8 outputs, int32
        if constexpr (Bits == 8) {
          // Each int32 lane: the first input's q in its low int16, the second's in its high one.
          const __m256i both = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(pair + 16 * h)));
          first = _mm256_srai_epi32(_mm256_slli_epi32(both, 16), 16);
          second = _mm256_srai_epi32(both, 16);
        } else {
          const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(pair + 8 * h)));
          first = _mm256_and_si256(bytes, _mm256_set1_epi32(0x0F));
          second = _mm256_srli_epi32(bytes, 4);
        }
        float* row = tile + (g * kGroup + 2 * k) * kTile + 8 * h;
        if constexpr (Bits == 8) {
          _mm256_storeu_ps(row, _mm256_mul_ps(_mm256_cvtepi32_ps(first), scale));
          _mm256_storeu_ps(row + kTile, _mm256_mul_ps(_mm256_cvtepi32_ps(second), scale));
        } else {
          _mm256_storeu_ps(row, _mm256_fmadd_ps(_mm256_cvtepi32_ps(first), scale, min));
          _mm256_storeu_ps(row + kTile, _mm256_fmadd_ps(_mm256_cvtepi32_ps(second), scale, min));
        }
      }
    }
}
#endif

at::Tensor widened_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          const std::optional<at::Tensor>& mins, const std::optional<at::Tensor>& bias, int64_t bits) {
#if defined(__x86_64__)
  TORCH_CHECK(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"),
              "widened_linear needs AVX2 and FMA, which this CPU lacks: use grouped_linear");
  const auto [tiles, groups, out, in] = check_paired_weight(x, weight, scales, mins, bias, bits);
  const int64_t bytes = bits == 8 ? 2 * kTile : kTile;  // a pair of inputs of the tile's 16 outputs
  const at::Tensor rows = x.reshape({-1, in}).contiguous();
  const int64_t m = rows.size(0);
  at::Tensor result = at::empty({m, out}, rows.options());
  if (m > 0)
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      // The thread's tiles a batch at a time, widened once into `batch`, then the rows a chunk at a
      // time over every tile of the batch: the chunk's activations stay in L2 while the batch's
      // tiles pass over them, where all the rows for one tile (a prompt's are megabytes) came back
      // from L3 or memory for each of the 16 outputs.
      // Rows whose activations stay in L2 (a decode step's) take each tile right after widening it:
      // it is still in L1/L2 for every row block, where a batch's first tiles have gone to L3.
      const int64_t floats = in * kTile;
      const int64_t batch_tiles = m * in * 4 <= kHotBytes ? 1 : std::max<int64_t>(1, kBatchBytes / (floats * 4));
      const int64_t blocks = std::max<int64_t>(1, kChunkBytes / (in * 4) / float_tiles::kAvx2Rows);
      const int64_t chunk = blocks * float_tiles::kAvx2Rows;  // rows
      std::vector<float> batch(std::min(batch_tiles, end - begin) * floats);
      const auto* bytes_of = static_cast<const uint8_t*>(weight.const_data_ptr());
      const float *scale_of = scales.const_data_ptr<float>(), *min_of = mins ? mins->const_data_ptr<float>() : nullptr;
      const float* bias_of = bias ? bias->const_data_ptr<float>() : nullptr;
      for (int64_t first = begin; first < end; first += batch_tiles) {
        const int64_t last = std::min(end, first + batch_tiles);
        for (int64_t t = first; t < last; ++t) {
          const uint8_t* tile_bytes = bytes_of + t * groups * kPairs * bytes;
          const float* tile_mins = min_of ? min_of + t * groups * kTile : nullptr;
          float* tile = batch.data() + (t - first) * floats;
          if (bits == 8)
            widen_tile<8>(tile_bytes, scale_of + t * groups * kTile, tile_mins, groups, tile);
          else
            widen_tile<4>(tile_bytes, scale_of + t * groups * kTile, tile_mins, groups, tile);
        }
        for (int64_t r = 0; r < m; r += chunk)
          for (int64_t t = first; t < last; ++t)
            float_tiles::tile_avx2(std::min(chunk, m - r), rows.const_data_ptr<float>() + r * in, in,
                                   batch.data() + (t - first) * floats, bias_of ? bias_of + t * kTile : nullptr,
                                   result.mutable_data_ptr<float>() + r * out + t * kTile, out);
      }
    });
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = out;
  return result.view(shape);
#else
  (void)x, (void)weight, (void)scales, (void)mins, (void)bias, (void)bits;
  TORCH_CHECK(false, "widened_linear needs AVX2 (x86-64): use grouped_linear");
#endif
}

// Output o's 32 inputs of group g, from one tile's bytes, as float q:
// 8-bit weights in steps of `Step` inputs an output (pairs as int8; quads, q8_0's, as q + 128),
// 4-bit ones in pairs of nibbles (the first input low).
template <int64_t Bits, int64_t Step>
void group_of(const uint8_t* bytes, int64_t o, float* q) {
  for (int64_t i = 0; i < kGroup; ++i) {
    if constexpr (Bits == 4) {
      const uint8_t byte = bytes[(i / 2) * kTile + o];
      q[i] = static_cast<float>(i % 2 ? byte >> 4 : byte & 0x0F);
    } else if constexpr (Step == 4) {
      q[i] = static_cast<float>(static_cast<int>(bytes[((i / 4) * kTile + o) * 4 + i % 4]) - 128);
    } else {
      q[i] = static_cast<float>(static_cast<int8_t>(bytes[((i / 2) * kTile + o) * 2 + i % 2]));
    }
  }
}

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 warns that the AVX-512 intrinsics' internal _mm512_undefined_*() "is" or "may be" used
// uninitialized (a false positive: the mask selects every lane).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#define AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")))

// group_of's 32 values for 8-bit weights, times the scale, as 32 bf16 at `row`: one gather of the
// output's pairs (or quads) from the group's bytes.
template <int64_t Step>
AVX512_BF16 void widen_group8(const uint8_t* bytes, int64_t o, float scale, c10::BFloat16* row) {
  const __m512 factor = _mm512_set1_ps(scale);
  __m512 low, high;  // inputs 0-15 and 16-31
  if constexpr (Step == 2) {
    // Dword k holds the output's pair k (inputs 2k, 2k + 1) in its low 16 bits.
    const __m512i index = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                             _mm512_set1_epi32(kTile * 2));
    const __m512i pairs = _mm512_i32gather_epi32(index, bytes + 2 * o, 1);
    const __m512 even = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 24), 24)), factor);
    const __m512 odd = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(pairs, 16), 24)), factor);
    low = _mm512_permutex2var_ps(even, _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23), odd);
    high = _mm512_permutex2var_ps(even, _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31),
                                  odd);
  } else {
    // Quad k (inputs 4k .. 4k + 3, each q + 128) at dword 16 k + o.
    const __m256i index = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(kTile * 4));
    const __m256i quads = _mm256_i32gather_epi32(reinterpret_cast<const int*>(bytes + 4 * o), index, 1);
    const __m512i bias = _mm512_set1_epi32(128);
    low = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(quads)), bias)), factor);
    high = _mm512_mul_ps(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(quads, 1)), bias)), factor);
  }
  _mm512_storeu_si512(row, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(high, low)));
}
#endif

template <int64_t Bits, int64_t Step>
void widen_all(const uint8_t* weight, const float* scales, const float* mins, int64_t tiles, int64_t groups,
               c10::BFloat16* out) {
  const int64_t in = groups * kGroup, group_bytes = kGroup * kTile * Bits / 8;
#if defined(__x86_64__)
  const bool simd = __builtin_cpu_supports("avx512bf16");
#endif
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float q[kGroup];
    for (int64_t t = begin; t < end; ++t)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t o = 0; o < kTile; ++o) {
          c10::BFloat16* row = out + (t * kTile + o) * in + g * kGroup;
#if defined(__x86_64__)
          if constexpr (Bits == 8)
            if (simd) {
              widen_group8<Step>(weight + (t * groups + g) * group_bytes, o, scales[(t * groups + g) * kTile + o], row);
              continue;
            }
#endif
          group_of<Bits, Step>(weight + (t * groups + g) * group_bytes, o, q);
          const float scale = scales[(t * groups + g) * kTile + o];
          const float min = mins ? mins[(t * groups + g) * kTile + o] : 0.0f;
          for (int64_t i = 0; i < kGroup; ++i) row[i] = narrow<c10::BFloat16>(std::fma(scale, q[i], min));
        }
  });
}

at::Tensor widened_bf16(const at::Tensor& weight, const at::Tensor& scales, const std::optional<at::Tensor>& mins,
                        int64_t bits, int64_t step) {
  const auto [tiles, groups, out, in] = check_paired_bytes(weight, scales, mins, bits);
  TORCH_CHECK(step == 2 || (step == 4 && bits == 8), "step must be 2 (pairs), or 4 (quads) for 8-bit weights");
  at::Tensor result = at::empty({out, in}, scales.options().dtype(at::kBFloat16));
  const auto* bytes = static_cast<const uint8_t*>(weight.const_data_ptr());
  const float* min_of = mins ? mins->const_data_ptr<float>() : nullptr;
  auto* dst = result.mutable_data_ptr<c10::BFloat16>();
  if (bits == 4)
    widen_all<4, 2>(bytes, scales.const_data_ptr<float>(), min_of, tiles, groups, dst);
  else if (step == 4)
    widen_all<8, 4>(bytes, scales.const_data_ptr<float>(), min_of, tiles, groups, dst);
  else
    widen_all<8, 2>(bytes, scales.const_data_ptr<float>(), min_of, tiles, groups, dst);
  return result;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) {
  m.def("widened_linear(Tensor x, Tensor weight, Tensor scales, Tensor? mins, Tensor? bias, int bits) -> Tensor");
  m.def("widened_bf16(Tensor weight, Tensor scales, Tensor? mins, int bits, int step) -> Tensor");
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) {
  m.impl("widened_linear", &widened_linear);
  m.impl("widened_bf16", &widened_bf16);
}
