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
#include <type_traits>
#include <vector>

#include "narrow_floats.h"

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

// An int8 cache's scales: one float per (token, kv head), in a tensor shaped like the cache
// without head_dim (`[slots, context, kv_heads]` or `[blocks, block_size, kv_heads]`); a row
// of K or V holds round(x / scale), scale = its largest magnitude / 127 (vLLM's
// int8_per_token_head). Empty for a float cache.
struct Scales {
  float* data = nullptr;
  int64_t outer = 0, token = 0;
  explicit Scales(const std::optional<at::Tensor>& scales) {
    if (scales) data = scales->data_ptr<float>(), outer = scales->stride(0), token = scales->stride(1);
  }
};

// Token j's row for kv head `kv` of request b: row reqids[b] of a [slots, context, kv_heads,
// head_dim] virtual tensor.
template <typename KT>
struct SlotRows {
  const KT* data;
  const int64_t* reqids;
  int64_t slot, token, head;
  Scales scales;
  SlotRows(const at::Tensor& cache, const int64_t* ids, const std::optional<at::Tensor>& scale_tensor)
      : data(cache.const_data_ptr<KT>()), reqids(ids), slot(cache.stride(0)), token(cache.stride(1)),
        head(cache.stride(2)), scales(scale_tensor) {}
  const KT* operator()(int64_t b, int64_t kv, int64_t j) const { return data + reqids[b] * slot + j * token + kv * head; }
  float* scale(int64_t b, int64_t kv, int64_t j) const {
    return scales.data + reqids[b] * scales.outer + j * scales.token + kv;
  }
};

// The same row in a [blocks, block_size, kv_heads, head_dim] cache through request b's row
// of the block table.
template <typename KT>
struct BlockRows {
  const KT* data;
  const int32_t* table;
  int64_t table_row, block_size, block, token, head;
  Scales scales;
  BlockRows(const at::Tensor& cache, const at::Tensor& block_table, const std::optional<at::Tensor>& scale_tensor)
      : data(cache.const_data_ptr<KT>()), table(block_table.const_data_ptr<int32_t>()),
        table_row(block_table.stride(0)), block_size(cache.size(1)), block(cache.stride(0)), token(cache.stride(1)),
        head(cache.stride(2)), scales(scale_tensor) {}
  const KT* operator()(int64_t b, int64_t kv, int64_t j) const {
    return data + table[b * table_row + j / block_size] * block + (j % block_size) * token + kv * head;
  }
  float* scale(int64_t b, int64_t kv, int64_t j) const {
    return scales.data + table[b * table_row + j / block_size] * scales.outer + (j % block_size) * scales.token + kv;
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
  static void widen(const int8_t* const* rows, const float* scales, int64_t n, int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; ++d) dst[j * dim + d] = scales[j] * static_cast<float>(rows[j][d]);
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
// Cephes' expf: e^x = 2^k * e^r with |r| <= ln2/2 and a degree-5 polynomial for e^r (about
// 1e-7 relative error); x is a score minus its row's maximum, so <= 0, and is clamped where
// 2^k would leave float's normal range (e^-87 is 1.6e-38: nothing a softmax sum notices).
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpPoly[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                               4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

struct Avx2Math {
  __attribute__((target("avx2,fma,f16c"))) static void widen(const c10::Half* const* rows, int64_t n, int64_t dim,
                                                            float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 8) {
        const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d));
        _mm256_storeu_ps(dst + j * dim + d, _mm256_cvtph_ps(half));
      }
  }
  __attribute__((target("avx2,fma"))) static void widen(const c10::BFloat16* const* rows, int64_t n, int64_t dim,
                                                       float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d)));
        _mm256_storeu_ps(dst + j * dim + d, _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)));
      }
  }
  __attribute__((target("avx2,fma"))) static void widen(const int8_t* const* rows, const float* scales, int64_t n,
                                                       int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j) {
      const __m256 scale = _mm256_set1_ps(scales[j]);
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(rows[j] + d)));
        _mm256_storeu_ps(dst + j * dim + d, _mm256_mul_ps(scale, _mm256_cvtepi32_ps(wide)));
      }
    }
  }
  // out[i] = the sum of v[i]'s eight floats, for eight vectors: one transposing tree.
  __attribute__((target("avx2,fma"))) static __m256 sum8(const __m256* v) {
    const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);  // per 128-bit half
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
  }
  __attribute__((target("avx2,fma"))) static float sum(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
  }
  __attribute__((target("avx2,fma"))) static __m256 exp(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2High), x);
    x = _mm256_fnmadd_ps(k, _mm256_set1_ps(kLn2Low), x);
    __m256 y = _mm256_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(kExpPoly[i]));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i biased = _mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127));
    return _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(biased, 23)));
  }
  __attribute__((target("avx2,fma"))) static void dots(const float* q, const float* const* keys, int64_t n, int64_t dim,
                                                       float* out) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      __m256 sums[8];
      for (int i = 0; i < 8; ++i) sums[i] = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) {
        const __m256 qd = _mm256_loadu_ps(q + d);
        for (int i = 0; i < 8; ++i) sums[i] = _mm256_fmadd_ps(qd, _mm256_loadu_ps(keys[j + i] + d), sums[i]);
      }
      _mm256_storeu_ps(out + j, sum8(sums));
    }
    for (; j < n; ++j) {
      __m256 total = _mm256_setzero_ps();
      for (int64_t d = 0; d < dim; d += 8) total = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(keys[j] + d), total);
      out[j] = sum(total);
    }
  }
  __attribute__((target("avx2,fma"))) static float top(const float* s, int64_t count) {
    __m256 best = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= count; j += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(s + j));
    __m128 half = _mm_max_ps(_mm256_castps256_ps128(best), _mm256_extractf128_ps(best, 1));
    half = _mm_max_ps(half, _mm_movehl_ps(half, half));
    float result = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
    for (; j < count; ++j) result = std::max(result, s[j]);
    return result;
  }
  __attribute__((target("avx2,fma"))) static float exp_sum(float* s, int64_t count, float top) {
    const __m256 shift = _mm256_set1_ps(top);
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 total = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; j += 8) {
      const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(std::min<int64_t>(count - j, 8))), index);
      const __m256 e = exp(_mm256_sub_ps(_mm256_maskload_ps(s + j, live), shift));
      _mm256_maskstore_ps(s + j, live, e);
      total = _mm256_add_ps(total, _mm256_and_ps(e, _mm256_castsi256_ps(live)));
    }
    return sum(total);
  }
  __attribute__((target("avx2,fma"))) static void accumulate(float* acc, const float* p, const float* const* values,
                                                             int64_t n, int64_t dim) {
    int64_t d = 0;
    for (; d + 32 <= dim; d += 32) {
      __m256 a[4];
      for (int i = 0; i < 4; ++i) a[i] = _mm256_loadu_ps(acc + d + 8 * i);
      for (int64_t j = 0; j < n; ++j) {
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int i = 0; i < 4; ++i) a[i] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(values[j] + d + 8 * i), a[i]);
      }
      for (int i = 0; i < 4; ++i) _mm256_storeu_ps(acc + d + 8 * i, a[i]);
    }
    for (; d < dim; d += 8) {
      __m256 a = _mm256_loadu_ps(acc + d);
      for (int64_t j = 0; j < n; ++j) a = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(values[j] + d), a);
      _mm256_storeu_ps(acc + d, a);
    }
  }
};

struct Avx512Math {
  __attribute__((target("avx512f,avx2,fma"))) static void widen(const c10::Half* const* rows, int64_t n, int64_t dim,
                                                                float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 16) {
        const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + d));
        _mm512_storeu_ps(dst + j * dim + d, _mm512_cvtph_ps(half));
      }
  }
  __attribute__((target("avx512f,avx2,fma"))) static void widen(const c10::BFloat16* const* rows, int64_t n,
                                                                int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j)
      for (int64_t d = 0; d < dim; d += 16) {
        const __m256i narrow = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows[j] + d));
        _mm512_storeu_ps(dst + j * dim + d, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(narrow), 16)));
      }
  }
  __attribute__((target("avx512f,avx2,fma"))) static void widen(const int8_t* const* rows, const float* scales,
                                                                int64_t n, int64_t dim, float* dst) {
    for (int64_t j = 0; j < n; ++j) {
      const __m512 scale = _mm512_set1_ps(scales[j]);
      for (int64_t d = 0; d < dim; d += 16) {
        const __m512i wide = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[j] + d)));
        _mm512_storeu_ps(dst + j * dim + d, _mm512_mul_ps(scale, _mm512_cvtepi32_ps(wide)));
      }
    }
  }
  __attribute__((target("avx512f,avx2,fma"))) static __m512 exp(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT);
    x = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2High), x);
    x = _mm512_fnmadd_ps(k, _mm512_set1_ps(kLn2Low), x);
    __m512 y = _mm512_set1_ps(kExpPoly[0]);
    for (int i = 1; i < 6; ++i) y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(kExpPoly[i]));
    y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(y, k);
  }
  __attribute__((target("avx512f,avx2,fma"))) static __m256 low_plus_high(__m512 v) {
    return _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  }
  // A transposing tree's first two levels: in each 128-bit lane i, the sums of a, b, c and d's
  // four floats in that lane, in that order.
  __attribute__((target("avx512f,avx2,fma"))) static __m512 sum_quad(__m512 a, __m512 b, __m512 c, __m512 d) {
    const __m512d ab = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b)));
    const __m512d cd = _mm512_castps_pd(_mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d)));
    return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(ab, cd)), _mm512_castpd_ps(_mm512_unpackhi_pd(ab, cd)));
  }
  // Its last two: four sum_quad results (vectors 0-3, 4-7, 8-11, 12-15) to the 16 vectors' sums, in order.
  __attribute__((target("avx512f,avx2,fma"))) static __m512 sum_quads(const __m512* quads) {
    const __m512 first = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                       _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    const __m512 second = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                        _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(first, second, 0x88), _mm512_shuffle_f32x4(first, second, 0xDD));
  }
  static constexpr int64_t kMaxDim = 512;  // the transposed block's buffer; larger dims go lane by lane
  alignas(64) static constexpr float kZeroRow[kMaxDim] = {};  // a block's missing keys (zero bytes: any dtype)
  // L <= 4 lanes' scores against a block of n <= kBlock keys, times `scale`, as a decode's few
  // query heads per kv head need them (too few lanes to pay for transposing the block): each
  // key's row is loaded once for all L lanes, four keys' products at a time, and a lane's 16
  // sums come from one transposing tree (45 instructions), not one horizontal sum per key.
  // Float rows multiply by FMA; bf16 rows (Avx512Bf16Math) by vdpbf16ps on their pairs, which
  // is why the target names avx512bf16: float code compiled so never emits its instructions.
  template <int64_t L, typename T>
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma"))) static void dots_few(
      const T* const* q, float* const* out, const T* const* keys, int64_t n, int64_t dim, float scale) {
    constexpr int64_t kStep = 64 / sizeof(T);  // a vector's values
    __m512 quads[L][4];
    for (int64_t g = 0; g < 4; ++g) {
      const T* rows[4];
      for (int64_t i = 0; i < 4; ++i) rows[i] = 4 * g + i < n ? keys[4 * g + i] : reinterpret_cast<const T*>(kZeroRow);
      __m512 sums[L][4];
      for (int64_t l = 0; l < L; ++l)
        for (int64_t i = 0; i < 4; ++i) sums[l][i] = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += kStep)
        for (int64_t i = 0; i < 4; ++i) {
          const __m512 k = _mm512_loadu_ps(rows[i] + d);
          for (int64_t l = 0; l < L; ++l) {
            const __m512 ql = _mm512_loadu_ps(q[l] + d);
            if constexpr (std::is_same_v<T, float>)
              sums[l][i] = _mm512_fmadd_ps(ql, k, sums[l][i]);
            else
              sums[l][i] = _mm512_dpbf16_ps(sums[l][i], (__m512bh)ql, (__m512bh)k);
          }
        }
      for (int64_t l = 0; l < L; ++l) quads[l][g] = sum_quad(sums[l][0], sums[l][1], sums[l][2], sums[l][3]);
    }
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    const __m512 factor = _mm512_set1_ps(scale);
    for (int64_t l = 0; l < L; ++l) _mm512_mask_storeu_ps(out[l], live, _mm512_mul_ps(factor, sum_quads(quads[l])));
  }
  // Up to kLanes lanes, four at a time (dots_few).
  template <typename Few>
  static void by_fours(int64_t count, const Few& few) {
    for (int64_t l = 0; l < count; l += 4) switch (std::min<int64_t>(4, count - l)) {
        case 4: few.template operator()<4>(l); break;
        case 3: few.template operator()<3>(l); break;
        case 2: few.template operator()<2>(l); break;
        default: few.template operator()<1>(l); break;
      }
  }
  __attribute__((target("avx512f,avx2,fma"))) static void dots(const float* q, const float* const* keys, int64_t n, int64_t dim,
                                                      float* out) {
    if (n < kBlock) {
      for (int64_t j = 0; j < n; ++j) {
        __m512 sum = _mm512_setzero_ps();
        for (int64_t d = 0; d < dim; d += 16)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), _mm512_loadu_ps(keys[j] + d), sum);
        out[j] = _mm512_reduce_add_ps(sum);
      }
      return;
    }
    __m512 sums[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) sums[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 qd = _mm512_loadu_ps(q + d);
      for (int64_t j = 0; j < kBlock; ++j) sums[j] = _mm512_fmadd_ps(qd, _mm512_loadu_ps(keys[j] + d), sums[j]);
    }
    __m256 halves[kBlock];
    for (int64_t j = 0; j < kBlock; ++j) halves[j] = low_plus_high(sums[j]);
    _mm256_storeu_ps(out, Avx2Math::sum8(halves));
    _mm256_storeu_ps(out + 8, Avx2Math::sum8(halves + 8));
  }
  __attribute__((target("avx512f,avx2,fma"))) static float exp_sum(float* s, int64_t count, float top) {
    const __m512 shift = _mm512_set1_ps(top);
    __m512 total = _mm512_setzero_ps();
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 live = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
      const __m512 e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + j), shift));
      _mm512_mask_storeu_ps(s + j, live, e);
      total = _mm512_mask_add_ps(total, live, total, e);
    }
    return _mm512_reduce_add_ps(total);
  }
  __attribute__((target("avx512f,avx2,fma"))) static float top(const float* s, int64_t count) {
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < count; j += 16) {
      const __mmask16 live = count - j >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (count - j)) - 1);
      best = _mm512_mask_max_ps(best, live, best, _mm512_maskz_loadu_ps(live, s + j));
    }
    return _mm512_reduce_max_ps(best);
  }
  // Many lanes at once, where prefill chunks have them (a tile's rows x a kv head's query
  // heads). Scores: the block's 16 keys transposed once (16 x 16 in registers), then each
  // lane's 16 scores are one vector, d by d, with no horizontal sums; L lanes share each load
  // of a transposed row. Values: L lanes share each load of a value row.
  __attribute__((target("avx512f,avx2,fma"))) static void transpose16(const float* const* keys, int64_t n, int64_t d,
                                                                     float* kt) {
    __m512 r[16], t[16], u[16];
    for (int64_t j = 0; j < 16; ++j) r[j] = j < n ? _mm512_loadu_ps(keys[j] + d) : _mm512_setzero_ps();
    for (int64_t i = 0; i < 16; i += 2) {
      t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    // u[4 q + c]: rows 4 q .. 4 q + 3 of columns c, c + 4, c + 8, c + 12 (one per 128-bit lane).
    for (int64_t q = 0; q < 4; ++q) {
      const __m512d lo01 = _mm512_castps_pd(t[4 * q]), hi01 = _mm512_castps_pd(t[4 * q + 1]);
      const __m512d lo23 = _mm512_castps_pd(t[4 * q + 2]), hi23 = _mm512_castps_pd(t[4 * q + 3]);
      u[4 * q] = _mm512_castpd_ps(_mm512_unpacklo_pd(lo01, lo23));
      u[4 * q + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(lo01, lo23));
      u[4 * q + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(hi01, hi23));
      u[4 * q + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(hi01, hi23));
    }
    for (int64_t c = 0; c < 4; ++c) {
      // v[h][s]: quads 2 h and 2 h + 1 of columns c + 4 s and c + 4 s + 8.
      __m512 v[2][2];
      for (int64_t h = 0; h < 2; ++h) {
        v[h][0] = _mm512_shuffle_f32x4(u[8 * h + c], u[8 * h + 4 + c], 0x88);
        v[h][1] = _mm512_shuffle_f32x4(u[8 * h + c], u[8 * h + 4 + c], 0xDD);
      }
      for (int64_t s = 0; s < 2; ++s) {
        _mm512_storeu_ps(kt + (c + 4 * s) * 16, _mm512_shuffle_f32x4(v[0][s], v[1][s], 0x88));
        _mm512_storeu_ps(kt + (c + 4 * s + 8) * 16, _mm512_shuffle_f32x4(v[0][s], v[1][s], 0xDD));
      }
    }
  }
  template <int64_t L>
  __attribute__((target("avx512f,avx2,fma"))) static void dots_transposed(const float* const* q, float* const* out,
                                                                         const float* kt, __mmask16 live, int64_t dim) {
    __m512 sums[L];
    for (int64_t l = 0; l < L; ++l) sums[l] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; ++d) {
      const __m512 k = _mm512_loadu_ps(kt + d * 16);
      for (int64_t l = 0; l < L; ++l) sums[l] = _mm512_fmadd_ps(_mm512_set1_ps(q[l][d]), k, sums[l]);
    }
    for (int64_t l = 0; l < L; ++l) _mm512_mask_storeu_ps(out[l], live, sums[l]);
  }
  template <int64_t L>
  static void dots_transposed_left(const float* const* q, float* const* out, int64_t count, const float* kt,
                                   __mmask16 live, int64_t dim) {
    if constexpr (L > 0) {
      if (count == L) return dots_transposed<L>(q, out, kt, live, dim);
      dots_transposed_left<L - 1>(q, out, count, kt, live, dim);
    }
  }
  static void dots_lanes(const float* const* q, float* const* out, int64_t count, const float* const* keys, int64_t n,
                         int64_t dim) {
    constexpr int64_t kLanes = 8;
    if (dim > kMaxDim) {
      for (int64_t l = 0; l < count; ++l) dots(q[l], keys, n, dim, out[l]);
      return;
    }
    if (count < kLanes)
      return by_fours(count, [&]<int64_t L>(int64_t l) { dots_few<L>(q + l, out + l, keys, n, dim, 1.0f); });
    alignas(64) float kt[kMaxDim * 16];
    for (int64_t d = 0; d < dim; d += 16) transpose16(keys, n, d, kt + d * 16);
    const __mmask16 live = n >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << n) - 1);
    int64_t l = 0;
    for (; l + kLanes <= count; l += kLanes) dots_transposed<kLanes>(q + l, out + l, kt, live, dim);
    dots_transposed_left<kLanes - 1>(q + l, out + l, count - l, kt, live, dim);
  }
  template <int64_t L, int64_t V>
  __attribute__((target("avx512f,avx2,fma"))) static void accumulate_block(float* const* acc, const float* const* p,
                                                                          const float* const* values, int64_t n,
                                                                          int64_t d) {
    __m512 a[L][V];
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_loadu_ps(acc[l] + d + 16 * v);
    for (int64_t j = 0; j < n; ++j) {
      __m512 row[V];
      for (int64_t v = 0; v < V; ++v) row[v] = _mm512_loadu_ps(values[j] + d + 16 * v);
      for (int64_t l = 0; l < L; ++l) {
        const __m512 pj = _mm512_set1_ps(p[l][j]);
        for (int64_t v = 0; v < V; ++v) a[l][v] = _mm512_fmadd_ps(pj, row[v], a[l][v]);
      }
    }
    for (int64_t l = 0; l < L; ++l)
      for (int64_t v = 0; v < V; ++v) _mm512_storeu_ps(acc[l] + d + 16 * v, a[l][v]);
  }
  template <int64_t L>
  static void accumulate_lanes_of(float* const* acc, const float* const* p, const float* const* values, int64_t n,
                                  int64_t dim) {
    int64_t d = 0;
    for (; d + 64 <= dim; d += 64) accumulate_block<L, 4>(acc, p, values, n, d);
    switch ((dim - d) / 16) {
      case 3: return accumulate_block<L, 3>(acc, p, values, n, d);
      case 2: return accumulate_block<L, 2>(acc, p, values, n, d);
      case 1: return accumulate_block<L, 1>(acc, p, values, n, d);
      default: return;
    }
  }
  static void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const float* const* values,
                               int64_t n, int64_t dim) {
    int64_t l = 0;
    for (; l + 4 <= count; l += 4) accumulate_lanes_of<4>(acc + l, p + l, values, n, dim);
    switch (count - l) {
      case 3: return accumulate_lanes_of<3>(acc + l, p + l, values, n, dim);
      case 2: return accumulate_lanes_of<2>(acc + l, p + l, values, n, dim);
      case 1: return accumulate_lanes_of<1>(acc + l, p + l, values, n, dim);
      default: return;
    }
  }
};
#include "attention_bf16_dots.h"
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
template <typename Math>
void dots_lanes(const float* const* q, float* const* out, int64_t count, const float* const* keys, int64_t n,
                int64_t dim) {
  if constexpr (requires { Math::dots_lanes(q, out, count, keys, n, dim); })
    Math::dots_lanes(q, out, count, keys, n, dim);
  else
    for (int64_t l = 0; l < count; ++l) Math::dots(q[l], keys, n, dim, out[l]);
}

template <typename Math>
void accumulate_lanes(float* const* acc, const float* const* p, int64_t count, const float* const* values, int64_t n,
                      int64_t dim) {
  if constexpr (requires { Math::accumulate_lanes(acc, p, count, values, n, dim); })
    Math::accumulate_lanes(acc, p, count, values, n, dim);
  else
    for (int64_t l = 0; l < count; ++l) Math::accumulate(acc[l], p[l], values, n, dim);
}

// Writes the new tokens' K or V (rows [starts[b], starts[b] + news[b]) of `fresh`, [tokens,
// kv_heads, head_dim] in the query's dtype) at request b's positions [lengths[b] - news[b],
// lengths[b]), rounded to the cache's dtype as torch's conversion rounds (to nearest even);
// into an int8 cache, each (token, kv head) row quantized with its own scale (a zero row gets
// kMinScale, as vLLM's 1e-6, so no scale is ever 0).
// One pass inside the call that reads them: a decode step at one request is otherwise
// dominated by the two indexed copies per layer that did this.
template <typename QT, typename KT, typename Rows>
void store(const at::Tensor& fresh, const Rows& rows, const int64_t* starts, const int64_t* news,
           const int64_t* lengths, int64_t batch) {
  const int64_t kv_heads = fresh.size(1), dim = fresh.size(2);
  const QT* data = fresh.const_data_ptr<QT>();
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t j = 0; j < news[b]; ++j)
      for (int64_t kv = 0; kv < kv_heads; ++kv) {
        const QT* from = data + (starts[b] + j) * fresh.stride(0) + kv * fresh.stride(1);
        const int64_t position = lengths[b] - news[b] + j;
        KT* to = const_cast<KT*>(rows(b, kv, position));
        if constexpr (std::is_same_v<KT, int8_t>) {
          float largest = 0.0f;
          for (int64_t d = 0; d < dim; ++d) largest = std::max(largest, std::abs(static_cast<float>(from[d])));
          const float scale = std::max(largest / 127.0f, kMinScale);
          for (int64_t d = 0; d < dim; ++d)
            to[d] = static_cast<int8_t>(std::clamp(std::nearbyint(static_cast<float>(from[d]) / scale), -127.0f, 127.0f));
          *rows.scale(b, kv, position) = scale;
        } else if constexpr (std::is_same_v<QT, KT>) {
          std::copy(from, from + dim, to);
        } else {
          for (int64_t d = 0; d < dim; ++d) to[d] = static_cast<KT>(static_cast<float>(from[d]));
        }
      }
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

  // The bf16 body reads queries and rows as bf16 (its scores scaled after), the others as float32
  // (queries scaled before).
  constexpr bool kPairs = std::is_same_v<Math, Avx512Bf16Math>;
  using Row = std::conditional_t<kPairs, c10::BFloat16, float>;
  const int64_t item_count = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), item_count), 1, [&](int64_t, int64_t) {
    std::vector<float> scores, acc, tops, totals, converted(kBlock * dim), row_scales(kBlock);
    std::vector<Row> queries;
    std::vector<const float*> pointers(kBlock);
    std::vector<const KT*> sources(kBlock);
    std::vector<const Row*> lane_queries(kTileRows * heads);
    std::vector<float*> lane_scores(kTileRows * heads), lane_sums(kTileRows * heads);
    for (int64_t it = next_item++; it < item_count; it = next_item++) {
      const Item item = items[it];
      const int64_t b = item.request, length = lengths[b];
      const int64_t first_pos = length - news[b] + item.first_row;  // position of the tile's first row
      const int64_t key_begin = item.key_begin, keys = item.key_end - key_begin;
      const int64_t lanes = item.rows * heads;  // (row, query head) pairs, lane = row * heads + head
      scores.assign(lanes * keys, 0.0f);
      queries.resize(lanes * dim);
      acc.assign(lanes * dim, 0.0f);
      for (int64_t r = 0; r < item.rows; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          const QT* src = q_data + (starts[b] + item.first_row + r) * q_row + h * q_head;
          Row* dst = queries.data() + (r * heads + h) * dim;
          if constexpr (kPairs)
            std::copy(src, src + dim, dst);
          else
            for (int64_t d = 0; d < dim; ++d) dst[d] = widen(src[d]) * static_cast<float>(scale);
        }
      // Row r sees the item's keys [key_begin, key_begin + seen(r)); rows before key j skip it.
      auto seen = [&](int64_t r) { return std::clamp<int64_t>(first_pos + r + 1 - key_begin, 0, keys); };
      auto first_row = [&](int64_t j) { return std::max<int64_t>(0, key_begin + j - first_pos); };
      // One block of keys' (or values') rows for kv head `kv`, as floats: the cache's own rows,
      // or (a float16 or bfloat16 cache, read at half the bytes, or an int8 one at a quarter)
      // widened into `converted`, 16 rows at a time: never a copy of the request's K/V.
      // Past the pass's last key, the prefetch runs on into what is read next: the item's values
      // after its keys, the next item's keys (a guess: the other thread may take it) after its values.
      const int64_t peek = next_item.load(std::memory_order_relaxed);
      const Item* next = peek < item_count ? &items[peek] : nullptr;
      auto block_rows = [&](const Rows& rows_of, int64_t kv, int64_t jb, int64_t n) -> const Row* const* {
        for (int64_t j = 0; j < n; ++j) sources[j] = rows_of(b, kv, key_begin + jb + j);
        const bool keys_pass = &rows_of == &key_rows;
        const int64_t ahead = jb + kPrefetchBlocks * kBlock;
        for (int64_t j = ahead; j < ahead + kBlock; ++j) {
          const KT* row = j < keys        ? rows_of(b, kv, key_begin + j)
                          : keys_pass     ? value_rows(b, kv, key_begin + j - keys)
                          : next != nullptr && j - keys < next->key_end - next->key_begin
                              ? key_rows(next->request, kv, next->key_begin + j - keys)
                              : nullptr;
          if (row == nullptr || (keys_pass && j - keys >= keys)) break;
          for (int64_t byte = 0; byte < dim * static_cast<int64_t>(sizeof(KT)); byte += 64)
            __builtin_prefetch(reinterpret_cast<const char*>(row) + byte);
        }
        if constexpr (std::is_same_v<KT, Row>) {
          return sources.data();
        } else {
          if constexpr (std::is_same_v<KT, int8_t>) {
            for (int64_t j = 0; j < n; ++j) row_scales[j] = *rows_of.scale(b, kv, key_begin + jb + j);
            Math::widen(sources.data(), row_scales.data(), n, dim, converted.data());
          } else {
            Math::widen(sources.data(), n, dim, converted.data());
          }
          for (int64_t j = 0; j < n; ++j) pointers[j] = converted.data() + j * dim;
          return pointers.data();
        }
      };
      // The lanes of kv head `kv` whose rows see key jb: their queries, scores (from jb) and sums.
      auto lanes_from = [&](int64_t jb, int64_t kv) {
        int64_t count = 0;
        for (int64_t r = first_row(jb); r < item.rows; ++r)
          for (int64_t lane = r * heads + kv * group; lane < r * heads + (kv + 1) * group; ++lane, ++count) {
            lane_queries[count] = queries.data() + lane * dim;
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
          for (int64_t kv = 0; kv < kv_heads; ++kv) {
            const Row* rows[2 * kBlock];
            for (int64_t at = 0; at < n; at += kBlock) {
              const int64_t part = std::min(kBlock, n - at);
              std::copy_n(block_rows(rows_of, kv, jb + at, part), part, rows + at);
            }
            fn(rows, n, lanes_from(jb, kv));
          }
        }
      };
      // Scores for every key a row might see (keys past a row's own last one get weight 0 below).
      by_blocks(key_rows, [&](const Row* const* rows, int64_t n, int64_t count) {
        if constexpr (kPairs)
          Math::dots_lanes(lane_queries.data(), lane_scores.data(), count, rows, n, dim, scale);
        else
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
        else
          accumulate_lanes<Math>(lane_sums.data(), lane_scores.data(), count, rows, n, dim);
      });
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

// The widest body this CPU allows for this head_dim, capped as torch caps its own kernels
// by ATEN_CPU_CAPABILITY (`avx2` or `default`): torch does not export its own choice.
std::string simd_for(int64_t head_dim) {
#if defined(__x86_64__)
  static const std::string widest = [] {
    const char* asked = std::getenv("ATEN_CPU_CAPABILITY");
    const std::string cap = asked ? asked : "";
    const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
    if (cap == "default" || !avx2) return std::string("scalar");
    return std::string(avx512 && cap != "avx2" ? "avx512" : "avx2");
  }();
  if (widest == "avx512" && head_dim % 16 == 0) return widest;
  if (widest != "scalar" && head_dim % 8 == 0) return "avx2";
#endif
  return "scalar";
}

// Whether bf16 queries over a bf16 cache take the AVX512_BF16 body: where the CPU has it, the
// AVX-512 body is chosen, head_dim fits, and ONEDNN_MAX_CPU_ISA (which caps torch's bf16 matmuls
// below it) does not cap it too.
bool bf16_dots(int64_t head_dim) {
#if defined(__x86_64__)
  static const bool allowed = [] {
    const char* cap = std::getenv("ONEDNN_MAX_CPU_ISA");
    const std::string below[] = {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI"};
    const bool capped = cap && std::find(std::begin(below), std::end(below), std::string(cap)) != std::end(below);
    return !capped && __builtin_cpu_supports("avx512bf16");
  }();
  return allowed && simd_for(head_dim) == "avx512" && Avx512Bf16Math::fits(head_dim);
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

// An int8 cache's scales, which it needs, and a float cache's, which it has none of.
void check_scales(const at::Tensor& cache, const std::optional<at::Tensor>& k_scales,
                  const std::optional<at::Tensor>& v_scales) {
  const bool int8 = cache.scalar_type() == at::kChar;
  TORCH_CHECK(k_scales.has_value() == int8 && v_scales.has_value() == int8,
              int8 ? "an int8 cache needs k_scales and v_scales" : "only an int8 cache has scales");
  if (!int8) return;
  for (const at::Tensor* t : {&*k_scales, &*v_scales})
    TORCH_CHECK(t->device().is_cpu() && t->scalar_type() == at::kFloat && t->dim() == 3 &&
                    t->sizes() == cache.sizes().slice(0, 3) && t->stride(2) == 1,
                "k_scales and v_scales must be float32 CPU tensors shaped like the cache without head_dim, "
                "contiguous kv heads");
}

void ragged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const at::Tensor& reqids, const at::Tensor& starts, const at::Tensor& new_tokens,
                      const at::Tensor& lengths, double scale, const std::optional<at::Tensor>& k,
                      const std::optional<at::Tensor>& v, const std::optional<at::Tensor>& k_scales,
                      const std::optional<at::Tensor>& v_scales) {
  const int64_t batch =
      check_batch(out, q, k_cache, v_cache, starts, new_tokens, lengths, "[slots, context, kv_heads, head_dim]");
  const bool fresh = check_fresh(q, k_cache, k, v);
  check_scales(k_cache, k_scales, v_scales);
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
    const SlotRows<KT> keys(k_cache, ids, k_scales), values(v_cache, ids, v_scales);
    if (fresh) {
      store<QT, KT>(*k, keys, rows, news, lens, batch);
      store<QT, KT>(*v, values, rows, news, lens, batch);
    }
    attend<Math, QT, KT>(out, q, keys, values, k_cache.size(2), rows, news, lens, batch, scale);
  });
}

void paged_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_blocks,
                     const at::Tensor& v_blocks, const at::Tensor& block_table, const at::Tensor& starts,
                     const at::Tensor& new_tokens, const at::Tensor& lengths, double scale,
                     const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v,
                     const std::optional<at::Tensor>& k_scales, const std::optional<at::Tensor>& v_scales) {
  const int64_t batch =
      check_batch(out, q, k_blocks, v_blocks, starts, new_tokens, lengths, "[blocks, block_size, kv_heads, head_dim]");
  const bool fresh = check_fresh(q, k_blocks, k, v);
  check_scales(k_blocks, k_scales, v_scales);
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
    const BlockRows<KT> keys(k_blocks, block_table, k_scales), values(v_blocks, block_table, v_scales);
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
  // and into an int8 cache's scales (d!), (e!).
  m.def(
      "ragged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor reqids, "
      "Tensor starts, Tensor new_tokens, Tensor lengths, float scale, Tensor? k=None, Tensor? v=None, "
      "Tensor(d!)? k_scales=None, Tensor(e!)? v_scales=None) -> ()");
  m.def(
      "paged_attention(Tensor(a!) out, Tensor q, Tensor(b!) k_blocks, Tensor(c!) v_blocks, Tensor block_table, "
      "Tensor starts, Tensor new_tokens, Tensor lengths, float scale, Tensor? k=None, Tensor? v=None, "
      "Tensor(d!)? k_scales=None, Tensor(e!)? v_scales=None) -> ()");
  m.def("attention_simd(int head_dim) -> str", &simd_for);
  m.def("attention_bf16_dots(int head_dim) -> bool", &bf16_dots);
}

TORCH_LIBRARY_IMPL(vattn, CPU, m) {
  m.impl("ragged_attention", &ragged_attention);
  m.impl("paged_attention", &paged_attention);
}
