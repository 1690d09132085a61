// Prompt chunks' attention on oneDNN's brgemm (see brgemm_attention.h), flash-attention style:
// each request's keys and values are packed once per call in blocks of kKeys, in the layout
// brgemm multiplies them in (bf16: cpublas::pack's VNNI pairs, written here directly; float32:
// keys^T and the values' rows as they are); then each item (a request's kv head and kTokens of
// its new tokens, the group's query heads as rows) walks the blocks its rows see, scores =
// queries x keys^T on brgemm, a running softmax in float32, and values' sums += probabilities
// (in the queries' dtype) x values on brgemm.
#include "brgemm_attention.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <optional>
#include <cstdlib>
#include <numeric>
#include <string>
#include <type_traits>

#include "fast_exp.h"
#include "vnni_pairs.h"
#include "widest_simd.h"

// GCC 12's AVX-512 intrinsics headers trip these (as in ragged_attention.cpp).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"

namespace {

using bf16 = c10::BFloat16;
namespace cpublas = at::native::cpublas;

constexpr int64_t kKeys = 64;    // keys a block: the N of the scores' product, the K of the values'
constexpr int64_t kTokens = 64;  // new tokens an item: its rows are these x the group's query heads
constexpr int64_t kSlab = 64;    // the most columns oneDNN packs a B operand in (wider head_dims: slabs)
constexpr size_t kArenaKeptBytes = size_t{64} << 20;  // a larger call's packed rows are freed after it

// One request's kv head, packed: blocks of [head_dim x kKeys] keys^T and [kKeys x head_dim]
// values (bf16 in slabs of kSlab columns), brgemm's B operands (keys past the length are zero),
// in the calling thread's arena (see attend).
template <typename T>
struct PackedKV {
  T *keys, *values;
};

// A cache's rows in the queries' dtype T: its own (a cache of T), or an int8 cache's widened by
// their scales and midpoints (and rounded to T). The chunk's
// own new tokens come from `fresh` (the call's K or V, when it stores them) instead: as OpenVINO
// does, a prompt attends over its own K/V as computed, and only what later tokens read has been
// quantized.
template <typename T>
struct CacheRows {
  const at::Tensor& cache;
  const std::optional<at::Tensor>& qparams;
  const std::optional<at::Tensor>& fresh;
  // Row `position` of slot `slot`, whose new tokens [first_new, ...) are fresh rows from `start`.
  void read(int64_t slot, int64_t kv, int64_t position, int64_t first_new, int64_t start, T* dst) const {
    const int64_t dim = cache.size(3);
    if (fresh && position >= first_new) {
      std::copy_n(fresh->const_data_ptr<T>() + (start + position - first_new) * fresh->stride(0) + kv * fresh->stride(1),
                  dim, dst);
      return;
    }
    const int64_t at = slot * cache.stride(0) + position * cache.stride(1) + kv * cache.stride(2);
    if (!qparams) {
      std::copy_n(cache.const_data_ptr<T>() + at, dim, dst);
      return;
    }
    const int8_t* row = cache.const_data_ptr<int8_t>() + at;
    const float* pair =
        qparams->const_data_ptr<float>() + slot * qparams->stride(0) + position * qparams->stride(1) + kv * qparams->stride(2);
    for (int64_t d = 0; d < dim; ++d) dst[d] = T(pair[0] * static_cast<float>(row[d]) + pair[1]);
  }
};

#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
// r[0..16) as the rows of a 16 x 16 matrix of 32-bit values, transposed in place.
AVX512_TARGET inline void transpose16x16(__m512i* r) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  // r[4q + c] holds, in 128-bit lane l, column 4l + c's values of rows 4q .. 4q + 3.
  for (int c = 0; c < 4; ++c) {
    const __m512i a = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x88), b = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xDD);
    const __m512i e = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x88), f = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(a, e, 0x88);       // column c
    t[c + 4] = _mm512_shuffle_i32x4(b, f, 0x88);   // column c + 4
    t[c + 8] = _mm512_shuffle_i32x4(a, e, 0xDD);   // column c + 8
    t[c + 12] = _mm512_shuffle_i32x4(b, f, 0xDD);  // column c + 12
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// A block's rows ([kKeys][dim], zeros past the length) as brgemm's B operands. Keys^T (K = dim,
// N = kKeys) are the transpose of the rows' 32-bit words, 16 x 16 at a time: a float32's
// [dim][kKeys], and for bf16 the VNNI layout cpublas::pack writes ([K / 2][N][2]: rows of K
// paired). bf16 values (K = kKeys, N = a slab's columns) interleave rows 2k and 2k + 1, slab after
// slab of kSlab columns; float32 values are the rows as they are. Written directly, not
// transposed element by element for cpublas::pack (a call per block and slab).
template <typename T>
AVX512_TARGET void pack_keys(const T* rows, int64_t dim, T* out) {
  const auto* src = reinterpret_cast<const uint32_t*>(rows);
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t words = dim * static_cast<int64_t>(sizeof(T)) / 4;  // a multiple of 16 (brgemm_attention_runs)
  for (int64_t j = 0; j < kKeys; j += 16)
    for (int64_t p = 0; p < words; p += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (j + i) * words + p);
      transpose16x16(r);
      for (int64_t i = 0; i < 16; ++i) _mm512_storeu_si512(dst + (p + i) * kKeys + j, r[i]);
    }
}
AVX512_TARGET void pack_values(const bf16* rows, int64_t dim, bf16* out) {
  for (int64_t at = 0; at < dim; at += kSlab) {
    const int64_t width = std::min(kSlab, dim - at);  // a multiple of 32
    bf16* slab = out + at * kKeys;
    for (int64_t k = 0; k < kKeys / 2; ++k)
      for (int64_t c = 0; c < width; c += 16) {
        const __m256i even = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + 2 * k * dim + at + c));
        const __m256i odd = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + (2 * k + 1) * dim + at + c));
        _mm512_storeu_si512(slab + (k * width + c) * 2, interleave_pairs(even, odd));
      }
  }
}
#undef AVX512_TARGET

// Chunk c's keys and values for kv head `kv`, packed in blocks of kKeys as brgemm reads them;
// `plain` holds a block's rows.
template <typename T>
void pack_request(const CacheRows<T>& keys, const CacheRows<T>& values, const PromptChunks& chunks, int64_t c,
                  int64_t kv, PackedKV<T>& packed, std::vector<T>& plain) {
  const int64_t slot = chunks.slots[c], length = chunks.lengths[c], first_new = length - chunks.news[c];
  const int64_t start = chunks.starts[c];
  const int64_t dim = keys.cache.size(3), blocks = (length + kKeys - 1) / kKeys, block = dim * kKeys;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kKeys, n = std::min(kKeys, length - first);
    // The values' rows go where brgemm reads them (float32) or into `plain` to be interleaved (bf16).
    T* value_rows = std::is_same_v<T, float> ? &packed.values[b * block] : plain.data();
    std::fill(plain.begin() + n * dim, plain.end(), T(0.0f));  // the last block's missing keys (and bf16 values)
    if constexpr (std::is_same_v<T, float>) std::fill(value_rows + n * dim, value_rows + block, 0.0f);
    for (int64_t j = 0; j < n; ++j) keys.read(slot, kv, first + j, first_new, start, &plain[j * dim]);
    pack_keys(plain.data(), dim, &packed.keys[b * block]);
    for (int64_t j = 0; j < n; ++j) values.read(slot, kv, first + j, first_new, start, value_rows + j * dim);
    if constexpr (std::is_same_v<T, bf16>) pack_values(plain.data(), dim, &packed.values[b * block]);
  }
}

struct Item {
  int64_t chunk, kv, first_token, tokens;
};

// One row's scores of a block (its first `visible` keys seen) folded into its running softmax:
// probabilities (in T, the values' dtype) into p, and where the block passes the row's maximum `top`, `top` raised and
// the row's values' sums so far (`acc`, head_dim floats) and its sum of probabilities (`sum_parts`,
// kept as 16 partial sums, added up once the row is done) rescaled. Whether it passes is one
// vertical compare of the block's raw maxima: the horizontal maximum and the rescale (half of this
// function's time when every block took them) run only for the blocks that raise it, few after a
// row's first. All on AVX-512 (every CPU with AMX has it; the float32 instance emits no AVX512_BF16
// instruction, so runs on any): on AMX the products take less time than this.
template <typename T>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) void softmax_block(
    const float* s, int64_t visible, float scale, float& top, float* sum_parts, float* acc, int64_t dim, T* p) {
  constexpr int64_t kVectors = kKeys / 16;
  __mmask16 live[kVectors];
  __m512 raw[kVectors], largest = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < kVectors; ++i) {
    const int64_t count = std::clamp<int64_t>(visible - 16 * i, 0, 16);
    live[i] = static_cast<__mmask16>((1u << count) - 1);
    raw[i] = _mm512_loadu_ps(s + 16 * i);
    largest = _mm512_mask_max_ps(largest, live[i], largest, raw[i]);
  }
  __m512 sum = _mm512_loadu_ps(sum_parts);
  // Scores are raw x scale (scale > 0): a raw score passes top / scale. A row's first block always
  // does (top is -inf).
  if (_mm512_cmp_ps_mask(largest, _mm512_set1_ps(top / scale), _CMP_GT_OQ) != 0) {
    const float new_top = scale * _mm512_reduce_max_ps(largest);
    if (top != -INFINITY) {  // a first block's sums are zeros: nothing to rescale
      const __m512 rescale = _mm512_set1_ps(std::exp(top - new_top));
      sum = _mm512_mul_ps(sum, rescale);
      for (int64_t d = 0; d < dim; d += 16) _mm512_storeu_ps(acc + d, _mm512_mul_ps(_mm512_loadu_ps(acc + d), rescale));
    }
    top = new_top;
  }
  const __m512 factor = _mm512_set1_ps(scale), shift = _mm512_set1_ps(top);
  for (int64_t i = 0; i < kVectors; ++i) {
    const __m512 e = _mm512_maskz_mov_ps(live[i], fast_exp16(_mm512_fmsub_ps(raw[i], factor, shift)));
    sum = _mm512_add_ps(sum, e);
    if constexpr (std::is_same_v<T, float>)
      _mm512_storeu_ps(p + 16 * i, e);
    else
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 16 * i), reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
  }
  _mm512_storeu_ps(sum_parts, sum);
}

}  // namespace

bool onednn_allows(const std::string& isa) {
  static const std::string order[] = {"SSE41",       "AVX",         "AVX2",         "AVX2_VNNI",
                                      "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_CORE_BF16",
                                      "AVX10_1_512", "AVX512_CORE_FP16", "AVX512_CORE_AMX"};
  const char* asked = std::getenv("ONEDNN_MAX_CPU_ISA");
  std::string cap = asked ? asked : "";
  std::transform(cap.begin(), cap.end(), cap.begin(), [](unsigned char c) { return std::toupper(c); });
  const auto* at_cap = std::find(std::begin(order), std::end(order), cap);
  const auto* at_isa = std::find(std::begin(order), std::end(order), isa);
  TORCH_CHECK(at_isa != std::end(order), "unknown oneDNN ISA ", isa);
  return at_cap == std::end(order) || at_cap >= at_isa;  // a cap past the list (AMX_FP16, ALL) caps none of it
}

bool brgemm_attention_runs(at::ScalarType dtype, int64_t head_dim) {
  // bf16: where oneDNN packs it for brgemm (AMX). float32: on any AVX-512 CPU, oneDNN's f32
  // brgemm (torch's runs it from AVX2 on; the softmax here needs AVX-512).
  static const bool bf16_allowed = onednn_allows("AVX512_CORE_AMX") && cpublas::could_pack(at::kBFloat16);
  static const bool float_allowed = onednn_allows("AVX512_CORE") && at::globalContext().userEnabledMkldnn();
  if (widest_simd() != "avx512" || head_dim > 256) return false;
  if (dtype == at::kBFloat16) return bf16_allowed && head_dim % 32 == 0;
  if (dtype == at::kFloat) return float_allowed && head_dim % 16 == 0;
  return false;
}

namespace {

template <typename T>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const std::optional<at::Tensor>& k_qparams, const std::optional<at::Tensor>& v_qparams,
            const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, const PromptChunks& chunks,
            double scale) {
  const int64_t count = static_cast<int64_t>(chunks.slots.size()), kv_heads = k_cache.size(2);
  const int64_t heads = q.size(1), dim = q.size(2), group = heads / kv_heads, block = dim * kKeys;
  // Packed rows go to an arena the calling thread keeps from call to call (up to kArenaKeptBytes):
  // allocated anew, the float32 ones (128 KiB a request of 512 keys) came from mmap, and their
  // page faults and zeroing cost as much as a chunk's products (8 chunks of 32 new tokens over
  // 512 keys).
  std::vector<PackedKV<T>> packed(count * kv_heads);
  int64_t total = 0;
  for (int64_t c = 0; c < count; ++c) total += 2 * kv_heads * ((chunks.lengths[c] + kKeys - 1) / kKeys) * block;
  static thread_local at::Tensor arena;
  if (!arena.defined() || arena.numel() < total) arena = at::empty({total}, q.options());
  T* const packed_rows = arena.mutable_data_ptr<T>();
  for (int64_t c = 0, at = 0; c < count; ++c)
    for (int64_t kv = 0; kv < kv_heads; ++kv) {
      const int64_t size = ((chunks.lengths[c] + kKeys - 1) / kKeys) * block;
      packed[c * kv_heads + kv] = {packed_rows + at, packed_rows + at + size};
      at += 2 * size;
    }
  const CacheRows<T> keys{k_cache, k_qparams, k}, values{v_cache, v_qparams, v};
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<T> plain(block);
    for (int64_t i = begin; i < end; ++i)
      pack_request(keys, values, chunks, i / kv_heads, i % kv_heads, packed[i], plain);
  });

  std::vector<Item> items;
  for (int64_t c = 0; c < count; ++c)
    for (int64_t kv = 0; kv < kv_heads; ++kv)
      for (int64_t t = 0; t < chunks.news[c]; t += kTokens) items.push_back({c, kv, t, std::min(kTokens, chunks.news[c] - t)});
  // Costliest first (keys the item's last row sees), taken one at a time as threads come free.
  const auto cost = [&](const Item& it) { return chunks.lengths[it.chunk] - chunks.news[it.chunk] + it.first_token + it.tokens; };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next{0};
  const int64_t item_count = static_cast<int64_t>(items.size());
  const T* q_data = q.const_data_ptr<T>();
  T* out_data = out.mutable_data_ptr<T>();
  const float scale_f = static_cast<float>(scale);

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), item_count), 1, [&](int64_t, int64_t) {
    const int64_t most = kTokens * group;
    // brgemm's operands at a cache line's start (torch's allocator aligns to 64 bytes): from
    // std::vector, whose alignment varied, a process ran these products at 1x or 0.6x by chance.
    const at::Tensor operands = at::empty({most * dim + most * kKeys}, q.options());
    const at::Tensor results = at::empty({most * kKeys + most * dim}, q.options().dtype(at::kFloat));
    T* const a = operands.mutable_data_ptr<T>();
    T* const p = a + most * dim;
    float* const scores = results.mutable_data_ptr<float>();
    float* const sums = scores + most * kKeys;
    std::vector<float> tops(most), sum_parts(most * 16);
    for (int64_t it = next++; it < item_count; it = next++) {
      const Item item = items[it];
      const int64_t rows = item.tokens * group, start = chunks.starts[item.chunk] + item.first_token;
      const int64_t first_pos = chunks.lengths[item.chunk] - chunks.news[item.chunk] + item.first_token;
      // Row m is token m / group's query head kv * group + m % group.
      for (int64_t m = 0; m < rows; ++m)
        std::copy_n(q_data + (start + m / group) * q.stride(0) + (item.kv * group + m % group) * q.stride(1), dim,
                    a + m * dim);
      std::fill(tops.begin(), tops.end(), -INFINITY);
      std::fill(sum_parts.begin(), sum_parts.end(), 0.0f);
      std::fill_n(sums, most * dim, 0.0f);
      const PackedKV<T>& kv = packed[item.chunk * kv_heads + item.kv];
      const int64_t blocks = (first_pos + item.tokens - 1) / kKeys + 1;
      for (int64_t b = 0; b < blocks; ++b) {
        cpublas::brgemm(rows, kKeys, dim, dim, kKeys, kKeys, false, a, &kv.keys[b * block], scores);
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t visible = std::clamp<int64_t>(first_pos + m / group + 1 - b * kKeys, 0, kKeys);
          if (visible == 0) {  // a block past this row's position: nothing to add
            std::fill_n(p + m * kKeys, kKeys, T(0.0f));
            continue;
          }
          softmax_block(scores + m * kKeys, visible, scale_f, tops[m], &sum_parts[m * 16], sums + m * dim, dim,
                        p + m * kKeys);
        }
        if constexpr (std::is_same_v<T, float>)
          cpublas::brgemm(rows, dim, kKeys, kKeys, dim, dim, true, p, &kv.values[b * block], sums);
        else
          for (int64_t at = 0; at < dim; at += kSlab)
            cpublas::brgemm(rows, std::min(kSlab, dim - at), kKeys, kKeys, std::min(kSlab, dim - at), dim, true,
                            p, &kv.values[b * block + at * kKeys], sums + at);
      }
      for (int64_t m = 0; m < rows; ++m) {
        T* dst = out_data + (start + m / group) * out.stride(0) + (item.kv * group + m % group) * out.stride(1);
        const float inv = 1.0f / std::accumulate(&sum_parts[m * 16], &sum_parts[m * 16] + 16, 0.0f);
        for (int64_t d = 0; d < dim; ++d) dst[d] = T(sums[m * dim + d] * inv);
      }
    }
    cpublas::brgemm_release();
  });
  if (arena.nbytes() > kArenaKeptBytes) arena = at::Tensor();
}

}  // namespace

void brgemm_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::optional<at::Tensor>& k_qparams, const std::optional<at::Tensor>& v_qparams,
                      const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, const PromptChunks& chunks,
                      double scale) {
  if (q.scalar_type() == at::kFloat)
    attend<float>(out, q, k_cache, v_cache, k_qparams, v_qparams, k, v, chunks, scale);
  else
    attend<bf16>(out, q, k_cache, v_cache, k_qparams, v_qparams, k, v, chunks, scale);
}
