// vattn::ragged_attention: causal attention for one iteration's packed ragged tokens over
// each request's contiguous K/V in the cache's virtual tensors, one call per layer for the
// whole batch (decodes and prefill chunks together), on the CPU.
//
// vattn::paged_attention is the same kernel reading a block-table cache (the paged
// baseline): only the address of a K/V row differs (`SlotRows` against `BlockRows`), so
// comparing the two measures what paging itself costs, not two different kernels.
//
// Request b owns query rows [starts[b], starts[b] + new_b) and cache positions
// [lengths[b] - new_b, lengths[b]) of row reqids[b]; query row i of it sits at position
// lengths[b] - new_b + i and sees keys [0, that position]. Nothing past lengths[b] is ever
// read, so unmapped pages behind a slot are never touched (the caller guarantees that
// [0, lengths[b]) is mapped: vattn checks it against KVCache.lengths() when it plans).
//
// Work items are (request, tile of query rows) and cover every head, so each item streams
// its slot's K/V rows (all kv heads of a token sit together) once, front to back, and the
// query heads that share a kv head read its rows together. When there are fewer items
// than twice the threads (a few decodes at long contexts), each item's keys are split into
// chunks that run as items of their own and are merged after by their softmax maxima and
// sums (flash-decoding); otherwise one thread would hold a whole context while the other
// idles. Items run on torch's own thread pool (at::parallel_for), so no second OpenMP
// runtime, each thread taking the costliest item left whenever it finishes one.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <optional>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "brgemm_attention.h"
#include "fast_exp.h"
#include "narrow_floats.h"
#include "prefetch_queue.h"
#include "vnni_pairs.h"
#include "widest_simd.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12 warns that the AVX-512 intrinsics' internal _mm512_undefined_*() "is" or "may be" used
// uninitialized (a false positive: the mask selects every lane).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#endif

namespace {

constexpr int64_t kTileRows = 16;
constexpr int64_t kMinChunkKeys = 128;  // below this a split costs more than it spreads
constexpr float kMinScale = 1e-6f;

struct Item {
  int64_t request, first_row, rows;
  int64_t key_begin, key_end;  // the keys this item reads; a chunk of the tile's when split
  int64_t partial;             // first lane of its partial results, or -1 when not split
};

// An int8 cache's qparams (quantization parameters): a float32 (scale, midpoint) pair per (token, kv head), in a
// tensor shaped like the cache with head_dim replaced by 2 (`[slots, context, kv_heads, 2]` or
// `[blocks, block_size, kv_heads, 2]`); a row of K or V holds round((x - midpoint) / scale),
// midpoint = the middle of its range, scale = its width / 254 (asymmetric, as OpenVINO's u8
// cache: a row whose range sits off zero gets down to half a symmetric scale's step). Empty for
// a float cache.
struct QParams {
  float* data = nullptr;
  int64_t outer = 0, token = 0, head = 0;
  explicit QParams(const std::optional<at::Tensor>& tensor) {
    if (tensor)
      data = tensor->data_ptr<float>(), outer = tensor->stride(0), token = tensor->stride(1), head = tensor->stride(2);
  }
};

// Token j's row for kv head `kv` of request b: row reqids[b] of a [slots, context, kv_heads,
// head_dim] virtual tensor.
template <typename KT>
struct SlotRows {
  const KT* data;
  const int64_t* reqids;
  int64_t slot, token, head;
  QParams qparams;
  SlotRows(const at::Tensor& cache, const int64_t* ids, const std::optional<at::Tensor>& qparams_tensor)
      : data(cache.const_data_ptr<KT>()), reqids(ids), slot(cache.stride(0)), token(cache.stride(1)),
        head(cache.stride(2)), qparams(qparams_tensor) {}
  const KT* operator()(int64_t b, int64_t kv, int64_t j) const { return data + reqids[b] * slot + j * token + kv * head; }
  float* row_qparams(int64_t b, int64_t kv, int64_t j) const {  // its (scale, midpoint)
    return qparams.data + reqids[b] * qparams.outer + j * qparams.token + kv * qparams.head;
  }
};

// The same row in a [blocks, block_size, kv_heads, head_dim] cache through request b's row
// of the block table.
template <typename KT>
struct BlockRows {
  const KT* data;
  const int32_t* table;
  int64_t table_row, block_size, block, token, head;
  QParams qparams;
  BlockRows(const at::Tensor& cache, const at::Tensor& block_table, const std::optional<at::Tensor>& qparams_tensor)
      : data(cache.const_data_ptr<KT>()), table(block_table.const_data_ptr<int32_t>()),
        table_row(block_table.stride(0)), block_size(cache.size(1)), block(cache.stride(0)), token(cache.stride(1)),
        head(cache.stride(2)), qparams(qparams_tensor) {}
  const KT* operator()(int64_t b, int64_t kv, int64_t j) const {
    return data + table[b * table_row + j / block_size] * block + (j % block_size) * token + kv * head;
  }
  float* row_qparams(int64_t b, int64_t kv, int64_t j) const {  // its (scale, midpoint)
    return qparams.data + table[b * table_row + j / block_size] * qparams.outer + (j % block_size) * qparams.token +
           kv * qparams.head;
  }
};

// The three loops of an item, for keys in blocks of kBlock: scores (q . k for one lane and a
// block of keys), softmax's exp and sum over a lane's scores, and the value sum (acc += p_j *
// v_j over a block). The SIMD bodies put keys, not head_dim, across the vector lanes where it
// counts: a block's products are summed by one transposing tree instead of one horizontal
// reduction per key, exp runs 16 (or 8) scores at a time, and acc stays in registers over the
// block. AVX-512 and AVX2 bodies are compiled into every build and chosen per call from
// ATEN_CPU_CAPABILITY / the CPU, as torch chooses its own kernels.
constexpr int64_t kBlock = 16;
// Each block's rows are prefetched this many blocks ahead: a decode's keys come from memory,
// not cache, and without it the loads stall (benchmarks.attention_kernel, 64 decodes at 1,024
// keys, float32: 3,773 -> 2,753 us, 27 -> 37 GB/s of this machine's ~50; 3 or 4 blocks ahead
// were slower).
constexpr int64_t kPrefetchBlocks = 2;

struct ScalarMath {
  template <typename T>
  static void widen(const T* const* rows, int64_t n, int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; ++d) dst[j * dim + d] = static_cast<float>(rows[j][d]);
  }
  static void widen(const int8_t* const* rows, const float* scales, const float* midpoints, int64_t n, int64_t dim,
                    float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; ++d) dst[j * dim + d] = scales[j] * static_cast<float>(rows[j][d]) + midpoints[j];
  }
  static void dots(const float* q, const float* const* keys, int64_t n, int64_t dim, float* out) {
    for (int64_t j = 0; j < n; ++j) {
      float dot = 0.0f;
      for (int64_t d = 0; d < dim; ++d) dot += q[d] * keys[j][d];
      out[j] = dot;
    }
  }
  static float exp_sum(float* s, int64_t count, float top) {
    float total = 0.0f;
    for (int64_t j = 0; j < count; ++j) total += (s[j] = std::exp(s[j] - top));
    return total;
  }
  static void accumulate(float* acc, const float* p, const float* const* values, int64_t n, int64_t dim) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; ++d) acc[d] += p[j] * values[j][d];
  }
};

#if defined(__x86_64__)
#include "attention_avx2.h"
#include "attention_avx512.h"
#include "attention_bf16_dots.h"
#include "attention_int8_dots.h"
#endif

// The largest of a lane's `count` scores (-inf for none): the body's SIMD version where it has one.
template <typename Math>
float top(const float* s, int64_t count) {
  if constexpr (requires { Math::top(s, count); })
    return Math::top(s, count);
  else
    return count ? *std::max_element(s, s + count) : -INFINITY;
}

// A block's scores (or value sums) for `count` lanes: the body's many-lane version where it
// has one, else lane by lane.
template <typename Math, typename R>
void dots_lanes(const float* const* q, float* const* out, int64_t count, const R* const* keys, int64_t n,
                int64_t dim) {
  if constexpr (requires { Math::dots_lanes(q, out, count, keys, n, dim); })
    Math::dots_lanes(q, out, count, keys, n, dim);
  else
    for (int64_t l = 0; l < count; ++l) Math::dots(q[l], keys, n, dim, out[l]);
}

template <typename Math, typename R>
void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const R* const* values, int64_t n,
                      int64_t dim) {
  if constexpr (requires { Math::accumulate_lanes(acc, p, count, values, n, dim); })
    Math::accumulate_lanes(acc, p, count, values, n, dim);
  else
    for (int64_t l = 0; l < count; ++l) Math::accumulate(acc[l], p[l], values, n, dim);
}

// One (token, kv head) row into an int8 cache: round((x - midpoint) / scale), midpoint = the
// middle of the row's range, scale = its width / 254 (kMinScale for a constant row, as vLLM's
// 1e-6, so no scale is ever 0); to[] in [-127, 127]. Written to vectorize: adding and taking away
// 1.5 x 2^23 rounds to nearest even as nearbyint does (a call GCC will not vectorize).
template <typename QT>
std::pair<float, float> quantize_row(const QT* from, int8_t* to, int64_t dim) {
  float lowest = INFINITY, highest = -INFINITY;
#pragma omp simd reduction(min : lowest) reduction(max : highest)
  for (int64_t d = 0; d < dim; ++d) {
    lowest = std::min(lowest, widen(from[d]));
    highest = std::max(highest, widen(from[d]));
  }
  const float midpoint = 0.5f * (lowest + highest), scale = std::max((highest - lowest) / 254.0f, kMinScale);
#pragma omp simd
  for (int64_t d = 0; d < dim; ++d) {
    const float rounded = ((widen(from[d]) - midpoint) / scale + 12582912.0f) - 12582912.0f;
    to[d] = static_cast<int8_t>(std::clamp(rounded, -127.0f, 127.0f));
  }
  return {scale, midpoint};
}

// Writes the new tokens' K or V (rows [starts[b], starts[b] + news[b]) of `fresh`, [tokens,
// kv_heads, head_dim] in the query's dtype) at request b's positions [lengths[b] - news[b],
// lengths[b]), rounded to the cache's dtype as torch's conversion rounds (to nearest even);
// into an int8 cache, each (token, kv head) row quantized with its own scale and midpoint (quantize_row).
// One pass inside the call that reads them, the tokens split over the threads: a decode step at
// one request is otherwise dominated by the two indexed copies per layer that did this.
template <typename QT, typename KT, typename Rows>
void store(const at::Tensor& fresh, const Rows& rows, const int64_t* starts, const int64_t* news,
           const int64_t* lengths, int64_t batch) {
  const int64_t kv_heads = fresh.size(1), dim = fresh.size(2);
  const QT* data = fresh.const_data_ptr<QT>();
  std::vector<std::pair<int64_t, int64_t>> tokens;  // (request, its j-th new token)
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < news[b]; ++j) tokens.emplace_back(b, j);
  at::parallel_for(0, static_cast<int64_t>(tokens.size()), 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const auto [b, j] = tokens[t];
      const int64_t position = lengths[b] - news[b] + j;
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        const QT* from = data + (starts[b] + j) * fresh.stride(0) + kv * fresh.stride(1);
        KT* to = const_cast<KT*>(rows(b, kv, position));
        if constexpr (std::is_same_v<KT, int8_t>) {
          float* pair = rows.row_qparams(b, kv, position);
          std::tie(pair[0], pair[1]) = quantize_row(from, to, dim);
        } else if constexpr (std::is_same_v<QT, KT>) {
          std::copy(from, from + dim, to);
        } else {
          for (int64_t d = 0; d < dim; ++d) to[d] = static_cast<KT>(static_cast<float>(from[d]));
        }
      }
    }
  });
}

template <typename Math, typename QT, typename KT, typename Rows>
void attend(const at::Tensor& out, const at::Tensor& q, const Rows& key_rows, const Rows& value_rows, int64_t kv_heads,
            const int64_t* starts, const int64_t* news, const int64_t* lengths, int64_t batch, double scale) {
  const int64_t heads = q.size(1), dim = q.size(2);
  const int64_t group = heads / kv_heads;
  const QT* q_data = q.const_data_ptr<QT>();
  QT* out_data = out.mutable_data_ptr<QT>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t o_row = out.stride(0), o_head = out.stride(1);

  std::vector<Item> tiles;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t new_rows = news[b];
    for (int64_t r = 0; r < new_rows; r += kTileRows) {
      const int64_t rows = std::min(kTileRows, new_rows - r);
      tiles.push_back({b, r, rows, 0, lengths[b] - new_rows + r + rows, -1});
    }
  }
  const int64_t wanted = 2 * at::get_num_threads();
  const int64_t tile_count = static_cast<int64_t>(tiles.size());
  std::vector<Item> items;
  int64_t partial_lanes = 0;
  for (const Item& tile : tiles) {
    const int64_t keys = tile.key_end;
    const int64_t chunks = std::min((wanted + tile_count - 1) / tile_count, keys / kMinChunkKeys);
    if (tile_count >= wanted || chunks < 2) {
      items.push_back(tile);
      continue;
    }
    const int64_t per_chunk = (keys + chunks - 1) / chunks;
    for (int64_t first = 0; first < keys; first += per_chunk) {
      items.push_back({tile.request, tile.first_row, tile.rows, first, std::min(keys, first + per_chunk), partial_lanes});
      partial_lanes += tile.rows * heads;
    }
  }
  // Costliest first (rows x keys), each thread taking the next item as it finishes its last:
  // at::parallel_for hands each thread one contiguous share of a range, so sorted items split
  // that way would leave one thread all the long ones.
  const auto cost = [](const Item& item) { return item.rows * (item.key_end - item.key_begin); };
  std::stable_sort(items.begin(), items.end(), [&](const Item& a, const Item& b) { return cost(a) > cost(b); });
  std::atomic<int64_t> next_item{0};
  // Split items' unnormalized results: per lane its score maximum, its sum of exp and its
  // weighted sum of values, merged into `out` after every chunk is done.
  std::vector<float> partial_max(partial_lanes), partial_sum(partial_lanes), partial_acc(partial_lanes * dim);

  // The bf16 body reads queries and rows as bf16 (its scores scaled after), the int8 one rows as
  // stored and queries as int16 with a scale each, the others queries as float32 (scaled before) and
  // rows as float32, or (the AVX-512 body over a float16 cache) as stored.
  // The int8 body leaves the rows' midpoints out of its integer products and adds them after:
  // q . k = scale (q . row) + midpoint (the sum of q's elements) for a key, and for the values
  // a lane's sum of p_j x midpoint_j, the same in every element, once the item is done.
  constexpr bool kPairs = std::is_same_v<Math, Avx512Bf16Math>;
  constexpr bool kBytes = std::is_same_v<Math, Avx512Int8Math>;
  constexpr bool kHalves = std::is_same_v<Math, Avx512Math> && std::is_same_v<KT, c10::Half>;
  using Row = std::conditional_t<kPairs, c10::BFloat16,
                                 std::conditional_t<kBytes, int8_t, std::conditional_t<kHalves, c10::Half, float>>>;
  using Query = std::conditional_t<kBytes, int16_t, std::conditional_t<kPairs, Row, float>>;
  const int64_t item_count = static_cast<int64_t>(items.size());
  // The AVX-512 bodies issue the read-ahead lines as they read (prefetch_queue.h); the others get them at once.
  constexpr bool kTrickle = std::is_base_of_v<Avx512Math, Math>;
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), item_count), 1, [&](int64_t, int64_t) {
    PrefetchQueue queue;
    prefetch_queue = kTrickle ? &queue : nullptr;
    std::vector<float> scores, acc, tops, totals, converted(kBlock * dim), row_scales(kBlock), row_midpoints(kBlock);
    std::vector<Query> queries;
    std::vector<float> query_scales, query_sums, value_shifts;
    std::vector<int64_t> lane_ids(kTileRows * heads);
    std::vector<const KT*> sources(kBlock);
    std::vector<const Query*> lane_queries(kTileRows * heads);
    std::vector<const float*> lane_query_scales(kTileRows * heads);
    std::vector<float*> lane_scores(kTileRows * heads), lane_sums(kTileRows * heads);
    for (int64_t it = next_item++; it < item_count; it = next_item++) {
      const Item item = items[it];
      const int64_t b = item.request, length = lengths[b];
      const int64_t first_pos = length - news[b] + item.first_row;  // position of the tile's first row
      const int64_t key_begin = item.key_begin, keys = item.key_end - key_begin;
      const int64_t lanes = item.rows * heads;  // (row, query head) pairs, lane = row * heads + head
      scores.assign(lanes * keys, 0.0f);
      queries.resize(lanes * dim);
      query_scales.resize(lanes);
      query_sums.resize(lanes);
      value_shifts.assign(lanes, 0.0f);
      acc.assign(lanes * dim, 0.0f);
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          const QT* src = q_data + (starts[b] + item.first_row + r) * q_row + h * q_head;
          Query* dst = queries.data() + (r * heads + h) * dim;
          if constexpr (kPairs)
            std::copy(src, src + dim, dst);
          else if constexpr (kBytes) {
            query_scales[r * heads + h] = Math::quantize(src, dim, scale, dst);
            float sum = 0.0f;
            for (int64_t d = 0; d < dim; ++d) sum += widen(src[d]);
            query_sums[r * heads + h] = sum * static_cast<float>(scale);
          }
          else
            for (int64_t d = 0; d < dim; ++d) dst[d] = widen(src[d]) * static_cast<float>(scale);
        }
      // Row r sees the item's keys [key_begin, key_begin + seen(r)); rows before key j skip it.
      auto seen = [&](int64_t r) { return std::clamp<int64_t>(first_pos + r + 1 - key_begin, 0, keys); };
      auto first_row = [&](int64_t j) { return std::max<int64_t>(0, key_begin + j - first_pos); };
      // One block of keys' (or values') rows for kv head `kv`, as floats: the cache's own rows,
      // or (a float16 or bfloat16 cache, read at half the bytes, or an int8 one at a quarter)
      // widened into `converted`, 16 rows at a time: never a copy of the request's K/V.
      const int64_t peek = next_item.load(std::memory_order_relaxed);
      const Item* next = peek < item_count ? &items[peek] : nullptr;
      // Token j of the stream this pass reads, as (its rows, request, position): its keys, run on
      // past the last key into what is read next (the item's values after its keys; after its
      // values, the next item's keys, a guess: the other thread may take it). No rows past the end.
      struct Token {
        const Rows* rows;
        int64_t request, position;
      };
      auto stream_token = [&](const Rows& rows_of, int64_t j) -> Token {
        if (j < keys) return {&rows_of, b, key_begin + j};
        if (&rows_of == &key_rows) return {j - keys < keys ? &value_rows : nullptr, b, key_begin + j - keys};
        const bool more = next != nullptr && j - keys < next->key_end - next->key_begin;
        return {more ? &key_rows : nullptr, more ? next->request : 0, more ? next->key_begin + j - keys : 0};
      };
      // Prefetches the whole rows (every kv head's, which sit together) of the n tokens
      // kPrefetchBlocks blocks past jb, once for all kv heads, and an int8 cache's (scale, midpoint) pairs.
      const int64_t token_bytes = kv_heads * dim * static_cast<int64_t>(sizeof(KT));
      auto prefetch = [&](const void* begin, int64_t bytes) {
        if constexpr (kTrickle)
          queue.push(begin, bytes);
        else
          for (int64_t byte = 0; byte < bytes; byte += 64) __builtin_prefetch(static_cast<const char*>(begin) + byte);
      };
      auto prefetch_ahead = [&](const Rows& rows_of, int64_t jb, int64_t n) {
        if constexpr (kTrickle) queue.flush();
        const int64_t first = jb + kPrefetchBlocks * kBlock;
        for (int64_t j = first; j < first + n; ++j) {
          const Token token = stream_token(rows_of, j);
          if (token.rows == nullptr) break;
          prefetch((*token.rows)(token.request, 0, token.position), token_bytes);
        }
        if constexpr (std::is_same_v<KT, int8_t>)
          for (int64_t j = first; j < first + n; ++j) {
            const Token token = stream_token(rows_of, j);
            if (token.rows == nullptr) break;
            prefetch(token.rows->row_qparams(token.request, 0, token.position), kv_heads * 2 * sizeof(float));
          }
      };
      auto read_qparams = [&](const Rows& rows_of, int64_t kv, int64_t jb, int64_t n) {
        for (int64_t j = 0; j < n; ++j) {
          const float* pair = rows_of.row_qparams(b, kv, key_begin + jb + j);
          row_scales[j] = pair[0], row_midpoints[j] = pair[1];
        }
      };
      // Written into `rows` (n of them) directly: a copy of them after (16 pointers) compiled to
      // rep movsq, whose start-up was ~5% of a decode's time with its rows in cache.
      auto block_rows = [&](const Rows& rows_of, int64_t kv, int64_t jb, int64_t n, const Row** rows) {
        if constexpr (std::is_same_v<KT, Row>) {
          for (int64_t j = 0; j < n; ++j) rows[j] = rows_of(b, kv, key_begin + jb + j);
          if constexpr (kBytes) read_qparams(rows_of, kv, jb, n);
        } else {
          for (int64_t j = 0; j < n; ++j) sources[j] = rows_of(b, kv, key_begin + jb + j);
          if constexpr (std::is_same_v<KT, int8_t>) {
            read_qparams(rows_of, kv, jb, n);
            Math::widen(sources.data(), row_scales.data(), row_midpoints.data(), n, dim, converted.data());
          } else {
            Math::widen(sources.data(), n, dim, converted.data());
          }
          for (int64_t j = 0; j < n; ++j) rows[j] = converted.data() + j * dim;
        }
      };
      // The lanes of kv head `kv` whose rows see key jb: their queries, scores (from jb) and sums.
      auto lanes_from = [&](int64_t jb, int64_t kv) {
        int64_t count = 0;
        for (int64_t r = first_row(jb); r < item.rows; ++r)
          for (int64_t lane = r * heads + kv * group; lane < r * heads + (kv + 1) * group; ++lane, ++count) {
            lane_ids[count] = lane;
            lane_queries[count] = queries.data() + lane * dim;
            lane_query_scales[count] = query_scales.data() + lane;
            lane_scores[count] = scores.data() + lane * keys + jb;
            lane_sums[count] = acc.data() + lane * dim;
          }
        return count;
      };
      // Each kv head's rows block by block: fn(rows, n, lanes that see the block's first key).
      // The bf16 body takes two full blocks (n = 2 * kBlock) at a time where the keys allow.
      auto by_blocks = [&](const Rows& rows_of, auto&& fn) {
        for (int64_t jb = 0, n = 0; jb < keys; jb += n) {
          n = std::min(kPairs && jb + 2 * kBlock <= keys ? 2 * kBlock : kBlock, keys - jb);
          prefetch_ahead(rows_of, jb, n);
          for (int64_t kv = 0; kv < kv_heads; ++kv) {
            const Row* rows[2 * kBlock];
            for (int64_t at = 0; at < n; at += kBlock) block_rows(rows_of, kv, jb + at, std::min(kBlock, n - at), rows + at);
            fn(rows, n, lanes_from(jb, kv));
          }
        }
      };
      // Scores for every key a row might see (keys past a row's own last one get weight 0 below).
      by_blocks(key_rows, [&](const Row* const* rows, int64_t n, int64_t count) {
        if constexpr (kPairs)
          Math::dots_lanes(lane_queries.data(), lane_scores.data(), count, rows, n, dim, scale);
        else if constexpr (kBytes) {
          Math::dots_lanes(lane_queries.data(), lane_query_scales.data(), lane_scores.data(), count, rows,
                           row_scales.data(), n, dim);
          for (int64_t c = 0; c < count; ++c)
            for (int64_t j = 0; j < n; ++j) lane_scores[c][j] += query_sums[lane_ids[c]] * row_midpoints[j];
        } else
          dots_lanes<Math>(lane_queries.data(), lane_scores.data(), count, rows, n, dim);
      });
      tops.resize(lanes);
      totals.resize(lanes);
      for (int64_t lane = 0; lane < lanes; ++lane) {
        const int64_t count = seen(lane / heads);
        float* s = scores.data() + lane * keys;
        tops[lane] = top<Math>(s, count);
        totals[lane] = Math::exp_sum(s, count, tops[lane]);
        std::fill(s + count, s + keys, 0.0f);  // keys past the row's own: weight 0 in every block
      }
      by_blocks(value_rows, [&](const Row* const* rows, int64_t n, int64_t count) {
        if constexpr (kPairs)
          Math::accumulate_lanes(lane_sums.data(), lane_scores.data(), count, rows, n, dim);
        else if constexpr (kBytes) {
          Math::accumulate_lanes(lane_sums.data(), lane_scores.data(), count, rows, row_scales.data(), n, dim);
          for (int64_t c = 0; c < count; ++c)
            for (int64_t j = 0; j < n; ++j) value_shifts[lane_ids[c]] += lane_scores[c][j] * row_midpoints[j];
        } else
          accumulate_lanes<Math>(lane_sums.data(), lane_scores.data(), count, rows, n, dim);
      });
      if constexpr (kBytes)
        for (int64_t lane = 0; lane < lanes; ++lane)
          for (int64_t d = 0; d < dim; ++d) acc[lane * dim + d] += value_shifts[lane];
      if (item.partial >= 0) {
        std::copy(tops.begin(), tops.end(), partial_max.begin() + item.partial);
        std::copy(totals.begin(), totals.end(), partial_sum.begin() + item.partial);
        std::copy(acc.begin(), acc.end(), partial_acc.begin() + item.partial * dim);
        continue;
      }
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          QT* dst = out_data + (starts[b] + item.first_row + r) * o_row + h * o_head;
          const int64_t lane = r * heads + h;
          const float inv = 1.0f / totals[lane];
          for (int64_t d = 0; d < dim; ++d) dst[d] = narrow<QT>(acc[lane * dim + d] * inv);
        }
    }
    prefetch_queue = nullptr;
  });

  if (partial_lanes == 0) return;
  // Merge each split tile's chunks.
  for (const Item& tile : tiles) {
    std::vector<const Item*> chunks;
    for (const Item& item : items)
      if (item.partial >= 0 && item.request == tile.request && item.first_row == tile.first_row)
        chunks.push_back(&item);
    if (chunks.empty()) continue;
    for (int64_t r = 0; r < tile.rows; ++r)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t lane = r * heads + h;
        float top = -INFINITY;
        for (const Item* c : chunks) top = std::max(top, partial_max[c->partial + lane]);
        float total = 0.0f;
        std::vector<float> merged(dim, 0.0f);
        for (const Item* c : chunks) {
          if (partial_sum[c->partial + lane] == 0.0f) continue;  // a chunk past this row's keys
          const float weight = std::exp(partial_max[c->partial + lane] - top);
          total += weight * partial_sum[c->partial + lane];
          const float* a = partial_acc.data() + (c->partial + lane) * dim;
          for (int64_t d = 0; d < dim; ++d) merged[d] += weight * a[d];
        }
        QT* dst = out_data + (starts[tile.request] + tile.first_row + r) * o_row + h * o_head;
        for (int64_t d = 0; d < dim; ++d) dst[d] = narrow<QT>(merged[d] / total);
      }
  }
}

// Calls f.template operator()<Math, QT, KT>() for the supported (query, cache) dtype pairs.
template <typename Math, typename F>
void by_dtype(at::ScalarType qt, at::ScalarType kt, const F& f) {
  if (qt == at::kFloat && kt == at::kFloat) {
    f.template operator()<Math, float, float>();
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    f.template operator()<Math, float, c10::BFloat16>();
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    f.template operator()<Math, c10::BFloat16, c10::BFloat16>();
  } else if (qt == at::kHalf && kt == at::kHalf) {
    f.template operator()<Math, c10::Half, c10::Half>();
  } else if (qt == at::kFloat && kt == at::kHalf) {
    f.template operator()<Math, float, c10::Half>();
  } else if (qt == at::kFloat && kt == at::kChar) {
    f.template operator()<Math, float, int8_t>();
  } else if (qt == at::kBFloat16 && kt == at::kChar) {
    f.template operator()<Math, c10::BFloat16, int8_t>();
  } else {
    TORCH_CHECK(false, "unsupported dtypes: q ", qt, ", cache ", kt);
  }
}

// The widest body this CPU allows (widest_simd.h) that this head_dim fits.
std::string simd_for(int64_t head_dim) {
  const std::string& widest = widest_simd();
  if (widest == "avx512" && head_dim % 16 == 0) return widest;
  if (widest != "scalar" && head_dim % 8 == 0) return "avx2";
  return "scalar";
}

// Whether a body beyond AVX-512's runs: `allowed` (the CPU has its feature and
// ONEDNN_MAX_CPU_ISA, which caps torch's matmuls below it, does not cap it too; read once), the
// AVX-512 body is chosen and head_dim fits it.
bool body_runs(int64_t head_dim, bool allowed, bool fits) { return allowed && simd_for(head_dim) == "avx512" && fits; }

// bf16 queries over a bf16 cache: the AVX512_BF16 body (attention_bf16_dots.h).
bool bf16_dots(int64_t head_dim) {
#if defined(__x86_64__)
  static const bool allowed = onednn_allows("AVX512_CORE_BF16") && __builtin_cpu_supports("avx512bf16");
  return body_runs(head_dim, allowed, Avx512Bf16Math::fits(head_dim));
#else
  return false;
#endif
}

// bf16 queries over an int8 cache: the AVX512_VNNI body (attention_int8_dots.h).
bool int8_dots(int64_t head_dim) {
#if defined(__x86_64__)
  static const bool allowed = onednn_allows("AVX512_CORE_VNNI") && __builtin_cpu_supports("avx512vnni");
  return body_runs(head_dim, allowed, Avx512Int8Math::fits(head_dim));
#else
  return false;
#endif
}

template <typename F>
void dispatch(at::ScalarType qt, at::ScalarType kt, int64_t head_dim, const F& f) {
  const std::string simd = simd_for(head_dim);
#if defined(__x86_64__)
  if (qt == at::kBFloat16 && kt == at::kBFloat16 && bf16_dots(head_dim))
    return f.template operator()<Avx512Bf16Math, c10::BFloat16, c10::BFloat16>();
  if (qt == at::kBFloat16 && kt == at::kChar && int8_dots(head_dim))
    return f.template operator()<Avx512Int8Math, c10::BFloat16, int8_t>();
  if (simd == "avx512") return by_dtype<Avx512Math>(qt, kt, f);
  if (simd == "avx2") return by_dtype<Avx2Math>(qt, kt, f);
#endif
  by_dtype<ScalarMath>(qt, kt, f);
}

// The checks both entry points share; returns the batch size.
int64_t check_batch(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                    const at::Tensor& starts, const at::Tensor& new_tokens, const at::Tensor& lengths,
                    const char* cache_shape) {
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && out.dtype() == q.dtype(),
              "q and out must be [tokens, heads, head_dim] of one dtype");
  TORCH_CHECK(q.stride(2) == 1 && out.stride(2) == 1, "q and out need contiguous head_dim");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && v_cache.dtype() == k_cache.dtype(),
              "k_cache and v_cache must be ", cache_shape, " of one dtype");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "the caches need contiguous head_dim");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "q and the caches disagree on head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "query heads must be a multiple of kv heads");
  for (const at::Tensor* t : {&q, &out, &k_cache, &v_cache}) TORCH_CHECK(t->device().is_cpu(), "CPU tensors only");
  for (const at::Tensor* t : {&starts, &new_tokens, &lengths})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kLong && t->dim() == 1 && t->is_contiguous(),
                "starts, new_tokens and lengths must be contiguous int64 CPU vectors");
  const int64_t batch = starts.size(0);
  TORCH_CHECK(new_tokens.size(0) == batch && lengths.size(0) == batch,
              "starts, new_tokens and lengths need one entry per request");
  const int64_t* rows = starts.const_data_ptr<int64_t>();
  const int64_t* news = new_tokens.const_data_ptr<int64_t>();
  const int64_t* lens = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= rows[b] && rows[b] + news[b] <= q.size(0), "a request's rows lie outside q");
    TORCH_CHECK(1 <= news[b] && news[b] <= lens[b], "each request needs 1 <= new tokens <= length");
  }
  return batch;
}

// The new tokens' K and V to store, if given: both or neither, [tokens, kv_heads, head_dim]
// like q's rows, in q's dtype.
bool check_fresh(const at::Tensor& q, const at::Tensor& cache, const std::optional<at::Tensor>& k,
                 const std::optional<at::Tensor>& v) {
  TORCH_CHECK(k.has_value() == v.has_value(), "k and v are stored together: give both or neither");
  if (!k) return false;
  for (const at::Tensor* t : {&*k, &*v})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->size(0) == q.size(0) && t->size(1) == cache.size(2) &&
                    t->size(2) == q.size(2) && t->scalar_type() == q.scalar_type() && t->stride(2) == 1,
                "k and v must be [tokens, kv_heads, head_dim] like q's rows, in q's dtype, contiguous head_dim");
  return true;
}

// An int8 cache's (scale, midpoint) pairs, which it needs, and a float cache's, which it has none of.
void check_qparams(const at::Tensor& cache, const std::optional<at::Tensor>& k_qparams,
                  const std::optional<at::Tensor>& v_qparams) {
  const bool int8 = cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_qparams.has_value() == int8 && v_qparams.has_value() == int8,
              int8 ? "an int8 cache needs k_qparams and v_qparams" : "only an int8 cache has qparams");
  if (!int8) return;
  for (const at::Tensor* t : {&*k_qparams, &*v_qparams})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 4 &&
                    t->sizes().slice(0, 3) == cache.sizes().slice(0, 3) && t->size(3) == 2 && t->stride(3) == 1,
                "k_qparams and v_qparams must be float32 CPU tensors shaped like the cache with head_dim replaced by "
                "2 (each row's scale and midpoint, together)");
}

void ragged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& reqids, const at::Tensor& starts, const at::Tensor& new_tokens,
                      const at::Tensor& lengths, double scale, const std::optional<at::Tensor>& k,
                      const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_qparams,
                      const std::optional<at::Tensor>& v_qparams) {
  const int64_t batch =
      check_batch(out, q, k_cache, v_cache, starts, new_tokens, lengths, "[slots, context, kv_heads, head_dim]");
  const bool fresh = check_fresh(q, k_cache, k, v);
  check_qparams(k_cache, k_qparams, v_qparams);
  TORCH_CHECK(reqids.device().is_cpu() && reqids.scalar_type() == at::kLong && reqids.dim() == 1 &&
                  reqids.is_contiguous() && reqids.size(0) == batch,
              "reqids must be a contiguous int64 CPU vector, one entry per request");
  const int64_t* ids = reqids.const_data_ptr<int64_t>();
  const int64_t* lens = lengths.const_data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(0 <= ids[b] && ids[b] < k_cache.size(0), "reqid out of range");
    TORCH_CHECK(lens[b] <= k_cache.size(1), "a length exceeds the context");
  }
  const int64_t* rows = starts.const_data_ptr<int64_t>();
  const int64_t* news = new_tokens.const_data_ptr<int64_t>();
  dispatch(q.scalar_type(), k_cache.scalar_type(), q.size(2), [&]<typename Math, typename QT, typename KT>() {
    const SlotRows<KT> keys(k_cache, ids, k_qparams), values(v_cache, ids, v_qparams);
    if (fresh) {
      store<QT, KT>(*k, keys, rows, news, lens, batch);
      store<QT, KT>(*v, values, rows, news, lens, batch);
    }
    constexpr bool kBrgemmDtypes = (std::is_same_v<QT, c10::BFloat16> &&
                                    (std::is_same_v<KT, c10::BFloat16> || std::is_same_v<KT, int8_t>)) ||
                                   (std::is_same_v<QT, float> && std::is_same_v<KT, float>);
    if constexpr (kBrgemmDtypes) {
      if (brgemm_attention_runs(q.scalar_type(), q.size(2))) {
        // Prompt chunks on brgemm, the rest (decodes, short chunks) on this body.
        PromptChunks chunks, rest;
        for (int64_t b = 0; b < batch; ++b) (news[b] >= kBrgemmMinTokens ? chunks : rest).add(ids[b], rows[b], news[b], lens[b]);
        if (!chunks.empty()) brgemm_attention(out, q, k_cache, v_cache, k_qparams, v_qparams, k, v, chunks, scale);
        if (rest.empty()) return;
        const SlotRows<KT> rest_keys(k_cache, rest.slots.data(), k_qparams), rest_values(v_cache, rest.slots.data(), v_qparams);
        attend<Math, QT, KT>(out, q, rest_keys, rest_values, k_cache.size(2), rest.starts.data(), rest.news.data(),
                             rest.lengths.data(), static_cast<int64_t>(rest.slots.size()), scale);
        return;
      }
    }
    attend<Math, QT, KT>(out, q, keys, values, k_cache.size(2), rows, news, lens, batch, scale);
  });
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_blocks,
                     const at::Tensor& v_blocks, const at::Tensor& block_table, const at::Tensor& starts,
                     const at::Tensor& new_tokens, const at::Tensor& lengths, double scale,
                     const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                     const std::optional<at::Tensor>& k_qparams, const std::optional<at::Tensor>& v_qparams) {
  const int64_t batch =
      check_batch(out, q, k_blocks, v_blocks, starts, new_tokens, lengths, "[blocks, block_size, kv_heads, head_dim]");
  const bool fresh = check_fresh(q, k_blocks, k, v);
  check_qparams(k_blocks, k_qparams, v_qparams);
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
                  block_table.stride(1) == 1 && block_table.size(0) == batch,
              "block_table must be an int32 CPU [batch, max_blocks] table, one row per request");
  const int64_t block_size = k_blocks.size(1), num_blocks = k_blocks.size(0);
  const int64_t* lens = lengths.const_data_ptr<int64_t>();
  const int32_t* table = block_table.const_data_ptr<int32_t>();
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t used = (lens[b] + block_size - 1) / block_size;
    TORCH_CHECK(used <= block_table.size(1), "a length exceeds the block table");
    for (int64_t i = 0; i < used; ++i) {
      const int32_t block = table[b * block_table.stride(0) + i];
      TORCH_CHECK(0 <= block && block < num_blocks, "block id out of range");
    }
  }
  const int64_t* rows = starts.const_data_ptr<int64_t>();
  const int64_t* news = new_tokens.const_data_ptr<int64_t>();
  dispatch(q.scalar_type(), k_blocks.scalar_type(), q.size(2), [&]<typename Math, typename QT, typename KT>() {
    const BlockRows<KT> keys(k_blocks, block_table, k_qparams), values(v_blocks, block_table, v_qparams);
    if (fresh) {
      store<QT, KT>(*k, keys, rows, news, lens, batch);
      store<QT, KT>(*v, values, rows, news, lens, batch);
    }
    attend<Math, QT, KT>(out, q, keys, values, k_blocks.size(2), rows, news, lens, batch, scale);
  });
}

}  // namespace

TORCH_LIBRARY(vattn, m) {
  // With k and v, the new tokens' K/V are written into the caches first (hence their (b!), (c!)),
  // and into an int8 cache's qparams (d!), (e!).
  m.def(
      "ragged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor reqids, "
      "Tensor starts, Tensor new_tokens, Tensor lengths, float scale, Tensor? k=None, Tensor? v=None, "
      "Tensor(d!)? k_qparams=None, Tensor(e!)? v_qparams=None) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_blocks, Tensor(c!) v_blocks, Tensor block_table, "
      "Tensor starts, Tensor new_tokens, Tensor lengths, float scale, Tensor? k=None, Tensor? v=None, "
      "Tensor(d!)? k_qparams=None, Tensor(e!)? v_qparams=None) -> ()");
  m.def("attention_simd(int head_dim) -> str", &simd_for);
  m.def("attention_bf16_dots(int head_dim) -> bool", &bf16_dots);
  m.def("attention_int8_dots(int head_dim) -> bool", &int8_dots);
  m.def("attention_brgemm(ScalarType dtype, int head_dim) -> bool", &brgemm_attention_runs);
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) {
  m.impl("ragged_attention", &ragged_attention);
  m.impl("paged_attention", &paged_attention);
}
