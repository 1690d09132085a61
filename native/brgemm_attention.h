// Prompt chunks' attention as matrix products on oneDNN's batch-reduce GEMM (torch's
// at::native::cpublas::brgemm): bf16 queries over a bf16 or int8 virtual cache on AMX, float32
// queries over a float32 cache on AVX-512.
// native/ragged_attention.cpp sends it the requests of a call that compute many new tokens; its
// own dot-product bodies keep the decodes.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

// The requests of one call that go to brgemm_attention: each one's cache slot, first query row,
// new tokens and length (as ragged_attention's arguments, for these requests only).
struct PromptChunks {
  std::vector<int64_t> slots, starts, news, lengths;
  void add(int64_t slot, int64_t start, int64_t count, int64_t length) {
    slots.push_back(slot), starts.push_back(start), news.push_back(count), lengths.push_back(length);
  }
  bool empty() const { return slots.empty(); }
};

// New tokens from which a request's chunk runs on brgemm; fewer take the dot-product body, which
// does not pay for packing the request's keys and values (a cost that grows with its length, not
// its new tokens). On an AMX Xeon, 2 threads, 8 requests of 128 or 512 keys, bf16: level at 16
// new tokens, brgemm 1.05-1.4x at 32 and 1.7-1.8x at 64, 0.1-0.8x at 1-8. On an AMD EPYC (Zen 4),
// float32, the same requests: 1.17x at 32 new tokens, 0.96-1.17x at 64, 1.18x at 128 over 512.
constexpr int64_t kBrgemmMinTokens = 32;

// Whether ONEDNN_MAX_CPU_ISA leaves oneDNN `isa` (one of SSE41 ... AVX512_CORE_AMX, its names),
// which vattn's own bodies follow as torch's matmuls do: unset, or a cap at or above it.
bool onednn_allows(const std::string& isa);

// Whether brgemm_attention runs here for queries of `dtype`: bf16 where oneDNN packs it for brgemm
// (AMX; torch's cpublas::could_pack) and ONEDNN_MAX_CPU_ISA does not cap oneDNN below AMX, head_dim
// a multiple of 32; float32 where that cap leaves AVX512_CORE, head_dim a multiple of 16; both only
// where ATEN_CPU_CAPABILITY leaves vattn's bodies AVX-512 (its softmax's) and head_dim is at most 256.
bool brgemm_attention_runs(at::ScalarType dtype, int64_t head_dim);

// Causal attention of `chunks`' new tokens (rows of q [tokens, heads, head_dim], bf16 or float32)
// over their slots' keys and values ([slots, context, kv_heads, head_dim], the new ones already
// stored), written to the same rows of `out`. The cache is q's dtype, or (bf16 queries) int8 with its rows' (scale, midpoint) qparams (the
// ragged kernel's int8 cache), widened to bf16 as its rows are packed; the new tokens' own rows
// are read from k and v ([tokens, kv_heads, head_dim] as q's rows) where the call gives them.
void brgemm_attention(const at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                      const std::optional<at::Tensor>& k_qparams, const std::optional<at::Tensor>& v_qparams,
                      const std::optional<at::Tensor>& k, const std::optional<at::Tensor>& v, const PromptChunks& chunks,
                      double scale);
