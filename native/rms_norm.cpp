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

namespace {

// Rows of S normed into rows of T (S is T, or float32 under a 16-bit T).
template <typename S, typename T>
void norm_rows(const S* src, int64_t src_stride, T* dst, const T* weight, int64_t rows, int64_t width, double eps) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const S* row = src + r * src_stride;
      float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < width; ++i) {
        const float value = widen(row[i]);
        squares += value * value;
      }
      const float inverse = 1.0f / std::sqrt(squares / static_cast<float>(width) + static_cast<float>(eps));
      T* out = dst + r * width;
#pragma omp simd
      for (int64_t i = 0; i < width; ++i) out[i] = narrow<T>(widen(weight[i]) * widen(narrow<S>(widen(row[i]) * inverse)));
    }
  });
}

template <typename S, typename T>
void add_rows(S* residual, const T* x, int64_t rows, int64_t width) {
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
#pragma omp simd
      for (int64_t i = 0; i < width; ++i)
        residual[r * width + i] = narrow<S>(widen(residual[r * width + i]) + widen(x[r * width + i]));
  });
}

void check(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, "x must be a CPU [rows, hidden] tensor, rows dense");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type() && weight.device().is_cpu(),
              "weight must be a contiguous [hidden] CPU tensor of x's dtype");
}

// `src` normed into a new tensor of `weight`'s dtype: src's dtype, or float32 under a 16-bit one.
at::Tensor norm(const at::Tensor& src, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(weight.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, weight.scalar_type(), "rms_norm", [&] {
    auto rows = [&]<typename S>(const S* data) {
      norm_rows<S, scalar_t>(data, src.stride(0), out.mutable_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                             src.size(0), src.size(1), eps);
    };
    if (src.scalar_type() == weight.scalar_type())
      rows(src.const_data_ptr<scalar_t>());
    else
      rows(src.const_data_ptr<float>());
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check(x, weight);
  return norm(x, weight, eps);
}

at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps) {
  check(x, weight);
  const bool wide = residual.scalar_type() == at::kFloat;
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  (wide || residual.scalar_type() == x.scalar_type()) && residual.device().is_cpu(),
              "x and residual must be contiguous CPU tensors of one shape, the residual of x's dtype or float32");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    if (wide)
      add_rows(residual.mutable_data_ptr<float>(), x.const_data_ptr<scalar_t>(), x.size(0), x.size(1));
    else
      add_rows(residual.mutable_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(), x.size(0), x.size(1));
  });
  return norm(residual, weight, eps);
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
