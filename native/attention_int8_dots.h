// The ragged kernel's body for bfloat16 queries over an int8 cache (a bf16 model over
// kv_cache_dtype="int8") on a CPU with AVX512_VNNI: the rows are read as the cache stores them,
// a quarter of float32's bytes and half of bf16's, and never widened to floats for the scores.
//
// Scores by vpdpwssd (32 int16 products summed in pairs into 16 int32 lanes an instruction):
// each lane's query is quantized once an item to int16 (scale = its largest magnitude / 32767,
// finer than the bf16 it comes from), a row's bytes are sign-extended to int16, and the dot
// product is exact in int32 (|sum| <= 127 x 32767 x 512 < 2^31). A score is then query scale x
// row scale x that integer. Value sums in float32: each row widened to floats and multiplied by
// its probability times its scale, so nothing rounds beyond the cache's own quantization and
// the query's int16 step. Included by ragged_attention.cpp after attention_avx512.h, whose
// softmax it keeps.
#pragma once

struct Avx512Int8Math : Avx512Math {
  static bool fits(int64_t dim) { return dim % 32 == 0 && dim <= Avx512Math::kMaxDim; }

  // A lane's query as int16 (dst); returns its scale, the softmax's `scale` folded in.
  static float quantize(const c10::BFloat16* q, int64_t dim, double scale, int16_t* dst) {
    float largest = 0.0f;
    for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::abs(::widen(q[d])));
    const float step = largest > 0.0f ? largest / 32767.0f : 1.0f;
    for (int64_t d = 0; d < dim; ++d)
      dst[d] = static_cast<int16_t>(std::clamp(std::nearbyint(::widen(q[d]) / step), -32767.0f, 32767.0f));
    return step * static_cast<float>(scale);
  }

  // The integer twins of Avx512Math's transposing tree (sum_quad, sum_quads).
  __attribute__((target("avx512f,avx512bw"))) static __m512i sum_quad(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    return _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
  }
  __attribute__((target("avx512f,avx512bw"))) static __m512i sum_quads(const __m512i* quads) {
    const __m512i first = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[0], quads[1], 0x88),
                                           _mm512_shuffle_i32x4(quads[0], quads[1], 0xDD));
    const __m512i second = _mm512_add_epi32(_mm512_shuffle_i32x4(quads[2], quads[3], 0x88),
                                            _mm512_shuffle_i32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_epi32(_mm512_shuffle_i32x4(first, second, 0x88), _mm512_shuffle_i32x4(first, second, 0xDD));
  }

  // L <= 4 lanes' scores against n <= kBlock keys, head_dim C x 32 (C = 0: dim / 32 from `dim`,
  // the queries loaded per key): each row widened once for all L lanes, a lane's 16 dots from one tree.
  template <int64_t L, int64_t C>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"))) static void dots_few(
      const int16_t* const* q, const float* const* query_scales, float* const* out, const int8_t* const* keys,
      const float* key_scales, int64_t n, int64_t dim) {
    const int64_t chunks = C > 0 ? C : dim / 32;
    __m512i held[L][C > 0 ? C : 1];
    if constexpr (C > 0)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t c = 0; c < C; ++c) held[l][c] = _mm512_loadu_si512(q[l] + 32 * c);
    __m512i quads[L][4];
    for (int64_t g = 0; g < 4; ++g) {
      __m512i sums[L][4];
      for (int64_t l = 0; l < L; ++l)
        for (int64_t i = 0; i < 4; ++i) sums[l][i] = _mm512_setzero_si512();
      for (int64_t i = 0; i < 4; ++i) {
        const auto* row = 4 * g + i < n ? keys[4 * g + i] : reinterpret_cast<const int8_t*>(kZeroRow);
        for (int64_t c = 0; c < chunks; ++c) {
          const __m512i k = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 32 * c)));
          for (int64_t l = 0; l < L; ++l) {
            __m512i query;
            if constexpr (C > 0)
              query = held[l][c];
            else
              query = _mm512_loadu_si512(q[l] + 32 * c);
            sums[l][i] = _mm512_dpwssd_epi32(sums[l][i], k, query);
          }
        }
      }
      for (int64_t l = 0; l < L; ++l) quads[l][g] = sum_quad(sums[l][0], sums[l][1], sums[l][2], sums[l][3]);
    }
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 row_scales = _mm512_maskz_loadu_ps(live, key_scales);
    for (int64_t l = 0; l < L; ++l) {
      const __m512 factor = _mm512_mul_ps(row_scales, _mm512_set1_ps(*query_scales[l]));
      _mm512_mask_storeu_ps(out[l], live, _mm512_mul_ps(factor, _mm512_cvtepi32_ps(sum_quads(quads[l]))));
    }
  }
  static void dots_lanes(const int16_t* const* q, const float* const* query_scales, float* const* out, int64_t count,
                         const int8_t* const* keys, const float* key_scales, int64_t n, int64_t dim) {
    by_fours(count, [&]<int64_t L>(int64_t l) {
      if (dim == 64) return dots_few<L, 2>(q + l, query_scales + l, out + l, keys, key_scales, n, dim);
      if (dim == 128 && L <= 3) return dots_few<L, 4>(q + l, query_scales + l, out + l, keys, key_scales, n, dim);
      dots_few<L, 0>(q + l, query_scales + l, out + l, keys, key_scales, n, dim);
    });
  }

  // acc[l] += sum over the block of weights[l][j] x value row j, V vectors of 16 columns from column d.
  template <int64_t L, int64_t V>
  __attribute__((target("avx512f,avx512bw,avx2,fma"))) static void accumulate_block(
      float* const* acc, const float (*weights)[kBlock], const int8_t* const* values, int64_t n, int64_t d) {
    __m512 a[L][V];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_loadu_ps(acc[l] + d + 16 * v);
    for (int64_t j = 0; j < n; ++j) {
      __m512 row[V];
      for (int64_t v = 0; v < V; ++v)
        row[v] = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(values[j] + d + 16 * v))));
      for (int64_t l = 0; l < L; ++l) {
        const __m512 w = _mm512_set1_ps(weights[l][j]);
        for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_fmadd_ps(w, row[v], a[l][v]);
      }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(acc[l] + d + 16 * v, a[l][v]);
  }
  static void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const int8_t* const* values,
                               const float* value_scales, int64_t n, int64_t dim) {
    by_fours(count, [&]<int64_t L>(int64_t l) {
      float weights[L][kBlock];
      for (int64_t i = 0; i < L; ++i)
        for (int64_t j = 0; j < n; ++j) weights[i][j] = p[l + i][j] * value_scales[j];
      int64_t d = 0;
      for (; d + 64 <= dim; d += 64) accumulate_block<L, 4>(acc + l, weights, values, n, d);
      if (d < dim) accumulate_block<L, 2>(acc + l, weights, values, n, d);  // dim % 32 == 0
    });
  }
};
