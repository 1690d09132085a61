// vattn::rms_norm and vattn::add_rms_norm: a Llama RMSNorm in one pass over each row, and
// the residual add before it fused in (residual += x, then the norm of residual), as vLLM's
// fused_add_rms_norm. torch's own rms_norm runs as ~7 operators on the CPU (pow, mean, add,
// rsqrt, mul, ...), which at batch 1 costs more than the norm's arithmetic: ~30 us a call,
// two calls a layer.
//
// Numerics follow transformers' LlamaRMSNorm: the row is normalized in float32, rounded to
// the input dtype, then scaled by the weight.
//
// add_rms_norm's residual may be float32 under a 16-bit x: the model runner keeps a bfloat16
// model's residual stream in float32 (serving.model.runner), and the norm then reads it as
// LlamaRMSNorm reads a float32 input, writing its output in x's dtype.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <optional>

#include "narrow_floats.h"
#include "widest_simd.h"

namespace {

// Row r of S normed into row r of T (S is T, or float32 under a 16-bit T); with `x`, x's row is
// first added into the source row (residual += x, rounded to S), in the same pass while the row
// is in L1: a second pass over a prompt step's residual stream cost its reads again. Inlined
// into each body below, so it vectorizes for the body's target.
template <typename S, typename T>
[[gnu::always_inline]] inline void norm_row(S* row, const T* x, T* out, const T* weight, int64_t width, double eps) {
  float squares = 0.0f;
  if (x != nullptr) {
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) {
      const S sum = narrow<S>(widen(row[i]) + widen(x[i]));
      row[i] = sum;
      squares += widen(sum) * widen(sum);
    }
  } else {
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < width; ++i) squares += widen(row[i]) * widen(row[i]);
  }
  const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = narrow<T>(widen(weight[i]) * widen(narrow<S>(widen(row[i]) * inverse)));
}

// Rows [begin, end), inlined into each body below: at the build's baseline ISA (AVX2 on x86), or
// AVX-512's 16-float vectors where widest_simd() allows.
template <typename S, typename T>
[[gnu::always_inline]] inline void norm_span(S* src, int64_t src_stride, const T* x, T* dst, const T* weight,
                                             int64_t begin, int64_t end, int64_t width, double eps) {
  for (int64_t r = begin; r < end; ++r)
    norm_row(src + r * src_stride, x == nullptr ? nullptr : x + r * width, dst + r * width, weight, width, eps);
}

template <typename S, typename T>
void norm_span_baseline(S* src, int64_t src_stride, const T* x, T* dst, const T* weight, int64_t begin, int64_t end,
                        int64_t width, double eps) {
  norm_span(src, src_stride, x, dst, weight, begin, end, width, eps);
}

#if defined(__x86_64__)
template <typename S, typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"))) void norm_span_avx512(
    S* src, int64_t src_stride, const T* x, T* dst, const T* weight, int64_t begin, int64_t end, int64_t width,
    double eps) {
  norm_span(src, src_stride, x, dst, weight, begin, end, width, eps);
}
#endif

template <typename S, typename T>
void norm_rows(S* src, int64_t src_stride, const T* x, T* dst, const T* weight, int64_t rows, int64_t width, double eps) {
  auto span = norm_span_baseline<S, T>;
#if defined(__x86_64__)
  if (widest_simd() == "avx512") span = norm_span_avx512<S, T>;
#endif
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    span(src, src_stride, x, dst, weight, begin, end, width, eps);
  });
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU [rows, hidden] tensor, rows dense");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device().is_cpu(),
              "weight must be a contiguous [hidden] CPU tensor of x's dtype");
}

// `src` (plus `x`, added into it first, where given) normed into a new tensor of `weight`'s
// dtype: src's dtype, or float32 under a 16-bit one.
at::Tensor norm(const at::Tensor& src, const at::Tensor* x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(weight.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_norm", [&] {
    const scalar_t* added = x == nullptr ? nullptr : x->const_data_ptr<scalar_t>();
    auto rows = [&]<typename S>(S* data) {
      norm_rows<S, scalar_t>(data, src.stride(0), added, out.mutable_data_ptr<scalar_t>(),
                             weight.const_data_ptr<scalar_t>(), src.size(0), src.size(1), eps);
    };
    // rms_norm never writes its source (x is null there): the const_cast only serves the shared loop.
    if (src.scalar_type() == weight.scalar_type())
      rows(const_cast<scalar_t*>(src.const_data_ptr<scalar_t>()));
    else
      rows(const_cast<float*>(src.const_data_ptr<float>()));
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  return norm(x, nullptr, weight, eps);
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check(x, weight);
  const bool wide = residual.scalar_type() == at::kFloat;
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  (wide || residual.scalar_type() == x.scalar_type()) && residual.device().is_cpu(),
              "x and residual must be contiguous CPU tensors of one shape, the residual of x's dtype or float32");
  return norm(residual, &x, weight, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor(a!) residual, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
