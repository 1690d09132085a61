// vattn::tiled_linear: x @ weight.T (+ bias) for a few rows of activations (decode steps of up to
// serving.model.linear.TILED_ROWS requests), float32 or bf16, on a copy of the weight stored in
// tiles of 16 outputs (`[out / 16, in / step, 16, step]`: for each tile, input step by input step,
// the tile's 16 outputs side by side; step 2 for bf16, whose pairs vdpbf16ps multiplies, 1 for
// float32).
//
// A few rows' product reads the whole weight once and does little with each byte: it is bound by
// memory. oneDNN's matmul on its packed weight streams it at ~25-38 GB/s for 1-16 rows here (2
// threads), and each call costs it ~20 us besides. In this layout one weight vector is a tile's 16
// outputs for one step of inputs: one multiply-add per row and vector, no horizontal sums, and each
// thread reads one contiguous run of tiles front to back, prefetched 16 KiB ahead (at 16 KiB the
// multiply-adds of 16 rows overlap the stream; at 1 KiB they alternated with it, 1.45x slower).
// Rows go in blocks whose accumulators fit the register file (see tile_range), each tile's blocks
// one after the other, so that the tile is read from memory once and from cache for the next
// blocks. Products are summed in float32 (bf16's exactly), as oneDNN sums them; only the order of
// the sums differs. On AVX2 (float32 only) a tile is two 8-float vectors and a block 6 rows; there
// oneDNN's matmul runs these shapes well below the FMA units' rate up to 128 rows, and the tiles
// nearer it (benchmarks/results/avx2/few_rows.*).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include "float_tiles.h"
#include "widest_simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

// GCC 12's AVX-512 intrinsics headers trip these (as in ragged_attention.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kRows = 16;      // rows of one tile at a time: 16 accumulators
constexpr int64_t kPairRows = 12;  // rows of two tiles at a time: 24 accumulators
// bf16 calls of more rows than this multiply widened where `widen` asks (a CPU whose vdpbf16ps
// runs at half its FMAs' rate): up to it the stream binds and vdpbf16ps does fewer operations;
// past it, widened, 1.1-1.2x at 10-20 rows (the default model's 30 layers, alternating builds).
constexpr int64_t kDotRows = 8;
constexpr int64_t kAheadBytes = 16 << 10;

#if defined(__x86_64__)
#define TILED __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Tiles t to t + N - 1 of the output for M rows of T: acc[n][m] holds row m's 16 outputs of
// tile t + n. `x` holds each row's steps as 32-bit words (a float, or a bf16 pair), or where
// Widen (bf16 only) each row's inputs as floats: the tile's bf16 pairs are widened to two float
// vectors in registers and multiplied by FMAs, for CPUs whose vdpbf16ps runs at less than their
// FMAs' rate (an Intel Xeon without AMX: serving.model.cpu_features.bf16_widened; there they
// take calls of more than kDotRows rows, and short prompts: serving.model.linear.WIDENED_BF16_TILED_ROWS).
template <int64_t N, int64_t M, typename T, bool Widen>
TILED void tiles(const uint32_t* x, int64_t steps, const T* weight, const float* bias, T* out, int64_t out_row,
                 int64_t t) {
  const int64_t x_row = Widen ? 2 * steps : steps;  // 32-bit words of one row of x
  constexpr int64_t kVector = 64 / sizeof(T);  // a tile's values for one step
  const T* w = weight + t * steps * kVector;
  __m512 acc[N][M];
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      acc[n][m] = bias ? _mm512_loadu_ps(bias + (t + n) * kTile) : _mm512_setzero_ps();
  for (int64_t s = 0; s < steps; ++s) {
    // Each branch loads its own weight vectors: with one array of them declared for both, GCC 12
    // stored every accumulator to the stack on every step of the widening loop.
    if constexpr (Widen) {
      __m512 even[N], odd[N];  // each pair's first and second weight as floats
      for (int64_t n = 0; n < N; ++n) {
        const T* vector = w + (n * steps + s) * kVector;
        _mm_prefetch(reinterpret_cast<const char*>(vector) + kAheadBytes, _MM_HINT_T0);
        const __m512i pairs = _mm512_loadu_si512(vector);
        even[n] = _mm512_castsi512_ps(_mm512_slli_epi32(pairs, 16));
        odd[n] = _mm512_castsi512_ps(_mm512_maskz_mov_epi16(0xAAAAAAAA, pairs));
      }
      for (int64_t m = 0; m < M; ++m) {
        const float* inputs = reinterpret_cast<const float*>(x) + m * x_row + 2 * s;
        const __m512 first = _mm512_set1_ps(inputs[0]), second = _mm512_set1_ps(inputs[1]);
        for (int64_t n = 0; n < N; ++n)
          acc[n][m] = _mm512_fmadd_ps(second, odd[n], _mm512_fmadd_ps(first, even[n], acc[n][m]));
      }
    } else {
      __m512 v[N];
      for (int64_t n = 0; n < N; ++n) {
        const T* vector = w + (n * steps + s) * kVector;
        _mm_prefetch(reinterpret_cast<const char*>(vector) + kAheadBytes, _MM_HINT_T0);
        v[n] = _mm512_loadu_ps(vector);
      }
      for (int64_t m = 0; m < M; ++m) {
        const uint32_t input = x[m * x_row + s];  // broadcast from memory into the multiply-adds
        for (int64_t n = 0; n < N; ++n) {
          if constexpr (std::is_same_v<T, float>)
            acc[n][m] = _mm512_fmadd_ps(_mm512_set1_ps(std::bit_cast<float>(input)), v[n], acc[n][m]);
          else
            acc[n][m] =
                _mm512_dpbf16_ps(acc[n][m], (__m512bh)_mm512_set1_epi32(static_cast<int>(input)), (__m512bh)v[n]);
        }
      }
    }
  }
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m) {
      T* dst = out + m * out_row + (t + n) * kTile;
      if constexpr (std::is_same_v<T, float>)
        _mm512_storeu_ps(dst, acc[n][m]);
      else
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), (__m256i)_mm512_cvtneps_pbh(acc[n][m]));
    }
}

template <int64_t N, int64_t M, typename T, bool Widen>
void run(int64_t rows, const uint32_t* x, int64_t steps, const T* weight, const float* bias, T* out, int64_t out_row,
         int64_t t) {
  if constexpr (M > 1)
    if (rows < M) return run<N, M - 1, T, Widen>(rows, x, steps, weight, bias, out, out_row, t);
  tiles<N, M, T, Widen>(x, steps, weight, bias, out, out_row, t);
}

// Tiles [begin, end) for `count` rows, each tile (or pair) read from memory once and from cache
// for the rows' next blocks: one tile at a time in blocks of 16 rows; or, past 16 float32 rows
// and for widened bf16, where the multiply-adds rather than the stream bound it, two tiles at a
// time in blocks of up to 12, as even as the count allows (two weight vectors per broadcast
// input; 1.1-1.2x at 32-64 rows, and no faster for vdpbf16ps).
template <typename T, bool Widen>
void tile_range(int64_t count, const uint32_t* x, int64_t steps, const T* weight, const float* bias, T* out,
                int64_t out_row, int64_t begin, int64_t end) {
  const int64_t x_row = Widen ? 2 * steps : steps;
  int64_t t = begin;
  if constexpr (std::is_same_v<T, float> || Widen)
    if (Widen || count > kRows) {
      const int64_t blocks = (count + kPairRows - 1) / kPairRows, block = (count + blocks - 1) / blocks;
      for (; t + 1 < end; t += 2)
        for (int64_t r = 0; r < count; r += block)
          run<2, kPairRows, T, Widen>(std::min(block, count - r), x + r * x_row, steps, weight, bias,
                                      out + r * out_row, out_row, t);
    }
  for (; t < end; ++t)
    for (int64_t r = 0; r < count; r += kRows)
      run<1, kRows, T, Widen>(std::min(kRows, count - r), x + r * x_row, steps, weight, bias, out + r * out_row,
                              out_row, t);
}

// The AVX2 body, float32 only (bf16 pairs need AVX512_BF16): native/float_tiles.h.
void tile_range_avx2(int64_t count, const float* x, int64_t steps, const float* weight, const float* bias, float* out,
                     int64_t out_row, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t)
    float_tiles::tile_avx2(count, x, steps, weight + t * steps * kTile, bias ? bias + t * kTile : nullptr,
                           out + t * kTile, out_row);
}
#endif

at::Tensor tiled_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                        bool widen) {
  const bool bf16 = x.scalar_type() == at::kBFloat16;
  const int64_t step = bf16 ? 2 : 1;
  TORCH_CHECK(x.device().is_cpu() && (bf16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous float32 or bfloat16 CPU tensor [rows, in]");
  TORCH_CHECK(weight.device().is_cpu() && weight.scalar_type() == x.scalar_type() && weight.dim() == 4 &&
                  weight.size(2) == kTile &&
                  weight.size(3) == step && weight.is_contiguous() && weight.size(1) * step == x.size(1),
              "weight must be contiguous CPU tiles [out / 16, in / ", step, ", 16, ", step, "] of x's dtype and inputs");
  const int64_t out_features = weight.size(0) * kTile;
  TORCH_CHECK(!bias || (bias->device().is_cpu() && bias->scalar_type() == at::kFloat && bias->numel() == out_features &&
                        bias->is_contiguous()),
              "bias must be a float32 CPU tensor [out]");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__x86_64__)
  const std::string& simd = widest_simd();
  TORCH_CHECK(bf16 ? simd == "avx512" && __builtin_cpu_supports("avx512bf16") : simd != "scalar",
              "tiled_linear needs AVX2 (bfloat16: AVX512_BF16)");
  const float* b = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t steps = weight.size(1), count = x.size(0);
  if (simd == "avx2") {
    const float* rows = x.const_data_ptr<float>();
    at::parallel_for(0, weight.size(0), 1, [&](int64_t begin, int64_t end) {
      tile_range_avx2(count, rows, steps, weight.const_data_ptr<float>(), b, out.mutable_data_ptr<float>(),
                      out_features, begin, end);
    });
    return out;
  }
  if (bf16 && widen && count > kDotRows) {
    const at::Tensor inputs = x.to(at::kFloat);
    const auto* rows = reinterpret_cast<const uint32_t*>(inputs.const_data_ptr<float>());
    at::parallel_for(0, weight.size(0), 1, [&](int64_t begin, int64_t end) {
      tile_range<c10::BFloat16, true>(count, rows, steps, weight.const_data_ptr<c10::BFloat16>(), b,
                                      out.mutable_data_ptr<c10::BFloat16>(), out_features, begin, end);
    });
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "tiled_linear", [&] {
    const auto* rows = reinterpret_cast<const uint32_t*>(x.const_data_ptr<scalar_t>());
    at::parallel_for(0, weight.size(0), 1, [&](int64_t begin, int64_t end) {
      if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>)
        tile_range<scalar_t, false>(count, rows, steps, weight.const_data_ptr<scalar_t>(), b,
                                    out.mutable_data_ptr<scalar_t>(), out_features, begin, end);
    });
  });
#else
  TORCH_CHECK(false, "tiled_linear needs an x86-64 CPU with AVX2");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) { m.def("tiled_linear(Tensor x, Tensor weight, Tensor? bias, bool widen=False) -> Tensor"); }

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("tiled_linear", &tiled_linear); }
