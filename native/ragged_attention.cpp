// vattn::ragged_attention: causal attention for one iteration's packed ragged tokens over
// each request's contiguous K/V in the cache's virtual tensors, one call per layer for the
// whole batch (decodes and prefill chunks together), on the CPU.
//
// Request b owns query rows [starts[b], starts[b] + new_b) and cache positions
// [lengths[b] - new_b, lengths[b]) of row reqids[b]; query row i of it sits at position
// lengths[b] - new_b + i and sees keys [0, that position]. Nothing past lengths[b] is ever
// read, so unmapped pages behind a slot are never touched (the caller guarantees that
// [0, lengths[b]) is mapped: vattn checks it against KVCache.lengths() when it plans).
//
// Work items are (request, kv head, tile of query rows); each computes the scores of its
// rows and the query heads that share the kv head, so a K or V row is read once per tile.
// Items run on torch's own thread pool (at::parallel_for), so no second OpenMP runtime.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTileRows = 16;

struct Item {
  int64_t request, kv_head, first_row, rows;
};

// A K or V row as floats: the row itself for a float cache, else converted into `buffer`.
template <typename T>
inline const float* float_row(const T* src, float* buffer, int64_t dim) {
  if constexpr (std::is_same_v<T, float>) {
    return src;
  } else {
    for (int64_t d = 0; d < dim; ++d) buffer[d] = static_cast<float>(src[d]);
    return buffer;
  }
}

template <typename QT, typename KT>
void attend(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const int64_t* reqids, const int64_t* starts, const int64_t* news, const int64_t* lengths, int64_t batch,
            double scale) {
  const int64_t heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(2);
  const int64_t group = heads / kv_heads;
  const QT* q_data = q.const_data_ptr<QT>();
  QT* out_data = out.mutable_data_ptr<QT>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);
  const KT* k_data = k_cache.const_data_ptr<KT>();
  const KT* v_data = v_cache.const_data_ptr<KT>();
  const int64_t ks_slot = k_cache.stride(0), ks_tok = k_cache.stride(1), ks_head = k_cache.stride(2);
  const int64_t vs_slot = v_cache.stride(0), vs_tok = v_cache.stride(1), vs_head = v_cache.stride(2);

  std::vector<Item> items;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t new_rows = news[b];
    for (int64_t h = 0; h < kv_heads; ++h)
      for (int64_t r = 0; r < new_rows; r += kTileRows) items.push_back({b, h, r, std::min(kTileRows, new_rows - r)});
  }
  // Longest contexts first: a cheap balance across the pool's threads.
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) {
    return lengths[a.request] - news[a.request] + a.first_row > lengths[b.request] - news[b.request] + b.first_row;
  });

  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores, queries, acc, row(dim);
    for (int64_t it = begin; it < end; ++it) {
      const Item item = items[it];
      const int64_t b = item.request, length = lengths[b];
      const int64_t first_pos = length - news[b] + item.first_row;  // position of the tile's first row
      const int64_t keys = first_pos + item.rows;                     // keys the tile's last row sees
      const int64_t lanes = item.rows * group;                         // (row, query head) pairs
      scores.assign(lanes * keys, 0.0f);
      queries.resize(lanes * dim);
      acc.assign(lanes * dim, 0.0f);
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          const QT* src = q_data + (starts[b] + item.first_row + r) * q_row + (item.kv_head * group + g) * q_head;
          float* dst = queries.data() + (r * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * static_cast<float>(scale);
        }
      const KT* k_base = k_data + reqids[b] * ks_slot + item.kv_head * ks_head;
      const KT* v_base = v_data + reqids[b] * vs_slot + item.kv_head * vs_head;
      for (int64_t j = 0; j < keys; ++j) {
        const float* key = float_row(k_base + j * ks_tok, row.data(), dim);
        const int64_t first_lane = std::max<int64_t>(0, j - first_pos) * group;  // rows before j skip it
        for (int64_t lane = first_lane; lane < lanes; ++lane) {
          const float* qv = queries.data() + lane * dim;
          float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < dim; ++d) dot += qv[d] * key[d];
          scores[lane * keys + j] = dot;
        }
      }
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const int64_t seen = first_pos + lane / group + 1;
        float* s = scores.data() + lane * keys;
        float top = s[0];
        for (int64_t j = 1; j < seen; ++j) top = std::max(top, s[j]);
        float total = 0.0f;
#pragma omp simd reduction(+ : total)
        for (int64_t j = 0; j < seen; ++j) {
          s[j] = std::exp(s[j] - top);
          total += s[j];
        }
        const float inv = 1.0f / total;
        for (int64_t j = 0; j < seen; ++j) s[j] *= inv;
      }
      for (int64_t j = 0; j < keys; ++j) {
        const float* value = float_row(v_base + j * vs_tok, row.data(), dim);
        const int64_t first_lane = std::max<int64_t>(0, j - first_pos) * group;
        for (int64_t lane = first_lane; lane < lanes; ++lane) {
          const float p = scores[lane * keys + j];
          float* a = acc.data() + lane * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) a[d] += p * value[d];
        }
      }
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t g = 0; g < group; ++g) {
          QT* dst = out_data + (starts[b] + item.first_row + r) * o_row + (item.kv_head * group + g) * o_head;
          const float* src = acc.data() + (r * group + g) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<QT>(src[d]);
        }
    }
  });
}

void ragged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& reqids, const at::Tensor& starts, const at::Tensor& new_tokens,
                      const at::Tensor& lengths, double scale) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.dtype() == q.dtype(),
              "q and out must be [tokens, heads, head_dim] of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need contiguous head_dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.dtype() == k_cache.dtype(),
              "k_cache and v_cache must be [slots, context, kv_heads, head_dim] of one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches need contiguous head_dim");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches disagree on head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  for (const at::Tensor* t : {&q, &out, &k_cache, &v_cache}) TORCH_CHECK(t->device().is_cpu(), "CPU tensors only");
  for (const at::Tensor* t : {&reqids, &starts, &new_tokens, &lengths})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "reqids, starts, new_tokens and lengths must be contiguous int64 CPU vectors");
  const int64_t batch = reqids.size(0);
  TORCH_CHECK(starts.size(0) == batch && new_tokens.size(0) == batch && lengths.size(0) == batch,
              "reqids, starts, new_tokens and lengths need one entry per request");
  const int64_t* ids = reqids.const_data_ptr<int64_t>();
  const int64_t* rows = starts.const_data_ptr<int64_t>();
  const int64_t* news = new_tokens.const_data_ptr<int64_t>();
  const int64_t* lens = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= ids[b] && ids[b] < k_cache.size(0), "reqid out of range");
    TORCH_CHECK(0 <= rows[b] && rows[b] + news[b] <= q.size(0), "a request's rows lie outside q");
    TORCH_CHECK(1 <= news[b] && news[b] <= lens[b] && lens[b] <= k_cache.size(1),
                "each request needs 1 <= new tokens <= length <= context");
  }
  const auto qt = q.scalar_type(), kt = k_cache.scalar_type();
  if (qt == at::kFloat && kt == at::kFloat) {
    attend<float, float>(out, q, k_cache, v_cache, ids, rows, news, lens, batch, scale);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    attend<float, c10::BFloat16>(out, q, k_cache, v_cache, ids, rows, news, lens, batch, scale);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    attend<c10::BFloat16, c10::BFloat16>(out, q, k_cache, v_cache, ids, rows, news, lens, batch, scale);
  } else if (qt == at::kHalf && kt == at::kHalf) {
    attend<c10::Half, c10::Half>(out, q, k_cache, v_cache, ids, rows, news, lens, batch, scale);
  } else if (qt == at::kFloat && kt == at::kHalf) {
    attend<float, c10::Half>(out, q, k_cache, v_cache, ids, rows, news, lens, batch, scale);
  } else {
    TORCH_CHECK(false, "unsupported dtypes: q ", qt, ", cache ", kt);
  }
}

}  // namespace

TORCH_LIBRARY(vattn, m) {
  m.def(
      "ragged_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor reqids, Tensor starts, "
      "Tensor new_tokens, Tensor lengths, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) { m.impl("ragged_attention", &ragged_attention); }
