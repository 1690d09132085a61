// The AVX2 body of float32 tiles (vattn::tiled_linear, vattn::widened_linear): the 16 outputs of
// one tile for every row, the tile's weight stored step by step (`[steps, 16]`: for each input,
// the tile's 16 outputs side by side). A tile's 16 outputs are two 8-float vectors, so with 16
// registers a block holds kAvx2Rows rows' 12 accumulators beside the tile's two weight vectors and
// the broadcast input; the blocks run one after the other over the same tile, which the first
// reads from memory (prefetched 16 KiB ahead) and the next from cache.
#pragma once

#include <algorithm>
#include <cstdint>

#if defined(__x86_64__)
#include <immintrin.h>

namespace float_tiles {

constexpr int64_t kTile = 16;
constexpr int64_t kAvx2Rows = 6;
constexpr int64_t kAheadBytes = 16 << 10;

template <int64_t M>
__attribute__((target("avx2,fma"))) void block_avx2(const float* x, int64_t steps, const float* tile,
                                                    const float* bias, float* out, int64_t out_row) {
  const __m256 low_bias = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 high_bias = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  __m256 low[M], high[M];
  for (int64_t m = 0; m < M; ++m) low[m] = low_bias, high[m] = high_bias;
  for (int64_t s = 0; s < steps; ++s) {
    const float* vector = tile + s * kTile;
    _mm_prefetch(reinterpret_cast<const char*>(vector) + kAheadBytes, _MM_HINT_T0);
    const __m256 low_weights = _mm256_loadu_ps(vector), high_weights = _mm256_loadu_ps(vector + 8);
    for (int64_t m = 0; m < M; ++m) {
      const __m256 input = _mm256_set1_ps(x[m * steps + s]);
      low[m] = _mm256_fmadd_ps(input, low_weights, low[m]);
      high[m] = _mm256_fmadd_ps(input, high_weights, high[m]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    _mm256_storeu_ps(out + m * out_row, low[m]);
    _mm256_storeu_ps(out + m * out_row + 8, high[m]);
  }
}

template <int64_t M>
void block_of_avx2(int64_t rows, const float* x, int64_t steps, const float* tile, const float* bias, float* out,
                   int64_t out_row) {
  if constexpr (M > 1)
    if (rows < M) return block_of_avx2<M - 1>(rows, x, steps, tile, bias, out, out_row);
  block_avx2<M>(x, steps, tile, bias, out, out_row);
}

// One tile's 16 outputs (`out` points at the first row's first of them, `bias` at their 16
// biases or is null) for `count` rows of `x` (`[count, steps]`).
inline void tile_avx2(int64_t count, const float* x, int64_t steps, const float* tile, const float* bias, float* out,
                      int64_t out_row) {
  for (int64_t r = 0; r < count; r += kAvx2Rows)
    block_of_avx2<kAvx2Rows>(std::min(kAvx2Rows, count - r), x + r * steps, steps, tile, bias, out + r * out_row,
                             out_row);
}

}  // namespace float_tiles

#endif
