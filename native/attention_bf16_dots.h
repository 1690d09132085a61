// The ragged kernel's body for bfloat16 queries over a bfloat16 cache on a CPU with
// AVX512_BF16: scores and value sums by vdpbf16ps (two bf16 products summed into a float32
// lane) straight from the cache's rows, never widened to float32 first, at half the
// instructions of the float32 body's FMAs. Included by ragged_attention.cpp after its
// AVX-512 body, which it extends: its softmax, 16 x 16 transpose and reduction tree.
//
// What rounds where: queries and keys are bf16 already and their products are exact; the
// softmax (maxima, exp, sums) stays float32; the probabilities are rounded to bf16 for the
// value sums only, as FlashAttention does on a GPU. Rows are read in pairs of bf16 values
// as 32-bit lanes: `dim` must be a multiple of 32 (`fits`).
#pragma once

struct Avx512Bf16Math : Avx512Math {
  static bool fits(int64_t dim) { return dim % 32 == 0 && dim <= Avx512Math::kMaxDim; }

  static const float* pairs(const c10::BFloat16* row) { return reinterpret_cast<const float*>(row); }

  // L lanes against a block whose keys were transposed as pairs: kt[p * 16 + j] holds key j's
  // values 2p and 2p + 1, so each lane's 16 scores are one vector and a broadcast query pair.
  template <int64_t L>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void dots_transposed(
      const c10::BFloat16* const* q, float* const* out, const float* kt, __mmask16 live, int64_t dim, float scale) {
    __m512 sums[L];
    for (int64_t l = 0; l < L; ++l) sums[l] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / 2; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_ps(kt + p * 16);
      for (int64_t l = 0; l < L; ++l)
        sums[l] = _mm512_dpbf16_ps(sums[l], (__m512bh)_mm512_set1_ps(pairs(q[l])[p]), k);
    }
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t l = 0; l < L; ++l) _mm512_mask_storeu_ps(out[l], live, _mm512_mul_ps(factor, sums[l]));
  }
  template <int64_t L>
  static void dots_transposed_left(const c10::BFloat16* const* q, float* const* out, int64_t count, const float* kt,
                                   __mmask16 live, int64_t dim, float scale) {
    if constexpr (L > 0) {
      if (count == L) return dots_transposed<L>(q, out, kt, live, dim, scale);
      dots_transposed_left<L - 1>(q, out, count, kt, live, dim, scale);
    }
  }
  // One block (n <= kBlock keys).
  static void dots_block(const c10::BFloat16* const* q, float* const* out, int64_t count,
                         const c10::BFloat16* const* keys, int64_t n, int64_t dim, float scale) {
    constexpr int64_t kLanes = 8;
    if (count < kLanes)
      return by_fours(count, [&]<int64_t L>(int64_t l) { dots_few_for<L>(q + l, out + l, keys, n, dim, scale); });
    const float* rows[kBlock];
    for (int64_t j = 0; j < n; ++j) rows[j] = pairs(keys[j]);
    alignas(64) float kt[Avx512Math::kMaxDim / 2 * 16];
    for (int64_t p = 0; p < dim / 2; p += 16) Avx512Math::transpose16(rows, n, p, kt + p * 16);
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    int64_t l = 0;
    for (; l + kLanes <= count; l += kLanes) dots_transposed<kLanes>(q + l, out + l, kt, live, dim, scale);
    dots_transposed_left<kLanes - 1>(q + l, out + l, count - l, kt, live, dim, scale);
  }

  // Two full blocks at once (keys[0..32)): each broadcast query pair feeds two key vectors, so
  // a lane's pair is loaded once per 32 keys, not per 16 (the single-block loop loads nine
  // values for eight multiply-adds, and loads bound it).
  template <int64_t L>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void dots_transposed2(
      const c10::BFloat16* const* q, float* const* out, const float* kt, const float* kt2, int64_t dim, float scale) {
    __m512 first[L], second[L];
    for (int64_t l = 0; l < L; ++l) first[l] = second[l] = _mm512_setzero_ps();
    for (int64_t p = 0; p < dim / 2; ++p) {
      const __m512bh k = (__m512bh)_mm512_loadu_ps(kt + p * 16), k2 = (__m512bh)_mm512_loadu_ps(kt2 + p * 16);
      for (int64_t l = 0; l < L; ++l) {
        const __m512bh pair = (__m512bh)_mm512_set1_ps(pairs(q[l])[p]);
        first[l] = _mm512_dpbf16_ps(first[l], pair, k);
        second[l] = _mm512_dpbf16_ps(second[l], pair, k2);
      }
    }
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t l = 0; l < L; ++l) {
      _mm512_storeu_ps(out[l], _mm512_mul_ps(factor, first[l]));
      _mm512_storeu_ps(out[l] + kBlock, _mm512_mul_ps(factor, second[l]));
    }
  }
  // `count` lanes' scores against n keys: one block, or two full ones (n = 2 * kBlock).
  static void dots_lanes(const c10::BFloat16* const* q, float* const* out, int64_t count,
                         const c10::BFloat16* const* keys, int64_t n, int64_t dim, float scale) {
    constexpr int64_t kLanes = 8;
    if (n <= kBlock) return dots_block(q, out, count, keys, n, dim, scale);
    if (count < kLanes) {
      dots_block(q, out, count, keys, kBlock, dim, scale);
      float* second[kLanes];
      for (int64_t l = 0; l < count; ++l) second[l] = out[l] + kBlock;
      dots_block(q, second, count, keys + kBlock, kBlock, dim, scale);
      return;
    }
    const float* rows[2 * kBlock];
    for (int64_t j = 0; j < 2 * kBlock; ++j) rows[j] = pairs(keys[j]);
    alignas(64) float kt[Avx512Math::kMaxDim / 2 * 16], kt2[Avx512Math::kMaxDim / 2 * 16];
    for (int64_t p = 0; p < dim / 2; p += 16) {
      Avx512Math::transpose16(rows, kBlock, p, kt + p * 16);
      Avx512Math::transpose16(rows + kBlock, kBlock, p, kt2 + p * 16);
    }
    int64_t l = 0;
    for (; l + kLanes <= count; l += kLanes) dots_transposed2<kLanes>(q + l, out + l, kt, kt2, dim, scale);
    float* second[kLanes];
    for (int64_t i = l; i < count; ++i) second[i - l] = out[i] + kBlock;
    dots_transposed_left<kLanes - 1>(q + l, out + l, count - l, kt, 0xFFFF, dim, scale);
    dots_transposed_left<kLanes - 1>(q + l, second, count - l, kt2, 0xFFFF, dim, scale);
  }

  // The block's values with keys 2k and 2k + 1 interleaved: packed[(k * dim / 16 + c) * 32 + 2i + s]
  // is value row 2k + s at column 16c + i (a missing last row reads as zeros).
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void pack_values(
      const c10::BFloat16* const* values, int64_t n, int64_t dim, c10::BFloat16* packed) {
    for (int64_t k = 0; 2 * k < n; ++k)
      for (int64_t c = 0; c < dim / 16; ++c) {
        const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[2 * k] + 16 * c));
        const __m256i second = 2 * k + 1 < n
                                   ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(values[2 * k + 1] + 16 * c))
                                   : _mm256_setzero_si256();
        _mm512_storeu_si512(packed + (k * dim / 16 + c) * 32, interleave_pairs(first, second));
      }
  }
  // acc[l] += the block's probabilities p[l] (rounded to bf16 in pairs) times the packed values,
  // for L lanes and V columns of 16 from column 16 * first.
  template <int64_t L, int64_t V>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void accumulate_block(
      float* const* acc, const uint32_t (*p)[kBlock], const c10::BFloat16* packed, int64_t pairs_count, int64_t dim,
      int64_t first) {
    __m512 a[L][V];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_loadu_ps(acc[l] + 16 * (first + v));
    for (int64_t k = 0; k < pairs_count; ++k) {
      __m512bh row[V];
      for (int64_t v = 0; v < V; ++v)
        row[v] = (__m512bh)_mm512_loadu_si512(packed + (k * dim / 16 + first + v) * 32);
      for (int64_t l = 0; l < L; ++l) {
        const __m512bh pk = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[l][k]));
        for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_dpbf16_ps(a[l][v], pk, row[v]);
      }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(acc[l] + 16 * (first + v), a[l][v]);
  }
  template <int64_t L>
  static void accumulate_lanes_of(float* const* acc, const uint32_t (*p)[kBlock], const c10::BFloat16* packed,
                                  int64_t pairs_count, int64_t dim) {
    int64_t c = 0;
    for (; c + 4 <= dim / 16; c += 4) accumulate_block<L, 4>(acc, p, packed, pairs_count, dim, c);
    if (dim / 16 - c == 2) accumulate_block<L, 2>(acc, p, packed, pairs_count, dim, c);  // dim % 32 == 0: 0 or 2 left
  }
  // Lanes' probabilities for n <= 2 * kBlock keys rounded to bf16, two keys to a 32-bit pair
  // (key 2k in the low half), as vdpbf16ps takes them.
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void round_pairs(
      const float* const* p, int64_t lanes, int64_t n, uint32_t (*rounded)[kBlock]) {
    for (int64_t i = 0; i < lanes; ++i)
      for (int64_t first = 0; first < n; first += 16) {
        const int64_t left = n - first;
        const __mmask16 live = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(rounded[i] + first / 2),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(live, p[i] + first)));
      }
  }
  // accumulate_block for L <= 4 lanes (a decode's query heads per kv head), too few to pay for
  // pack_values: each pair of value rows is interleaved in registers (vpunpcklwd/vpunpckhwd),
  // C chunks of 32 columns from column `first`. Interleaved so, a chunk's products land in
  // columns {0-3, 8-11, 16-19, 24-27} and {4-7, 12-15, 20-23, 28-31}: the accumulators are
  // loaded into that order and stored back out of it.
  template <int64_t L, int64_t C>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void accumulate_few(
      float* const* acc, const uint32_t (*p)[kBlock], const c10::BFloat16* const* values, int64_t n, int64_t first) {
    const __m512i low_columns = _mm512_setr_epi32(0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27);
    const __m512i high_columns = _mm512_setr_epi32(4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
    const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    __m512 a[L][C][2];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t c = 0; c < C; ++c) {
        const __m512 lo = _mm512_loadu_ps(acc[l] + first + 32 * c), hi = _mm512_loadu_ps(acc[l] + first + 32 * c + 16);
        a[l][c][0] = _mm512_permutex2var_ps(lo, low_columns, hi);
        a[l][c][1] = _mm512_permutex2var_ps(lo, high_columns, hi);
      }
    const auto* zeros = reinterpret_cast<const c10::BFloat16*>(kZeroRow);
    PrefetchQueue* const queue = prefetch_queue;
    for (int64_t k = 0; 2 * k < n; ++k) {
      prefetch_as_read(queue, 2 * 32 * C * static_cast<int64_t>(sizeof(c10::BFloat16)));
      const c10::BFloat16* even = values[2 * k];
      const c10::BFloat16* odd = 2 * k + 1 < n ? values[2 * k + 1] : zeros;
      __m512bh rows[C][2];
      for (int64_t c = 0; c < C; ++c) {
        const __m512i x = _mm512_loadu_si512(even + first + 32 * c), y = _mm512_loadu_si512(odd + first + 32 * c);
        rows[c][0] = (__m512bh)_mm512_unpacklo_epi16(x, y);
        rows[c][1] = (__m512bh)_mm512_unpackhi_epi16(x, y);
      }
      for (int64_t l = 0; l < L; ++l) {
        const __m512bh pk = (__m512bh)_mm512_set1_epi32(static_cast<int>(p[l][k]));
        for (int64_t c = 0; c < C; ++c)
          for (int64_t h = 0; h < 2; ++h) a[l][c][h] = _mm512_dpbf16_ps(a[l][c][h], pk, rows[c][h]);
      }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int64_t c = 0; c < C; ++c) {
        _mm512_storeu_ps(acc[l] + first + 32 * c, _mm512_permutex2var_ps(a[l][c][0], first_half, a[l][c][1]));
        _mm512_storeu_ps(acc[l] + first + 32 * c + 16, _mm512_permutex2var_ps(a[l][c][0], second_half, a[l][c][1]));
      }
  }
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void accumulate_lanes(
      float* const* acc, const float* const* p, int64_t count, const c10::BFloat16* const* values, int64_t n,
      int64_t dim) {
    // n <= 2 * kBlock: two blocks' values at once halve the accumulators' loads and stores.
    if (count <= 4) {
      uint32_t rounded[4][kBlock];
      round_pairs(p, count, n, rounded);
      return by_fours(count, [&]<int64_t L>(int64_t) {
        int64_t first = 0;
        for (; first + 64 <= dim; first += 64) accumulate_few<L, 2>(acc, rounded, values, n, first);
        if (first < dim) accumulate_few<L, 1>(acc, rounded, values, n, first);  // dim % 32 == 0
      });
    }
    alignas(64) c10::BFloat16 packed[kBlock * Avx512Math::kMaxDim * 2];
    pack_values(values, n, dim, packed);
    const int64_t pairs_count = (n + 1) / 2;
    for (int64_t l = 0; l < count; l += 4) {
      const int64_t lanes = std::min<int64_t>(4, count - l);
      uint32_t rounded[4][kBlock];
      round_pairs(p + l, lanes, n, rounded);
      switch (lanes) {
        case 4: accumulate_lanes_of<4>(acc + l, rounded, packed, pairs_count, dim); break;
        case 3: accumulate_lanes_of<3>(acc + l, rounded, packed, pairs_count, dim); break;
        case 2: accumulate_lanes_of<2>(acc + l, rounded, packed, pairs_count, dim); break;
        default: accumulate_lanes_of<1>(acc + l, rounded, packed, pairs_count, dim); break;
      }
    }
  }
};
