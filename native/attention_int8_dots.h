// The ragged kernel's body for bfloat16 queries over an int8 cache (a bf16 model over
// kv_cache_dtype="int8") on a CPU with AVX512_VNNI: the rows are read as the cache stores them,
// a quarter of float32's bytes and half of bf16's, and never widened to floats for the scores.
//
// Scores by vpdpwssd (32 int16 products summed in pairs into 16 int32 lanes an instruction):
// each lane's query is quantized once an item to int16 (scale = its largest magnitude / 32767,
// finer than the bf16 it comes from), a row's bytes are sign-extended to int16, and the dot
// product is exact in int32 (|sum| <= 127 x 32767 x 512 < 2^31). A score is then query scale x
// row scale x that integer. Value sums the same way: a block's weights (probability x the row's
// scale) quantized to int16 on the lane's own scale for the block, exact int32 sums by vpdpwssd,
// added to float32 sums once a block. Nothing rounds beyond the cache's own quantization and
// the two int16 quantizations (2^-15 of the largest, finer than bf16's 2^-8 relative). The rows'
// midpoints are not in these products: the caller (attend) adds them. Included by
// ragged_attention.cpp after attention_avx512.h, whose softmax it keeps.
#pragma once

struct Avx512Int8Math : Avx512Math {
  static constexpr int64_t kQParamsBytes = 2 * sizeof(float);  // a row's (scale, midpoint)
  static bool fits(int64_t dim) { return dim % 32 == 0 && dim <= Avx512Math::kMaxDim; }

  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static __m512 widen16(const c10::BFloat16* p) {
    const __m256i narrow = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16));
  }
  // A lane's query as int16 (dst); returns its scale, the softmax's `scale` folded in.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static float quantize(const c10::BFloat16* q,
                                                                                       int64_t dim, double scale,
                                                                                       int16_t* dst) {
    __m512 largest = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) largest = _mm512_max_ps(largest, _mm512_abs_ps(widen16(q + d)));
    const float top = _mm512_reduce_max_ps(largest);
    const float unit = top > 0.0f ? top / 32767.0f : 1.0f;  // the query's own scale
    const __m512 inverse = _mm512_set1_ps(1.0f / unit);
    for (int64_t d = 0; d < dim; d += 16)  // to nearest even, as nearbyint; |q / unit| <= 32767 (+ an ulp: saturates)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                          _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(widen16(q + d), inverse))));
    return unit * static_cast<float>(scale);
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
    PrefetchQueue* const queue = prefetch_queue;
    for (int64_t g = 0; g < 4; ++g) {
      prefetch_as_read(queue, 4 * (dim + kQParamsBytes));
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
      // Queries held in registers where they fit beside the 4 L sums (head_dim 128: 4 chunks a lane).
      if (dim == 128 && L <= 3) return dots_few<L, 4>(q + l, query_scales + l, out + l, keys, key_scales, n, dim);
      dots_few<L, 0>(q + l, query_scales + l, out + l, keys, key_scales, n, dim);
    });
  }

  // A lane's weights for a block of n <= kBlock values, p_j x the row's scale, quantized to int16
  // on the lane's own scale (its largest weight / 32767) and packed two keys to a 32-bit pair
  // (key 2k in the low half), as vpdpwssd takes them; returns that scale.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq"))) static float quantize_weights(
      const float* p, const float* value_scales, int64_t n, uint32_t* pairs) {
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 weights = _mm512_mul_ps(_mm512_maskz_loadu_ps(live, p), _mm512_maskz_loadu_ps(live, value_scales));
    const float largest = _mm512_reduce_max_ps(weights);
    if (!(largest > 0.0f)) {
      std::fill(pairs, pairs + kBlock / 2, 0u);
      return 0.0f;
    }
    const __m512i quantized = _mm512_cvtps_epi32(_mm512_mul_ps(weights, _mm512_set1_ps(32767.0f / largest)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs), _mm512_cvtepi32_epi16(quantized));
    return largest / 32767.0f;
  }
  // acc[l] += the block's values weighted by its int16 weights, times the lane's scale, for L <= 4
  // lanes and C chunks of 32 columns from column `first`: each pair of rows sign-extended to
  // int16 and interleaved in registers (vpunpcklwd/vpunpckhwd), summed exactly in int32 by
  // vpdpwssd, and added to the float sums once a block. Interleaved so, a chunk's sums land in
  // columns {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31}, put back in order at the end.
  template <int64_t L, int64_t C>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma"))) static void accumulate_few(
      float* const* acc, const uint32_t (*pairs)[kBlock / 2], const float* weight_scales, const int8_t* const* values,
      int64_t n, int64_t first) {
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512i a[L][C][2];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t c = 0; c < C; ++c) a[l][c][0] = a[l][c][1] = _mm512_setzero_si512();
    const auto* zeros = reinterpret_cast<const int8_t*>(kZeroRow);
    PrefetchQueue* const queue = prefetch_queue;
    for (int64_t k = 0; 2 * k < n; ++k) {
      prefetch_as_read(queue, 2 * (32 * C + kQParamsBytes));
      const int8_t* even = values[2 * k];
      const int8_t* odd = 2 * k + 1 < n ? values[2 * k + 1] : zeros;
      __m512i rows[C][2];
      for (int64_t c = 0; c < C; ++c) {
        const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even + first + 32 * c)));
        const __m512i y = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd + first + 32 * c)));
        rows[c][0] = _mm512_unpacklo_epi16(x, y);
        rows[c][1] = _mm512_unpackhi_epi16(x, y);
      }
      for (int64_t l = 0; l < L; ++l) {
        const __m512i pk = _mm512_set1_epi32(static_cast<int>(pairs[l][k]));
        for (int64_t c = 0; c < C; ++c)
          for (int64_t h = 0; h < 2; ++h) a[l][c][h] = _mm512_dpwssd_epi32(a[l][c][h], pk, rows[c][h]);
      }
    }
    for (int64_t l = 0; l < L; ++l) {
      const __m512 scale = _mm512_set1_ps(weight_scales[l]);
      for (int64_t c = 0; c < C; ++c) {
        const __m512 low = _mm512_cvtepi32_ps(a[l][c][0]), high = _mm512_cvtepi32_ps(a[l][c][1]);
        float* out = acc[l] + first + 32 * c;
        _mm512_storeu_ps(out, _mm512_fmadd_ps(scale, _mm512_permutex2var_ps(low, first_half, high), _mm512_loadu_ps(out)));
        _mm512_storeu_ps(out + 16, _mm512_fmadd_ps(scale, _mm512_permutex2var_ps(low, second_half, high),
                                                   _mm512_loadu_ps(out + 16)));
      }
    }
  }
  static void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const int8_t* const* values,
                               const float* value_scales, int64_t n, int64_t dim) {
    by_fours(count, [&]<int64_t L>(int64_t l) {
      uint32_t pairs[L][kBlock / 2];
      float weight_scales[L];
      for (int64_t i = 0; i < L; ++i) weight_scales[i] = quantize_weights(p[l + i], value_scales, n, pairs[i]);
      int64_t first = 0;
      for (; first + 64 <= dim; first += 64) accumulate_few<L, 2>(acc + l, pairs, weight_scales, values, n, first);
      if (first < dim) accumulate_few<L, 1>(acc + l, pairs, weight_scales, values, n, first);  // dim % 32 == 0
    });
  }
};
