// The ragged kernel's AVX2 body (Avx2Math): its exp, widening of 16-bit and int8 rows, scores
// (one lane by a transposing tree over a block's keys; a few lanes at once, dots_few; many lanes
// over a transposed block) and value sums (a few lanes sharing each load of a value row).
// Included by ragged_attention.cpp inside its namespace, after kBlock and before
// attention_avx512.h, whose body uses its reduction tree.
#pragma once

// exp is Cephes' expf (fast_exp.h); x is a score minus its row's maximum, so <= 0, and is
// clamped where 2^k would leave float's normal range (e^-87 is 1.6e-38: nothing a softmax
// sum notices).

// Value sums of L lanes over `dim` floats, up to four vectors of Math::kFloats at a time
// (Math::accumulate_block<L, vectors>), from float rows (or, in the AVX-512 body, float16 ones).
template <typename Math, int64_t L, typename R = float>
void accumulate_vectors(float* const* acc, const float* const* p, const R* const* values, int64_t n, int64_t dim) {
  constexpr int64_t kFloats = Math::kFloats;
  int64_t d = 0;
  for (; d + 4 * kFloats <= dim; d += 4 * kFloats) Math::template accumulate_block<L, 4>(acc, p, values, n, d);
  switch ((dim - d) / kFloats) {
    case 3: return Math::template accumulate_block<L, 3>(acc, p, values, n, d);
    case 2: return Math::template accumulate_block<L, 2>(acc, p, values, n, d);
    case 1: return Math::template accumulate_block<L, 1>(acc, p, values, n, d);
    default: return;
  }
}

struct Avx2Math {
  static constexpr int64_t kFloats = 8;  // a vector's
  __attribute__((target("avx2,fma,f16c"))) static void widen(const c10::Half* const* rows, int64_t n, int64_t dim,
                                                            float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 8) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d));
        _mm256_storeu_ps(dst + j * dim + d, _mm256_cvtph_ps(half));
      }
  }
  __attribute__((target("avx2,fma"))) static void widen(const c10::BFloat16* const* rows, int64_t n, int64_t dim,
                                                       float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d)));
        _mm256_storeu_ps(dst + j * dim + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
  }
  __attribute__((target("avx2,fma"))) static void widen(const int8_t* const* rows, const float* scales,
                                                       const float* midpoints, int64_t n, int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j) {
      const __m256 scale = _mm256_set1_ps(scales[j]), midpoint = _mm256_set1_ps(midpoints[j]);
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[j] + d)));
        _mm256_storeu_ps(dst + j * dim + d, _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(wide), midpoint));
      }
    }
  }
  // out[i] = the sum of v[i]'s eight floats, for eight vectors: one transposing tree.
  __attribute__((target("avx2,fma"))) static __m256 sum8(const __m256* v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  __attribute__((target("avx2,fma"))) static float sum(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
  __attribute__((target("avx2,fma"))) static __m256 exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2High), x);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Low), x);
    __m256 y = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  }
  __attribute__((target("avx2,fma"))) static float top(const float* s, int64_t count) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(s + j));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float result = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    for (; j < count; ++j) result = std::max(result, s[j]);
    return result;
  }
  // Whole vectors by plain loads and stores, the tail (< 8) masked: AMD runs vmaskmovps stores
  // microcoded, and with every vector masked they took 40% of a prefill's softmax.
  __attribute__((target("avx2,fma"))) static float exp_sum(float* s, int64_t count, float top) {
    const __m256 shift = _mm256_set1_ps(top);
    __m256 total = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) {
      const __m256 e = exp(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
      _mm256_storeu_ps(s + j, e);
      total = _mm256_add_ps(total, e);
    }
    if (j < count) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count - j)),
                                              _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      const __m256 e = exp(_mm256_sub_ps(_mm256_maskload_ps(s + j, live), shift));
      _mm256_maskstore_ps(s + j, live, e);
      total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(live)));
    }
    return sum(total);
  }

  // Scores and value sums for several lanes at once: a prefill tile's rows x a kv head's query
  // heads, or a decode's few query heads of one kv head. Few lanes (dots_few): each key row is
  // loaded once for all of them, four keys at a time, and a lane's four sums come out of one
  // hadd tree. Many lanes: the block's keys are transposed once, 8 x 8 at a time, so that a
  // lane's 16 scores are two vectors, dimension by dimension, and kLanes lanes share each load
  // of a transposed row. Value sums: many lanes go kLanes at a time over two vectors of a value
  // row (the projections' 6 x 16 shape: 12 sums, the row's two vectors, a broadcast weight), a few
  // lanes up to three at a time over up to four vectors. Missing
  // keys of a short block read key 0 and their results are dropped. Broadcasts are written
  // _mm256_set1_ps(*p), never _mm256_broadcast_ss(p): with that builtin in a loop GCC 12 keeps the
  // accumulator arrays in memory too and stores every one of them at each step.
  static constexpr int64_t kMaxDim = 512;  // the transposed block's buffer; larger dims take dots_few
  static constexpr int64_t kLanes = 6;     // lanes per pass over a transposed block: 12 sums of 16 registers
  // The sums of four vectors' eight floats each, in order.
  __attribute__((target("avx2,fma"))) static __m128 sum4(const __m256* v) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
  }
  template <int64_t L>
  __attribute__((target("avx2,fma"))) static void dots_few(const float* const* q, float* const* out,
                                                           const float* const* keys, int64_t n, int64_t dim) {
    alignas(32) float found[L][kBlock];
    for (int64_t g = 0; 4 * g < n; ++g) {
      const float* rows[4];
      for (int64_t i = 0; i < 4; ++i) rows[i] = keys[4 * g + i < n ? 4 * g + i : 0];
      __m256 sums[L][4];
      for (int64_t l = 0; l < L; ++l)
        for (int64_t i = 0; i < 4; ++i) sums[l][i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8)
        for (int64_t i = 0; i < 4; ++i) {
          const __m256 k = _mm256_loadu_ps(rows[i] + d);  // the queries are loaded again (12 sums of 16 registers)
          for (int64_t l = 0; l < L; ++l) sums[l][i] = _mm256_fmadd_ps(_mm256_loadu_ps(q[l] + d), k, sums[l][i]);
        }
      for (int64_t l = 0; l < L; ++l) _mm_store_ps(found[l] + 4 * g, sum4(sums[l]));
    }
    for (int64_t l = 0; l < L; ++l) std::copy_n(found[l], n, out[l]);
  }
  // kt[i * kBlock + j] = rows[j][d + i] for i, j < 8.
  __attribute__((target("avx2,fma"))) static void transpose8(const float* const* rows, int64_t d, float* kt) {
    __m256 r[8], t[8], u[8];
    for (int64_t j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(rows[j] + d);
    for (int64_t j = 0; j < 8; j += 2) {
      t[j] = _mm256_unpacklo_ps(r[j], r[j + 1]);
      t[j + 1] = _mm256_unpackhi_ps(r[j], r[j + 1]);
    }
    // u[4 h + c]: rows 4 h .. 4 h + 3 of columns c (low half) and c + 4 (high half).
    for (int64_t h = 0; h < 2; ++h) {
      u[4 * h] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0x44);
      u[4 * h + 1] = _mm256_shuffle_ps(t[4 * h], t[4 * h + 2], 0xEE);
      u[4 * h + 2] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0x44);
      u[4 * h + 3] = _mm256_shuffle_ps(t[4 * h + 1], t[4 * h + 3], 0xEE);
    }
    for (int64_t c = 0; c < 4; ++c) {
      _mm256_storeu_ps(kt + c * kBlock, _mm256_permute2f128_ps(u[c], u[4 + c], 0x20));
      _mm256_storeu_ps(kt + (c + 4) * kBlock, _mm256_permute2f128_ps(u[c], u[4 + c], 0x31));
    }
  }
  template <int64_t L>
  __attribute__((target("avx2,fma"))) static void dots_transposed(const float* const* q, float* const* out,
                                                                  const float* kt, int64_t n, int64_t dim) {
    __m256 low[L], high[L];
    for (int64_t l = 0; l < L; ++l) low[l] = high[l] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m256 first = _mm256_loadu_ps(kt + d * kBlock), second = _mm256_loadu_ps(kt + d * kBlock + 8);
      for (int64_t l = 0; l < L; ++l) {
        const __m256 input = _mm256_set1_ps(q[l][d]);
        low[l] = _mm256_fmadd_ps(input, first, low[l]);
        high[l] = _mm256_fmadd_ps(input, second, high[l]);
      }
    }
    for (int64_t l = 0; l < L; ++l) {
      alignas(32) float found[kBlock];
      _mm256_store_ps(found, low[l]);
      _mm256_store_ps(found + 8, high[l]);
      std::copy_n(found, n, out[l]);
    }
  }
  template <int64_t L>
  static void dots_transposed_left(const float* const* q, float* const* out, int64_t count, const float* kt, int64_t n,
                                   int64_t dim) {
    if constexpr (L > 0) {
      if (count == L) return dots_transposed<L>(q, out, kt, n, dim);
      dots_transposed_left<L - 1>(q, out, count, kt, n, dim);
    }
  }
  // fn.template operator()<L>(l) for lanes l .. l + L - 1, L <= 3, over `count` lanes.
  template <typename Few>
  static void by_threes(int64_t count, const Few& few) {
    for (int64_t l = 0; l < count; l += 3) switch (std::min<int64_t>(3, count - l)) {
        case 3: few.template operator()<3>(l); break;
        case 2: few.template operator()<2>(l); break;
        default: few.template operator()<1>(l); break;
      }
  }
  static void dots_lanes(const float* const* q, float* const* out, int64_t count, const float* const* keys, int64_t n,
                         int64_t dim) {
    if (count < kLanes || dim > kMaxDim)
      return by_threes(count, [&]<int64_t L>(int64_t l) { dots_few<L>(q + l, out + l, keys, n, dim); });
    const float* rows[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) rows[j] = keys[j < n ? j : 0];
    alignas(32) float kt[kMaxDim * kBlock];
    for (int64_t d = 0; d < dim; d += 8) {
      transpose8(rows, d, kt + d * kBlock);
      transpose8(rows + 8, d, kt + d * kBlock + 8);
    }
    int64_t l = 0;
    for (; l + kLanes <= count; l += kLanes) dots_transposed<kLanes>(q + l, out + l, kt, n, dim);
    dots_transposed_left<kLanes - 1>(q + l, out + l, count - l, kt, n, dim);
  }
  // Not inlined: inside attend's loop GCC spilled the 6 x 2 block's sums to the stack at every key.
  template <int64_t L, int64_t V>
  __attribute__((target("avx2,fma"), noinline)) static void accumulate_block(float* const* acc, const float* const* p,
                                                                   const float* const* values, int64_t n, int64_t d) {
    __m256 a[L][V];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) a[l][v] = _mm256_loadu_ps(acc[l] + d + 8 * v);
    for (int64_t j = 0; j < n; ++j) {
      if constexpr (L * V + V + 1 <= 16) {  // the row's vectors in registers, one lane's weight at a time
        __m256 row[V];
        for (int64_t v = 0; v < V; ++v) row[v] = _mm256_loadu_ps(values[j] + d + 8 * v);
        for (int64_t l = 0; l < L; ++l) {
          const __m256 weight = _mm256_set1_ps(p[l][j]);
          for (int64_t v = 0; v < V; ++v) a[l][v] = _mm256_fmadd_ps(weight, row[v], a[l][v]);
        }
      } else {
        __m256 weight[L];
        for (int64_t l = 0; l < L; ++l) weight[l] = _mm256_set1_ps(p[l][j]);
        for (int64_t v = 0; v < V; ++v) {
          const __m256 row = _mm256_loadu_ps(values[j] + d + 8 * v);
          for (int64_t l = 0; l < L; ++l) a[l][v] = _mm256_fmadd_ps(weight[l], row, a[l][v]);
        }
      }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) _mm256_storeu_ps(acc[l] + d + 8 * v, a[l][v]);
  }
  static void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const float* const* values,
                               int64_t n, int64_t dim) {
    int64_t l = 0;
    for (; l + kLanes <= count; l += kLanes) {  // many lanes (a prefill tile's): kLanes x 2 vectors, 12 sums
      int64_t d = 0;
      for (; d + 16 <= dim; d += 16) accumulate_block<kLanes, 2>(acc + l, p + l, values, n, d);
      if (d < dim) accumulate_block<kLanes, 1>(acc + l, p + l, values, n, d);
    }
    by_threes(count - l, [&]<int64_t L>(int64_t k) {
      accumulate_vectors<Avx2Math, L>(acc + l + k, p + l + k, values, n, dim);
    });
  }
};
