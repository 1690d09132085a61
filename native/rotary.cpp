// vattn::rotary: rotary position embedding applied to q and k in place, as transformers'
// apply_rotary_pos_emb (rotate_half layout: the first and second halves of a head pair up).
// Python's version is ~15 operators a layer (slices, neg, cat, muls, adds) and allocates
// four tensors; this is one pass that writes through q's and k's own strides, so it also
// works on the views a fused QKV projection splits into.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>

#include "narrow_floats.h"
#include "widest_simd.h"

namespace {

// A [tokens, heads, head_dim] tensor's rows, written through its own strides.
template <typename T>
struct Heads {
  T* data;
  int64_t heads, token_stride, head_stride;
  explicit Heads(const at::Tensor& x)
      : data(x.mutable_data_ptr<T>()), heads(x.size(1)), token_stride(x.stride(0)), head_stride(x.stride(1)) {}
};

// Token t's heads of x rotated by its cos and sin rows, `half` = head_dim / 2.
template <typename T>
[[gnu::always_inline]] inline void rotate_token(const Heads<T>& x, int64_t t, const T* c, const T* s, int64_t half) {
  for (int64_t h = 0; h < x.heads; ++h) {
    T* head = x.data + t * x.token_stride + h * x.head_stride;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
      const float first = widen(head[i]), second = widen(head[i + half]);
      // The products round to T before the sum, as the Python version's separate ops do.
      const float a = widen(narrow<T>(first * widen(c[i])));
      const float b = widen(narrow<T>(-second * widen(s[i])));
      const float d = widen(narrow<T>(second * widen(c[i + half])));
      const float e = widen(narrow<T>(first * widen(s[i + half])));
      head[i] = narrow<T>(a + b);
      head[i + half] = narrow<T>(d + e);
    }
  }
}

// Tokens [begin, end) of q and k, both while the token's cos and sin rows are in L1; inlined into
// each body below, so it vectorizes for the build's baseline ISA (AVX2 on x86) or for AVX-512.
template <typename T>
[[gnu::always_inline]] inline void rotate_span(const Heads<T>& q, const Heads<T>& k, const T* cos, const T* sin,
                                               int64_t table_stride, int64_t half, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    rotate_token(q, t, cos + t * table_stride, sin + t * table_stride, half);
    rotate_token(k, t, cos + t * table_stride, sin + t * table_stride, half);
  }
}

template <typename T>
void rotate_span_baseline(const Heads<T>& q, const Heads<T>& k, const T* cos, const T* sin, int64_t table_stride,
                          int64_t half, int64_t begin, int64_t end) {
  rotate_span(q, k, cos, sin, table_stride, half, begin, end);
}

#if defined(__x86_64__)
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,prefer-vector-width=512"))) void rotate_span_avx512(
    const Heads<T>& q, const Heads<T>& k, const T* cos, const T* sin, int64_t table_stride, int64_t half,
    int64_t begin, int64_t end) {
  rotate_span(q, k, cos, sin, table_stride, half, begin, end);
}
#endif

template <typename T>
void rotate(const at::Tensor& q, const at::Tensor& k, const T* cos, const T* sin, int64_t table_stride) {
  const Heads<T> q_heads(q), k_heads(k);
  const int64_t half = q.size(2) / 2;
  auto span = rotate_span_baseline<T>;
#if defined(__x86_64__)
  if (widest_simd() == "avx512") span = rotate_span_avx512<T>;
#endif
  at::parallel_for(0, q.size(0), 16, [&](int64_t begin, int64_t end) {
    span(q_heads, k_heads, cos, sin, table_stride, half, begin, end);
  });
}

void rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& cos, const at::Tensor& sin) {
  for (const at::Tensor* x : {&q, &k})
    TORCH_CHECK(x->device().is_cpu() && x->dim() == 3 && x->stride(2) == 1 && x->size(2) % 2 == 0 &&
                    x->size(0) == cos.size(0) && x->size(2) == cos.size(1) && x->scalar_type() == q.scalar_type(),
                "q and k must be CPU [tokens, heads, head_dim] tensors of one dtype, head_dim even and dense");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.stride(1) == 1 && sin.strides() == cos.strides() &&
                  cos.scalar_type() == q.scalar_type() && sin.scalar_type() == q.scalar_type() &&
                  cos.device().is_cpu() && sin.device().is_cpu(),
              "cos and sin must be CPU [tokens, head_dim] tables of q's dtype");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    rotate<scalar_t>(q, k, cos.const_data_ptr<scalar_t>(), sin.const_data_ptr<scalar_t>(), cos.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vattn, m) { m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos, Tensor sin) -> ()"); }

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("rotary", &rotary); }
