"""Unmodified attention kernels on the KV cache's virtual tensors, selectable by name.

The CPU kernels live here, the GPU adapters (FlashAttention, FlashInfer) in
`vattn.gpu_kernels`, which imports its libraries only when a kernel is made; the contract
they all keep is `vattn.attention`'s.

    kernel = make_kernel("sdpa", cache, num_query_heads=8)
    batch = kernel.plan([reqid_a, reqid_b], new_tokens=[17, 1])   # once per iteration
    out = kernel.forward(layer, batch, q, k, v)                   # once per layer
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor

from vattn.attention import AttentionBatch, AttentionKernel, sdpa_request, split_long_chunks
from vattn.errors import UnavailableError
from vattn.gpu_kernels import FlashAttnKernel, FlashInferPagedKernel, FlashInferSingleKernel
from vattn.kv_cache import KVCache
from vattn.ops import vattn_ops


class SdpaKernel(AttentionKernel):
    """torch `scaled_dot_product_attention` on each request's `[heads, length, dim]` view (CPU or GPU)."""

    name = "sdpa"

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        keys, values = kv
        out = torch.empty_like(q)
        for rows, reqid, _, length in batch.requests():
            out[rows] = sdpa_request(q[rows], keys[reqid, :length], values[reqid, :length], length, self.scale)
        return out


@dataclass(frozen=True)
class RaggedPlan:
    """The ragged kernel's split of an iteration: short requests for its one call, as int64
    vectors (reqids, first query rows, new tokens, lengths), and long prefill chunks for SDPA."""

    short: tuple[Tensor, Tensor, Tensor, Tensor] | None
    long: tuple[int, ...]
    """Indexes into the batch's requests."""


class RaggedKernel(AttentionKernel):
    """vattn's own CPU kernel (native/ragged_attention.cpp) for decodes and short prefill
    chunks: one call per layer for all of them, each request reading its slot's contiguous
    K/V only up to its length. Per-request SDPA costs a call (and for chunks a mask) per
    request per layer, which dominates a decode step at dozens of requests. torch's flash
    kernel is faster only on chunks of more than ~1,000 tokens (one request, 9 query heads
    over 3 KV heads of 64: 1.5x slower than this kernel at 256 new tokens, even at 1,024, 1.2x
    faster at 2,048), so chunks of more than `LONG_CHUNK` tokens go to SDPA."""

    name = "ragged"
    LONG_CHUNK = 512
    reads_narrower_cache = True

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        if cache.device.type != "cpu":
            raise UnavailableError(f"the ragged kernel runs on the CPU; this cache is on {cache.device}")
        self._attend = vattn_ops().ragged_attention

    def _planned(self, batch: AttentionBatch) -> AttentionBatch:
        short, long = split_long_chunks(batch.new_tokens, self.LONG_CHUNK)
        vectors = None
        if short:
            vectors = tuple(
                torch.tensor([column[i] for i in short], dtype=torch.int64)
                for column in (batch.reqids, batch.starts, batch.new_tokens, batch.lengths)
            )
        return replace(batch, wrapper=RaggedPlan(vectors, long))  # type: ignore[arg-type]

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        keys, values = kv
        plan: RaggedPlan = batch.wrapper
        out = torch.empty_like(q)
        if plan.short is not None:
            self._attend(out, q, keys, values, *plan.short, self.scale)
        for i in plan.long:
            rows, reqid, length = slice(batch.starts[i], batch.starts[i + 1]), batch.reqids[i], batch.lengths[i]
            out[rows] = sdpa_request(q[rows], keys[reqid, :length], values[reqid, :length], length, self.scale)
        return out


KERNELS: dict[str, type[AttentionKernel]] = {
    kernel.name: kernel
    for kernel in (SdpaKernel, RaggedKernel, FlashAttnKernel, FlashInferSingleKernel, FlashInferPagedKernel)
}


def make_kernel(name: str, cache: KVCache, num_query_heads: int) -> AttentionKernel:
    """The kernel called `name` (see KERNELS) on `cache`; UnavailableError if it cannot run here."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; available: {', '.join(KERNELS)}")
    return KERNELS[name](cache, num_query_heads)
