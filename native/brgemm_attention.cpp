// Prompt chunks' attention on oneDNN's brgemm (see brgemm_attention.h), flash-attention style:
// each request's keys and values are packed once per call in blocks of kKeys, in the layout
// brgemm multiplies bf16 in (cpublas::pack's VNNI pairs, written here directly); then each item (a request's kv head and kTokens of
// its new tokens, the group's query heads as rows) walks the blocks its rows see, scores =
// queries x keys^T on brgemm, a running softmax in float32, and values' sums += probabilities
// (rounded to bf16) x values on brgemm.
#include "brgemm_attention.h"

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <optional>
#include <cstdlib>
#include <memory>
#include <numeric>
#include <string>

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

// One request's kv head, packed: blocks of [head_dim x kKeys] keys^T and [kKeys x head_dim]
// values (in slabs of kSlab columns), brgemm's B operands (keys past the length are zero). Left
// uninitialized when made (packing writes every element): std::vector's value-initialized
// resize filled them one bf16 at a time, most of a prompt's packing time.
struct PackedKV {
  std::unique_ptr<bf16[]> keys, values;
};

// A cache's rows as bf16: its own (a bf16 cache), or an int8 cache's widened by their scales and
// midpoints and rounded to bf16 (an int8 cache under a bf16 model). The chunk's own new tokens
// come from `fresh` (the call's K or V, when it stores them) instead: as OpenVINO does, a prompt
// attends over its own K/V as computed, and only what later tokens read has been quantized.
struct CacheRows {
  const at::Tensor& cache;
  const std::optional<at::Tensor>& qparams;
  const std::optional<at::Tensor>& fresh;
  // Row `position` of slot `slot`, whose new tokens [first_new, ...) are fresh rows from `start`.
  void read(int64_t slot, int64_t kv, int64_t position, int64_t first_new, int64_t start, bf16* dst) const {
    const int64_t dim = cache.size(3);
    if (fresh && position >= first_new) {
      std::copy_n(fresh->const_data_ptr<bf16>() + (start + position - first_new) * fresh->stride(0) + kv * fresh->stride(1),
                  dim, dst);
      return;
    }
    const int64_t at = slot * cache.stride(0) + position * cache.stride(1) + kv * cache.stride(2);
    if (!qparams) {
      std::copy_n(cache.const_data_ptr<bf16>() + at, dim, dst);
      return;
    }
    const int8_t* row = cache.const_data_ptr<int8_t>() + at;
    const float* pair =
        qparams->const_data_ptr<float>() + slot * qparams->stride(0) + position * qparams->stride(1) + kv * qparams->stride(2);
    for (int64_t d = 0; d < dim; ++d) dst[d] = bf16(pair[0] * static_cast<float>(row[d]) + pair[1]);
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

// A block's rows ([kKeys][dim], zeros past the length) as brgemm's bf16 B operands, in the VNNI
// layout cpublas::pack writes ([K / 2][N][2]: rows of K paired): keys^T (K = dim, N = kKeys) are
// the transpose of the rows' 32-bit pairs, 16 x 16 at a time; values (K = kKeys, N = a slab's
// columns) interleave rows 2k and 2k + 1, slab after slab of kSlab columns. Written directly, not
// transposed element by element for cpublas::pack (a call per block and slab).
AVX512_TARGET void pack_keys(const bf16* rows, int64_t dim, bf16* out) {
  const auto* src = reinterpret_cast<const uint32_t*>(rows);
  auto* dst = reinterpret_cast<uint32_t*>(out);
  const int64_t pairs = dim / 2;  // a multiple of 16 (dim % 32 == 0)
  for (int64_t j = 0; j < kKeys; j += 16)
    for (int64_t p = 0; p < pairs; p += 16) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(src + (j + i) * pairs + p);
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
void pack_request(const CacheRows& keys, const CacheRows& values, const PromptChunks& chunks, int64_t c, int64_t kv,
                  PackedKV& packed, std::vector<bf16>& plain) {
  const int64_t slot = chunks.slots[c], length = chunks.lengths[c], first_new = length - chunks.news[c];
  const int64_t start = chunks.starts[c];
  const int64_t dim = keys.cache.size(3), blocks = (length + kKeys - 1) / kKeys, block = dim * kKeys;
  packed.keys = std::make_unique_for_overwrite<bf16[]>(blocks * block);
  packed.values = std::make_unique_for_overwrite<bf16[]>(blocks * block);
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t first = b * kKeys, n = std::min(kKeys, length - first);
    std::fill(plain.begin() + n * dim, plain.end(), bf16(0.0f));  // the last block's missing keys
    for (int64_t j = 0; j < n; ++j) keys.read(slot, kv, first + j, first_new, start, &plain[j * dim]);
    pack_keys(plain.data(), dim, &packed.keys[b * block]);
    for (int64_t j = 0; j < n; ++j) values.read(slot, kv, first + j, first_new, start, &plain[j * dim]);
    pack_values(plain.data(), dim, &packed.values[b * block]);
  }
}

struct Item {
  int64_t chunk, kv, first_token, tokens;
};

// One row's scores of a block (its first `visible` keys seen) folded into its running softmax:
// probabilities (bf16) into p, and where the block passes the row's maximum `top`, `top` raised and
// the row's values' sums so far (`acc`, head_dim floats) and its sum of probabilities (`sum_parts`,
// kept as 16 partial sums, added up once the row is done) rescaled. Whether it passes is one
// vertical compare of the block's raw maxima: the horizontal maximum and the rescale (half of this
// function's time when every block took them) run only for the blocks that raise it, few after a
// row's first. All on AVX-512 (every CPU with AMX has it): on AMX the products take less time than this.
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) void softmax_block(
    const float* s, int64_t visible, float scale, float& top, float* sum_parts, float* acc, int64_t dim, bf16* p) {
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

bool brgemm_attention_runs(int64_t head_dim) {
  static const bool allowed = onednn_allows("AVX512_CORE_AMX") && cpublas::could_pack(at::kBFloat16);
  return allowed && widest_simd() == "avx512" && head_dim % 32 == 0 && head_dim <= 256;
}

void brgemm_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::optional<at::Tensor>& k_qparams, const std::optional<at::Tensor>& v_qparams,
                      const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, const PromptChunks& chunks,
                      double scale) {
  const int64_t count = static_cast<int64_t>(chunks.slots.size()), kv_heads = k_cache.size(2);
  const int64_t heads = q.size(1), dim = q.size(2), group = heads / kv_heads, block = dim * kKeys;
  std::vector<PackedKV> packed(count * kv_heads);
  const CacheRows keys{k_cache, k_qparams, k}, values{v_cache, v_qparams, v};
  at::parallel_for(0, count * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> plain(block);
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
  const bf16* q_data = q.const_data_ptr<bf16>();
  bf16* out_data = out.mutable_data_ptr<bf16>();
  const float scale_f = static_cast<float>(scale);

  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), item_count), 1, [&](int64_t, int64_t) {
    const int64_t most = kTokens * group;
    std::vector<bf16> a(most * dim), p(most * kKeys);
    std::vector<float> scores(most * kKeys), sums(most * dim), tops(most), sum_parts(most * 16);
    for (int64_t it = next++; it < item_count; it = next++) {
      const Item item = items[it];
      const int64_t rows = item.tokens * group, start = chunks.starts[item.chunk] + item.first_token;
      const int64_t first_pos = chunks.lengths[item.chunk] - chunks.news[item.chunk] + item.first_token;
      // Row m is token m / group's query head kv * group + m % group.
      for (int64_t m = 0; m < rows; ++m)
        std::copy_n(q_data + (start + m / group) * q.stride(0) + (item.kv * group + m % group) * q.stride(1), dim,
                    &a[m * dim]);
      std::fill(tops.begin(), tops.end(), -INFINITY);
      std::fill(sum_parts.begin(), sum_parts.end(), 0.0f);
      std::fill(sums.begin(), sums.end(), 0.0f);
      const PackedKV& kv = packed[item.chunk * kv_heads + item.kv];
      const int64_t blocks = (first_pos + item.tokens - 1) / kKeys + 1;
      for (int64_t b = 0; b < blocks; ++b) {
        cpublas::brgemm(rows, kKeys, dim, dim, kKeys, kKeys, false, a.data(), &kv.keys[b * block], scores.data());
        for (int64_t m = 0; m < rows; ++m) {
          const int64_t visible = std::clamp<int64_t>(first_pos + m / group + 1 - b * kKeys, 0, kKeys);
          if (visible == 0) {  // a block past this row's position: nothing to add
            std::fill_n(&p[m * kKeys], kKeys, bf16(0.0f));
            continue;
          }
          softmax_block(&scores[m * kKeys], visible, scale_f, tops[m], &sum_parts[m * 16], &sums[m * dim], dim,
                        &p[m * kKeys]);
        }
        for (int64_t at = 0; at < dim; at += kSlab)
          cpublas::brgemm(rows, std::min(kSlab, dim - at), kKeys, kKeys, std::min(kSlab, dim - at), dim, true, p.data(),
                          &kv.values[b * block + at * kKeys], &sums[at]);
      }
      for (int64_t m = 0; m < rows; ++m) {
        bf16* dst = out_data + (start + m / group) * out.stride(0) + (item.kv * group + m % group) * out.stride(1);
        const float inv = 1.0f / std::accumulate(&sum_parts[m * 16], &sum_parts[m * 16] + 16, 0.0f);
        for (int64_t d = 0; d < dim; ++d) dst[d] = bf16(sums[m * dim + d] * inv);
      }
    }
    cpublas::brgemm_release();
  });
}
