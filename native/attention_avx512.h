// The ragged kernel's AVX-512 body (Avx512Math), as attention_avx2.h's with 16 floats a vector:
// its exp, widening, scores (dots_few for a decode's few lanes, a transposed 16 x 16 block for
// many) and value sums. Included by ragged_attention.cpp after attention_avx2.h and before
// attention_bf16_dots.h, which extends it.
#pragma once

struct Avx512Math {
  static constexpr int64_t kFloats = 16;  // a vector's
  __attribute__((target("avx512f,avx2,fma"))) static void widen(const c10::Half* const* rows, int64_t n, int64_t dim,
                                                                float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 16) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + d));
        _mm512_storeu_ps(dst + j * dim + d, _mm512_cvtph_ps(half));
      }
  }
  __attribute__((target("avx512f,avx2,fma"))) static void widen(const c10::BFloat16* const* rows, int64_t n,
                                                                int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 16) {
        const __m256i narrow = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + d));
        _mm512_storeu_ps(dst + j * dim + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16)));
      }
  }
  __attribute__((target("avx512f,avx2,fma"))) static void widen(const int8_t* const* rows, const float* scales,
                                                                const float* midpoints, int64_t n, int64_t dim,
                                                                float* dst) {
    for (int64_t j = 0; j < n; ++j) {
      const __m512 scale = _mm512_set1_ps(scales[j]), midpoint = _mm512_set1_ps(midpoints[j]);
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d)));
        _mm512_storeu_ps(dst + j * dim + d, _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(wide), midpoint));
      }
    }
  }
  __attribute__((target("avx512f,avx2,fma"))) static __m512 exp(__m512 x) { return fast_exp16(x); }
  // 16 of a row's values as floats: float32 rows as they are, float16 ones widened in registers.
  __attribute__((target("avx512f,avx2,fma"))) static __m512 load16(const float* row) { return _mm512_loadu_ps(row); }
  __attribute__((target("avx512f,avx2,fma"))) static __m512 load16(const c10::Half* row) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
  }
  __attribute__((target("avx512f,avx2,fma"))) static __m256 low_plus_high(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  // A transposing tree's first two levels: in each 128-bit lane i, the sums of a, b, c and d's
  // four floats in that lane, in that order.
  __attribute__((target("avx512f,avx2,fma"))) static __m512 sum_quad(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
    const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  }
  // Its last two: four sum_quad results (vectors 0-3, 4-7, 8-11, 12-15) to the 16 vectors' sums, in order.
  __attribute__((target("avx512f,avx2,fma"))) static __m512 sum_quads(const __m512* quads) {
    const __m512 first = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                       _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 second = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                        _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(first, second, 0x88), _mm512_shuffle_f32x4(first, second, 0xDD));
  }
  static constexpr int64_t kMaxDim = 512;  // the transposed block's buffer; larger dims go lane by lane
  alignas(64) static constexpr float kZeroRow[kMaxDim] = {};  // a block's missing keys (zero bytes: any dtype)
  // L <= 4 lanes' scores against a block of n <= kBlock keys, times `scale`, as a decode's few
  // query heads per kv head need them (too few lanes to pay for transposing the block): each
  // key's row is loaded once for all L lanes, four keys' products at a time, and a lane's 16
  // sums come from one transposing tree (45 instructions), not one horizontal sum per key.
  // Float rows multiply by FMA; bf16 rows (Avx512Bf16Math) by vdpbf16ps on their pairs, which
  // is why the target names avx512bf16: float code compiled so never emits its instructions.
  // kChunks > 0: head_dim is kChunks vectors, and the queries stay in registers for the block
  // (dots_few_for picks it where they fit beside the sums).
  template <int64_t L, typename T, int64_t kChunks = 0, typename K = T>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void dots_few(
      const T* const* q, float* const* out, const K* const* keys, int64_t n, int64_t dim, float scale) {
    constexpr int64_t kStep = 64 / sizeof(T);  // a vector's values
    const int64_t chunks = kChunks > 0 ? kChunks : dim / kStep;
    __m512 held[L][kChunks > 0 ? kChunks : 1];
    if constexpr (kChunks > 0)
      for (int64_t l = 0; l < L; ++l)
        for (int64_t c = 0; c < kChunks; ++c) held[l][c] = _mm512_loadu_ps(q[l] + c * kStep);
    __m512 quads[L][4];
    PrefetchQueue* const queue = prefetch_queue;
    for (int64_t g = 0; g < 4; ++g) {
      prefetch_as_read(queue, 4 * dim * static_cast<int64_t>(sizeof(K)));
      const K* rows[4];
      for (int64_t i = 0; i < 4; ++i) rows[i] = 4 * g + i < n ? keys[4 * g + i] : reinterpret_cast<const K*>(kZeroRow);
      __m512 sums[L][4];
      for (int64_t l = 0; l < L; ++l)
        for (int64_t i = 0; i < 4; ++i) sums[l][i] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; ++c)
        for (int64_t i = 0; i < 4; ++i) {
          __m512 k;
          if constexpr (std::is_same_v<K, c10::Half>)
            k = load16(rows[i] + c * kStep);
          else
            k = _mm512_loadu_ps(rows[i] + c * kStep);
          for (int64_t l = 0; l < L; ++l) {
            __m512 ql;
            if constexpr (kChunks > 0)
              ql = held[l][c];
            else
              ql = _mm512_loadu_ps(q[l] + c * kStep);
            if constexpr (std::is_same_v<T, float>)
              sums[l][i] = _mm512_fmadd_ps(ql, k, sums[l][i]);
            else
              sums[l][i] = _mm512_dpbf16_ps(sums[l][i], (__m512bh)ql, (__m512bh)k);
          }
        }
      for (int64_t l = 0; l < L; ++l) quads[l][g] = sum_quad(sums[l][0], sums[l][1], sums[l][2], sums[l][3]);
    }
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t l = 0; l < L; ++l) _mm512_mask_storeu_ps(out[l], live, _mm512_mul_ps(factor, sum_quads(quads[l])));
  }
  // dots_few with the queries held in registers where head_dim is 2 or 4 vectors and they fit
  // beside the 4 L sums (at most 12 of the 32 registers), else loaded per key.
  template <int64_t L, typename T, typename K = T>
  static void dots_few_for(const T* const* q, float* const* out, const K* const* keys, int64_t n, int64_t dim,
                           float scale) {
    constexpr int64_t kStep = 64 / sizeof(T);
    if constexpr (4 * L <= 12)
      if (dim == 4 * kStep) return dots_few<L, T, 4, K>(q, out, keys, n, dim, scale);
    if (dim == 2 * kStep) return dots_few<L, T, 2, K>(q, out, keys, n, dim, scale);
    dots_few<L, T, 0, K>(q, out, keys, n, dim, scale);
  }
  // Up to kLanes lanes, four at a time (dots_few).
  template <typename Few>
  static void by_fours(int64_t count, const Few& few) {
    for (int64_t l = 0; l < count; l += 4) switch (std::min<int64_t>(4, count - l)) {
        case 4: few.template operator()<4>(l); break;
        case 3: few.template operator()<3>(l); break;
        case 2: few.template operator()<2>(l); break;
        default: few.template operator()<1>(l); break;
      }
  }
  __attribute__((target("avx512f,avx2,fma"))) static void dots(const float* q, const float* const* keys, int64_t n, int64_t dim,
                                                      float* out) {
    if (n < kBlock) {
      for (int64_t j = 0; j < n; ++j) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(keys[j] + d), sum);
        out[j] = _mm512_reduce_add_ps(sum);
      }
      return;
    }
    __m512 sums[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) sums[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 qd = _mm512_loadu_ps(q + d);
      for (int64_t j = 0; j < kBlock; ++j) sums[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(keys[j] + d), sums[j]);
    }
    __m256 halves[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) halves[j] = low_plus_high(sums[j]);
    _mm256_storeu_ps(out, Avx2Math::sum8(halves));
    _mm256_storeu_ps(out + 8, Avx2Math::sum8(halves + 8));
  }
  __attribute__((target("avx512f,avx2,fma"))) static float exp_sum(float* s, int64_t count, float top) {
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 live = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
      const __m512 e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), shift));
      _mm512_mask_storeu_ps(s + j, live, e);
      total = _mm512_mask_add_ps(total, live, total, e);
    }
    return _mm512_reduce_add_ps(total);
  }
  __attribute__((target("avx512f,avx2,fma"))) static float top(const float* s, int64_t count) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 live = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
      best = _mm512_mask_max_ps(best, live, best, _mm512_maskz_loadu_ps(live, s + j));
    }
    return _mm512_reduce_max_ps(best);
  }
  // Many lanes at once, where prefill chunks have them (a tile's rows x a kv head's query
  // heads). Scores: the block's 16 keys transposed once (16 x 16 in registers), then each
  // lane's 16 scores are one vector, d by d, with no horizontal sums; L lanes share each load
  // of a transposed row. Values: L lanes share each load of a value row.
  __attribute__((target("avx512f,avx2,fma"))) static void transpose16(const float* const* keys, int64_t n, int64_t d,
                                                                     float* kt) {
    __m512 r[16], t[16], u[16];
    for (int64_t j = 0; j < 16; ++j) r[j] = j < n ? _mm512_loadu_ps(keys[j] + d) : _mm512_setzero_ps();
    for (int64_t i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // u[4 q + c]: rows 4 q .. 4 q + 3 of columns c, c + 4, c + 8, c + 12 (one per 128-bit lane).
    for (int64_t q = 0; q < 4; ++q) {
      const __m512d lo01 = _mm512_castps_pd(t[4 * q]), hi01 = _mm512_castps_pd(t[4 * q + 1]);
      const __m512d lo23 = _mm512_castps_pd(t[4 * q + 2]), hi23 = _mm512_castps_pd(t[4 * q + 3]);
      u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
      u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
      u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
      u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
    }
    for (int64_t c = 0; c < 4; ++c) {
      // v[h][s]: quads 2 h and 2 h + 1 of columns c + 4 s and c + 4 s + 8.
      __m512 v[2][2];
      for (int64_t h = 0; h < 2; ++h) {
        v[h][0] = _mm512_shuffle_f32x4(u[8 * h + c], u[8 * h + 4 + c], 0x88);
        v[h][1] = _mm512_shuffle_f32x4(u[8 * h + c], u[8 * h + 4 + c], 0xDD);
      }
      for (int64_t s = 0; s < 2; ++s) {
        _mm512_storeu_ps(kt + (c + 4 * s) * 16, _mm512_shuffle_f32x4(v[0][s], v[1][s], 0x88));
        _mm512_storeu_ps(kt + (c + 4 * s + 8) * 16, _mm512_shuffle_f32x4(v[0][s], v[1][s], 0xDD));
      }
    }
  }
  template <int64_t L>
  __attribute__((target("avx512f,avx2,fma"))) static void dots_transposed(const float* const* q, float* const* out,
                                                                         const float* kt, __mmask16 live, int64_t dim) {
    __m512 sums[L];
    for (int64_t l = 0; l < L; ++l) sums[l] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 k = _mm512_loadu_ps(kt + d * 16);
      for (int64_t l = 0; l < L; ++l) sums[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[l][d]), k, sums[l]);
    }
    for (int64_t l = 0; l < L; ++l) _mm512_mask_storeu_ps(out[l], live, sums[l]);
  }
  template <int64_t L>
  static void dots_transposed_left(const float* const* q, float* const* out, int64_t count, const float* kt,
                                   __mmask16 live, int64_t dim) {
    if constexpr (L > 0) {
      if (count == L) return dots_transposed<L>(q, out, kt, live, dim);
      dots_transposed_left<L - 1>(q, out, count, kt, live, dim);
    }
  }
  static void dots_lanes(const float* const* q, float* const* out, int64_t count, const float* const* keys, int64_t n,
                         int64_t dim) {
    constexpr int64_t kLanes = 8;
    if (dim > kMaxDim) {
      for (int64_t l = 0; l < count; ++l) dots(q[l], keys, n, dim, out[l]);
      return;
    }
    if (count < kLanes)
      return by_fours(count, [&]<int64_t L>(int64_t l) { dots_few_for<L>(q + l, out + l, keys, n, dim, 1.0f); });
    alignas(64) float kt[kMaxDim * 16];
    for (int64_t d = 0; d < dim; d += 16) transpose16(keys, n, d, kt + d * 16);
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    int64_t l = 0;
    for (; l + kLanes <= count; l += kLanes) dots_transposed<kLanes>(q + l, out + l, kt, live, dim);
    dots_transposed_left<kLanes - 1>(q + l, out + l, count - l, kt, live, dim);
  }
  template <int64_t L, int64_t V, typename R = float>
  __attribute__((target("avx512f,avx2,fma"))) static void accumulate_block(float* const* acc, const float* const* p,
                                                                          const R* const* values, int64_t n,
                                                                          int64_t d) {
    __m512 a[L][V];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_loadu_ps(acc[l] + d + 16 * v);
    PrefetchQueue* const queue = prefetch_queue;
    for (int64_t j = 0; j < n; ++j) {
      prefetch_as_read(queue, 16 * V * static_cast<int64_t>(sizeof(R)));
      __m512 row[V];
      for (int64_t v = 0; v < V; ++v) row[v] = load16(values[j] + d + 16 * v);
      for (int64_t l = 0; l < L; ++l) {
        const __m512 pj = _mm512_set1_ps(p[l][j]);
        for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_fmadd_ps(pj, row[v], a[l][v]);
      }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(acc[l] + d + 16 * v, a[l][v]);
  }
  template <typename R>
  static void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const R* const* values,
                               int64_t n, int64_t dim) {
    int64_t l = 0;
    for (; l + 4 <= count; l += 4) accumulate_vectors<Avx512Math, 4, R>(acc + l, p + l, values, n, dim);
    switch (count - l) {
      case 3: return accumulate_vectors<Avx512Math, 3, R>(acc + l, p + l, values, n, dim);
      case 2: return accumulate_vectors<Avx512Math, 2, R>(acc + l, p + l, values, n, dim);
      case 1: return accumulate_vectors<Avx512Math, 1, R>(acc + l, p + l, values, n, dim);
      default: return;
    }
  }
  // float16 rows (a float16 cache under float32 queries) are read as stored where a few lanes (a
  // decode's query heads of one kv head) use each row once or twice: each load widened in registers
  // (vcvtph2ps) instead of the block widened into a buffer and read back. Prompt chunks' many lanes
  // read each row many times, so their block is widened once and goes the float32 way.
  static constexpr int64_t kFewLanes = 4;
  template <typename F>
  static void widened(const c10::Half* const* rows, int64_t n, int64_t dim, const F& f) {
    alignas(64) float buffer[kBlock * kMaxDim];
    std::vector<float> larger(dim > kMaxDim ? n * dim : 0);
    float* const floats = dim > kMaxDim ? larger.data() : buffer;
    const float* widened_rows[kBlock];
    widen(rows, n, dim, floats);
    for (int64_t j = 0; j < n; ++j) widened_rows[j] = floats + j * dim;
    f(static_cast<const float* const*>(widened_rows));
  }
  static void dots_lanes(const float* const* q, float* const* out, int64_t count, const c10::Half* const* keys,
                         int64_t n, int64_t dim) {
    if (count <= kFewLanes && dim <= kMaxDim)
      return by_fours(count, [&]<int64_t L>(int64_t l) { dots_few_for<L>(q + l, out + l, keys, n, dim, 1.0f); });
    widened(keys, n, dim, [&](const float* const* rows) { dots_lanes(q, out, count, rows, n, dim); });
  }
  static void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const c10::Half* const* values,
                               int64_t n, int64_t dim) {
    if (count <= kFewLanes) return accumulate_lanes<c10::Half>(acc, p, count, values, n, dim);
    widened(values, n, dim, [&](const float* const* rows) { accumulate_lanes<float>(acc, p, count, rows, n, dim); });
  }
};
