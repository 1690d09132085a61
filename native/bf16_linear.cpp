// vattn::bf16_pairs_linear: x @ weight.T (+ bias) for a few rows of bf16 activations (decode
// steps: 1 to 16 requests) on a bf16 weight stored as pairs (`[out / 16, in / 2, 16, 2]`:
// for each tile of 16 outputs, input pair by input pair, the tile's outputs side by side),
// by vdpbf16ps on AVX512_BF16.
//
// A few rows' product reads the whole weight once and does little with each byte: it is bound
// by memory. oneDNN's bf16 matmul on its packed weight streams it at ~25-32 GB/s for 1-16 rows
// here (2 threads), where the machine reads ~42. In this layout a weight vector is 16 outputs
// x one input pair: one multiply-add per row and vector, no horizontal sums, and each thread
// reads one contiguous run of tiles front to back. The products are exact in float32 and summed
// there, as oneDNN sums them; only the order of the sums differs.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kTile = 16;
constexpr int64_t kMaxRows = 16;

#if defined(__x86_64__)
#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

// Tiles [begin, end) of the output for M rows: acc[m] holds row m's 16 outputs of a tile.
template <int64_t M>
BF16 void tiles(const uint32_t* x, int64_t pairs, const c10::BFloat16* weight, const float* bias,
                c10::BFloat16* out, int64_t out_row, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    const c10::BFloat16* w = weight + t * pairs * 2 * kTile;
    __m512 acc[M];
    for (int64_t m = 0; m < M; ++m) acc[m] = bias ? _mm512_loadu_ps(bias + t * kTile) : _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      _mm_prefetch(reinterpret_cast<const char*>(w + (p + 16) * 2 * kTile), _MM_HINT_T0);
      const __m512bh v = (__m512bh)_mm512_loadu_si512(w + p * 2 * kTile);
      for (int64_t m = 0; m < M; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_set1_epi32(static_cast<int>(x[m * pairs + p])), v);
    }
    for (int64_t m = 0; m < M; ++m)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + m * out_row + t * kTile), (__m256i)_mm512_cvtneps_pbh(acc[m]));
  }
}

template <int64_t M>
void run(int64_t rows, const uint32_t* x, int64_t pairs, const c10::BFloat16* weight, const float* bias,
         c10::BFloat16* out, int64_t out_row, int64_t begin, int64_t end) {
  if constexpr (M > 1)
    if (rows < M) return run<M - 1>(rows, x, pairs, weight, bias, out, out_row, begin, end);
  tiles<M>(x, pairs, weight, bias, out, out_row, begin, end);
}
#endif

at::Tensor bf16_pairs_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == 2 && x.is_contiguous(),
              "x must be a contiguous bfloat16 CPU tensor [rows, in]");
  TORCH_CHECK(x.size(0) <= kMaxRows, "bf16_pairs_linear takes at most ", kMaxRows, " rows, got ", x.size(0));
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 4 && weight.size(2) == kTile &&
                  weight.size(3) == 2 && weight.is_contiguous() && weight.size(1) * 2 == x.size(1),
              "weight must be contiguous bfloat16 pairs [out / 16, in / 2, 16, 2] of x's inputs");
  const int64_t out_features = weight.size(0) * kTile;
  TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == out_features && bias->is_contiguous()),
              "bias must be float32 [out]");
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  if (x.size(0) == 0) return out;
#if defined(__x86_64__)
  TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "bf16_pairs_linear needs AVX512_BF16");
  const auto* rows = reinterpret_cast<const uint32_t*>(x.const_data_ptr<c10::BFloat16>());
  const float* b = bias ? bias->const_data_ptr<float>() : nullptr;
  const int64_t pairs = weight.size(1), count = x.size(0);
  at::parallel_for(0, weight.size(0), 1, [&](int64_t begin, int64_t end) {
    run<kMaxRows>(count, rows, pairs, weight.const_data_ptr<c10::BFloat16>(), b, out.mutable_data_ptr<c10::BFloat16>(),
                  out_features, begin, end);
  });
#else
  TORCH_CHECK(false, "bf16_pairs_linear needs an x86-64 CPU with AVX512_BF16");
#endif
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) { m.def("bf16_pairs_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor"); }

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("bf16_pairs_linear", &bf16_pairs_linear); }
