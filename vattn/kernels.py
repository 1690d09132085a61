"""Unmodified attention kernels on the KV cache's virtual tensors, selectable by name.

The CPU kernels live here, the GPU adapters (FlashAttention 2 as torch ships it and as
flash-attn does, FlashInfer) in
`vattn.gpu_kernels`, which imports its libraries only when a kernel is made; the contract
they all keep is `vattn.attention`'s.

    kernel = make_kernel("sdpa", cache, num_query_heads=8)
    batch = kernel.plan([reqid_a, reqid_b], new_tokens=[17, 1])   # once per iteration
    out = kernel.forward(layer, batch, q, k, v)                   # once per layer
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import Tensor

from vattn.attention import AttentionBatch, AttentionKernel, sdpa_request
from vattn.errors import UnavailableError
from vattn.gpu_kernels import FlashAttnKernel, FlashInferPagedKernel, FlashInferSingleKernel, TorchFlashAttnKernel
from vattn.kv_cache import KVCache
from vattn.ops import vattn_ops


class SdpaKernel(AttentionKernel):
    """torch `scaled_dot_product_attention` on each request's `[heads, length, dim]` view (CPU or GPU)."""

    name = "sdpa"

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        keys, values = kv
        out = torch.empty_like(q)
        for request in batch.requests():
            reqid, rows, length = request.reqid, request.rows, request.length
            out[rows] = sdpa_request(q[rows], keys[reqid, :length], values[reqid, :length], length, self.scale)
        return out


class RaggedKernel(AttentionKernel):
    """vattn's own CPU kernel (native/ragged_attention.cpp) for decodes and prefill chunks
    together: one call per layer for all of them, each request reading its slot's contiguous
    K/V only up to its length. Per-request SDPA costs a call (and for chunks a mask) per
    request per layer, which dominates a decode step at dozens of requests; and torch's flash
    kernel is slower on chunks too (one request, 9 query heads over 3 KV heads of 64: 2.0x
    at 256 new tokens, 1.6x at 1,024, 1.2x at 4,096). The same call first writes the new
    tokens' K/V into their rows, rounded to the cache's dtype (two indexed copies per layer
    had cost a decode step at one request more than its attention). Prompt chunks of 32 or more
    new tokens run as matrix products on oneDNN's brgemm instead (native/brgemm_attention.cpp):
    bf16 on AMX (~2x the dot products on an AMX Xeon's prompts of 128-512), float32 on any
    AVX-512 CPU (level to 1.4x on an AMD EPYC's, the most at long prompts)."""

    name = "ragged"
    reads_narrower_cache = True
    reads_int8_cache = True

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        if cache.device.type != "cpu":
            raise UnavailableError(f"the ragged kernel runs on the CPU; this cache is on {cache.device}")
        self._attend = vattn_ops().ragged_attention

    def _planned(self, batch: AttentionBatch) -> AttentionBatch:
        """The kernel's int64 vectors: reqids, first query rows, new tokens, lengths."""
        columns = (batch.reqids, batch.starts[:-1], batch.new_tokens, batch.lengths)
        return replace(batch, wrapper=tuple(torch.tensor(column, dtype=torch.int64) for column in columns))

    def _layer_kv(self, layer: int) -> tuple[Tensor, ...]:
        """K and V, and an int8 cache's K and V qparams after them."""
        kv = self.cache.layer_tensors(layer)
        return (*kv, *self.cache.layer_qparams(layer)) if self.cache.config.quantized else kv

    def _forward(self, kv: tuple[Tensor, ...], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out = torch.empty_like(q)
        keys, values, *qparams = kv
        self._attend(out, q, keys, values, *batch.wrapper, self.scale, k, v, *qparams)  # stores k, v, then attends
        return out


KERNELS: dict[str, type[AttentionKernel]] = {
    kernel.name: kernel
    for kernel in (
        SdpaKernel,
        RaggedKernel,
        TorchFlashAttnKernel,
        FlashAttnKernel,
        FlashInferSingleKernel,
        FlashInferPagedKernel,
    )
}


def make_kernel(name: str, cache: KVCache, num_query_heads: int) -> AttentionKernel:
    """The kernel called `name` (see KERNELS) on `cache`; UnavailableError if it cannot run here."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; available: {', '.join(KERNELS)}")
    return KERNELS[name](cache, num_query_heads)
