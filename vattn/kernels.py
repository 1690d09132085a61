"""Unmodified attention kernels on the KV cache's virtual tensors, selectable by name.

Every kernel takes one iteration's new tokens packed ragged, `[tokens, heads, head_dim]`,
writes their K/V into the cache and returns their attention output. Request i's new
tokens sit at positions `[length - new, length)` of its slot, where `length` is what
`KVCache.step()` guaranteed; nothing reads or writes past it, so no kernel can touch an
unmapped page. The GPU libraries are imported only when their kernel is made.

    kernel = make_kernel("sdpa", cache, num_query_heads=8)
    batch = kernel.plan([reqid_a, reqid_b], new_tokens=[17, 1])   # once per iteration
    out = kernel.forward(layer, batch, q, k, v)                   # once per layer
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vattn.config import exact_int, is_int
from vattn.errors import UnavailableError
from vattn.kv_cache import KVCache
from vattn.memory import Lease
from vattn.ops import vattn_ops
from vattn.sizes import MiB

FLASHINFER_WORKSPACE_BYTES = 128 * MiB


@dataclass(frozen=True)
class AttentionBatch:
    """One iteration's requests, checked against the cache; built once, used by every layer.

    Request i owns query rows `[starts[i], starts[i + 1])` and cache positions
    `[lengths[i] - new_tokens[i], lengths[i])` of row `reqids[i]` of the virtual tensors.
    """

    reqids: tuple[int, ...]
    new_tokens: tuple[int, ...]
    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    device_reqids: torch.Tensor
    """int32 `[batch]`: `reqids` on the cache's device."""
    cached_lengths: torch.Tensor
    """int32 `[batch]`: tokens each request had before this iteration."""
    token_reqids: torch.Tensor
    """int64 `[tokens]`: reqid of each new token."""
    token_positions: torch.Tensor
    """int64 `[tokens]`: cache position of each new token."""
    lease: Lease
    """Holds the requests' slots while the batch lives (see `KVCache.pin`): drop the batch
    when the iteration ends, so freed slots can be reused at once."""
    wrapper: Any = None
    """A kernel's own per-iteration state (FlashInfer's planned wrapper)."""

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.new_tokens)

    def requests(self) -> Iterator[tuple[slice, int, int, int]]:
        """(query rows, reqid, new tokens, length) of each request."""
        for i, (reqid, new, length) in enumerate(zip(self.reqids, self.new_tokens, self.lengths, strict=True)):
            yield slice(self.starts[i], self.starts[i + 1]), reqid, new, length


def iteration_rows(
    reqids: Sequence[int], new_tokens: Sequence[int], lengths: Sequence[int], shared: Sequence[int] | None = None
) -> tuple[list[int], list[int]]:
    """Each request's new-token count checked against its length (1 to length, and never
    into its `shared` first tokens, which other requests read), and the first query row of
    each request followed by the total."""
    shared = shared or [0] * len(lengths)
    checked = [
        exact_int(
            new,
            f"reqid {reqid}: new tokens" + (f" (after its {frozen} shared tokens)" if frozen else ""),
            1,
            length - frozen,
        )
        for reqid, new, length, frozen in zip(reqids, new_tokens, lengths, shared, strict=True)
    ]
    starts = [0]
    for new in checked:
        starts.append(starts[-1] + new)
    return checked, starts


class AttentionKernel(ABC):
    """An attention implementation bound to one cache and one model's query head count."""

    name: str

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        cfg = cache.config
        if not is_int(num_query_heads) or num_query_heads <= 0 or num_query_heads % cfg.num_kv_heads:
            raise ValueError(
                f"num_query_heads must be a positive multiple of num_kv_heads ({cfg.num_kv_heads}), "
                f"got {num_query_heads!r}"
            )
        self.cache = cache
        self.num_query_heads = num_query_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)

    def plan(self, reqids: Sequence[int], new_tokens: Sequence[int]) -> AttentionBatch:
        """Checks the iteration against the cache's lengths and builds its index tensors."""
        if not reqids or len(reqids) != len(new_tokens):
            raise ValueError(
                f"plan needs one new-token count per reqid, got {len(reqids)} reqids, {len(new_tokens)} counts"
            )
        reqids = [exact_int(reqid, "reqid", 0, self.cache.config.max_slots - 1) for reqid in reqids]
        if len(set(reqids)) != len(reqids):
            raise ValueError(f"reqids must be distinct, got {list(reqids)}")
        lengths = self.cache.lengths(reqids)
        new_tokens, starts = iteration_rows(reqids, new_tokens, lengths, self.cache.shared_lengths(reqids))
        device = self.cache.device
        token_reqids = [reqid for reqid, new in zip(reqids, new_tokens, strict=True) for _ in range(new)]
        positions = [p for new, n in zip(new_tokens, lengths, strict=True) for p in range(n - new, n)]
        batch = AttentionBatch(
            reqids=tuple(reqids),
            new_tokens=tuple(new_tokens),
            lengths=tuple(lengths),
            starts=tuple(starts),
            device_reqids=torch.tensor(reqids, dtype=torch.int32, device=device),
            cached_lengths=torch.tensor(
                [n - new for n, new in zip(lengths, new_tokens, strict=True)], dtype=torch.int32, device=device
            ),
            token_reqids=torch.tensor(token_reqids, dtype=torch.int64, device=device),
            token_positions=torch.tensor(positions, dtype=torch.int64, device=device),
            lease=self.cache.pin(reqids),
        )
        return self._planned(batch)

    def _planned(self, batch: AttentionBatch) -> AttentionBatch:
        """Hook for per-iteration kernel state."""
        return batch

    def forward(
        self, layer: int, batch: AttentionBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """Stores k/v `[tokens, kv_heads, head_dim]` and returns causal attention of q `[tokens,
        query_heads, head_dim]` over each request's cache, `[tokens, query_heads, head_dim]`."""
        cfg = self.cache.config
        expected = {
            "q": (q, (batch.num_tokens, self.num_query_heads, cfg.head_dim)),
            "k": (k, (batch.num_tokens, cfg.num_kv_heads, cfg.head_dim)),
            "v": (v, (batch.num_tokens, cfg.num_kv_heads, cfg.head_dim)),
        }
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape or tensor.dtype != cfg.dtype or tensor.device != self.cache.device:
                raise ValueError(
                    f"{name} must be {cfg.dtype} {list(shape)} on {self.cache.device}, "
                    f"got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
                )
        return self._forward(self._layer_kv(layer), batch, q, k, v)

    def _layer_kv(self, layer: int) -> tuple[Tensor, Tensor]:
        """The layer's K and V tensors, as `_forward` reads them."""
        return self.cache._layer_tensors(layer)

    @abstractmethod
    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Stores k/v into `kv` (the layer's K and V virtual tensors) and attends."""

    @staticmethod
    def _store(kv: tuple[Tensor, Tensor], batch: AttentionBatch, k: Tensor, v: Tensor) -> None:
        """Writes the new tokens' K/V into their rows in one indexed copy per tensor."""
        index = (batch.token_reqids, batch.token_positions)
        kv[0].index_put_(index, k)
        kv[1].index_put_(index, v)


def sdpa_request(query: Tensor, keys: Tensor, values: Tensor, length: int, scale: float) -> Tensor:
    """torch SDPA for one request: `query` [new, heads, dim] at the last `new` of `length`
    positions over its `[length, kv_heads, dim]` keys and values; returns [new, heads, dim]."""
    new = query.shape[0]
    # Causal, aligned to the end (query j sits at position length - new + j); SDPA's own
    # is_causal aligns to the start, which agrees only when the whole context is new.
    whole = new == length
    mask = (
        None if new == 1 or whole else torch.ones(new, length, dtype=torch.bool, device=query.device).tril(length - new)
    )
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=whole and new > 1,
        scale=scale,
        enable_gqa=True,
    )
    return attended.squeeze(0).transpose(0, 1)


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


def split_long_chunks(new_tokens: Sequence[int], long_chunk: int) -> tuple[list[int], tuple[int, ...]]:
    """Indexes of the requests with at most `long_chunk` new tokens, and of the others."""
    short = [i for i, new in enumerate(new_tokens) if new <= long_chunk]
    return short, tuple(i for i, new in enumerate(new_tokens) if new > long_chunk)


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
    request per layer, which dominates a decode step at dozens of requests; but torch's
    flash kernel is several times faster on a long chunk, whose many query rows make
    attention compute-bound, so chunks of more than `LONG_CHUNK` tokens go to SDPA."""

    name = "ragged"
    LONG_CHUNK = 32

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


def require_gpu(device: torch.device, kernel: str) -> None:
    if device.type != "cuda":
        raise UnavailableError(f"the {kernel} kernel runs on a GPU; this cache is on {device} (backend='cuda')")


class FlashAttnKernel(AttentionKernel):
    """FlashAttention's `flash_attn_with_kvcache`: `cache_batch_idx` = slots, `cache_seqlens` =
    cached lengths, new K/V appended in place by the kernel. Decode batches run in one call,
    prefill chunks one request per call."""

    name = "flash_attn"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        try:
            from flash_attn import flash_attn_with_kvcache
        except ImportError as exc:
            raise UnavailableError(f"the flash_attn kernel needs flash-attn (pip install flash-attn): {exc}") from exc
        self._attend = flash_attn_with_kvcache

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = kv
        if batch.is_decode:
            out = self._attend(
                q.unsqueeze(1),
                keys,
                values,
                k=k.unsqueeze(1),
                v=v.unsqueeze(1),
                cache_seqlens=batch.cached_lengths,
                cache_batch_idx=batch.device_reqids,
                softmax_scale=self.scale,
                causal=True,
            )
            return out.squeeze(1)
        out = torch.empty_like(q)
        for i, (rows, *_) in enumerate(batch.requests()):
            one = slice(i, i + 1)
            out[rows] = self._attend(
                q[rows].unsqueeze(0),
                keys,
                values,
                k=k[rows].unsqueeze(0),
                v=v[rows].unsqueeze(0),
                cache_seqlens=batch.cached_lengths[one],
                cache_batch_idx=batch.device_reqids[one],
                softmax_scale=self.scale,
                causal=True,
            ).squeeze(0)
        return out


def import_flashinfer() -> Any:
    try:
        import flashinfer
    except ImportError as exc:
        raise UnavailableError(
            f"the FlashInfer kernels need flashinfer (pip install flashinfer-python): {exc}"
        ) from exc
    return flashinfer


class FlashInferSingleKernel(AttentionKernel):
    """FlashInfer's `single_prefill_with_kv_cache` / `single_decode_with_kv_cache` on each
    request's `[length, kv_heads, dim]` slice (contiguous in the per-layer layout)."""

    name = "flashinfer_single"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        if cache.config.layout != "per_layer":
            raise ValueError("flashinfer_single needs each slot's K/V contiguous: use layout='per_layer'")
        self._flashinfer = import_flashinfer()

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        keys, values = kv
        out = torch.empty_like(q)
        for rows, reqid, new, length in batch.requests():
            key, value = keys[reqid, :length], values[reqid, :length]
            if new == 1:
                out[rows] = self._flashinfer.single_decode_with_kv_cache(
                    q[rows.start], key, value, kv_layout="NHD", sm_scale=self.scale
                ).unsqueeze(0)
            else:
                out[rows] = self._flashinfer.single_prefill_with_kv_cache(
                    q[rows], key, value, causal=True, kv_layout="NHD", sm_scale=self.scale
                )
        return out


class FlashInferPagedKernel(AttentionKernel):
    """FlashInfer's paged wrappers reading the virtual tensors as a paged cache with
    `page_size = max_context`: page i is slot i, one page per request, `last_page_len` =
    its length. One planned call per layer for the whole batch, decode or mixed."""

    name = "flashinfer_paged"

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        super().__init__(cache, num_query_heads)
        require_gpu(cache.device, self.name)
        flashinfer = import_flashinfer()
        workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=cache.device)
        self._decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")

    def _planned(self, batch: AttentionBatch) -> AttentionBatch:
        cfg, device = self.cache.config, self.cache.device
        pages = torch.arange(len(batch.reqids) + 1, dtype=torch.int32, device=device)
        last_page_len = torch.tensor(batch.lengths, dtype=torch.int32, device=device)
        shape = (self.num_query_heads, cfg.num_kv_heads, cfg.head_dim, cfg.max_context)
        if batch.is_decode:
            wrapper = self._decode
            wrapper.plan(pages, batch.device_reqids, last_page_len, *shape, q_data_type=cfg.dtype, sm_scale=self.scale)
        else:
            wrapper = self._prefill
            rows = torch.tensor(batch.starts, dtype=torch.int32, device=device)
            wrapper.plan(
                rows,
                pages,
                batch.device_reqids,
                last_page_len,
                *shape,
                causal=True,
                q_data_type=cfg.dtype,
                sm_scale=self.scale,
            )
        return replace(batch, wrapper=wrapper)

    def _forward(self, kv: tuple[Tensor, Tensor], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self._store(kv, batch, k, v)
        return batch.wrapper.run(q, kv)


KERNELS: dict[str, type[AttentionKernel]] = {
    kernel.name: kernel
    for kernel in (SdpaKernel, RaggedKernel, FlashAttnKernel, FlashInferSingleKernel, FlashInferPagedKernel)
}


def make_kernel(name: str, cache: KVCache, num_query_heads: int) -> AttentionKernel:
    """The kernel called `name` (see KERNELS) on `cache`; UnavailableError if it cannot run here."""
    if name not in KERNELS:
        raise ValueError(f"unknown attention kernel {name!r}; available: {', '.join(KERNELS)}")
    return KERNELS[name](cache, num_query_heads)
