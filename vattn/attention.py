"""What every attention kernel shares: the checked batch of one iteration and the kernel base.

A kernel takes one iteration's new tokens packed ragged, `[tokens, heads, head_dim]`,
writes their K/V into the cache and returns their attention output. Request i's new
tokens sit at positions `[length - new, length)` of its slot, where `length` is what
`KVCache.step()` guaranteed; nothing reads or writes past it, so no kernel can touch an
unmapped page.
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from vattn.kv_cache import KVCache
from vattn.memory import Lease
from vattn.validate import exact_int, is_int


class BatchRequest(NamedTuple):
    """One request of an iteration's batch."""

    index: int
    """Its place in the batch."""
    rows: slice
    """Its new tokens' query rows."""
    reqid: int
    new_tokens: int
    length: int
    """Its tokens after this iteration: the new ones are the last `new_tokens` of them."""


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One iteration's requests, checked against the cache; built once, used by every layer.
    Request i owns query rows `[starts[i], starts[i + 1])` and cache positions
    `[lengths[i] - new_tokens[i], lengths[i])` of its slot (the virtual cache's row `reqids[i]`,
    or the paged cache's blocks)."""

    reqids: tuple[int, ...]
    new_tokens: tuple[int, ...]
    lengths: tuple[int, ...]
    starts: tuple[int, ...]
    token_positions: torch.Tensor
    """int64 `[tokens]`: cache position of each new token."""
    wrapper: Any = None
    """A kernel's own per-iteration state (FlashInfer's planned wrapper, the ragged kernel's vectors)."""

    @property
    def num_tokens(self) -> int:
        return self.starts[-1]

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.new_tokens)

    def requests(self) -> Iterator[BatchRequest]:
        for i, (reqid, new, length) in enumerate(zip(self.reqids, self.new_tokens, self.lengths, strict=True)):
            yield BatchRequest(i, slice(self.starts[i], self.starts[i + 1]), reqid, new, length)


@dataclass(frozen=True, kw_only=True)
class AttentionBatch(Batch):
    """A batch on the virtual cache: request i's new tokens go to row `reqids[i]` of the virtual tensors."""

    device_reqids: torch.Tensor
    """int32 `[batch]`: `reqids` on the cache's device."""
    cached_lengths: torch.Tensor
    """int32 `[batch]`: tokens each request had before this iteration."""
    token_reqids: torch.Tensor
    """int64 `[tokens]`: reqid of each new token."""
    lease: Lease
    """Holds the requests' slots while the batch lives (see `KVCache.pin`): drop the batch
    when the iteration ends, so freed slots can be reused at once."""


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
    reads_narrower_cache = False
    """Whether float32 q/k/v may attend over a float16 or bfloat16 cache (widened as it is read)."""
    reads_int8_cache = False
    """Whether it reads an int8 cache's values and qparams (float32 q/k/v, quantized as stored)."""

    def __init__(self, cache: KVCache, num_query_heads: int) -> None:
        cfg = cache.config
        if cfg.quantized and not self.reads_int8_cache:
            readers = ", ".join(sorted(k.name for k in kernel_classes() if k.reads_int8_cache))
            raise ValueError(f"the {self.name} kernel cannot read an int8 KV cache; the kernels that can: {readers}")
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
        narrower = self.reads_narrower_cache or self.reads_int8_cache
        int8 = {torch.float32, torch.bfloat16}  # an int8 cache's queries (vattn's CPU kernels read both)
        dtypes = int8 if cfg.dtype == torch.int8 else {cfg.dtype, torch.float32} if narrower else {cfg.dtype}
        for name, (tensor, shape) in expected.items():
            if tuple(tensor.shape) != shape or tensor.dtype not in dtypes or tensor.device != self.cache.device:
                raise ValueError(
                    f"{name} must be {' or '.join(map(str, sorted(dtypes, key=str)))} {list(shape)} on "
                    f"{self.cache.device}, got {tensor.dtype} {list(tensor.shape)} on {tensor.device}"
                )
        with sdpa_backends(self.cache.device):
            return self._forward(self._layer_kv(layer), batch, q, k, v)

    def _layer_kv(self, layer: int) -> tuple[Tensor, ...]:
        """The layer's K and V tensors (and whatever else of the layer's), as `_forward` reads them."""
        return self.cache.layer_tensors(layer)

    @abstractmethod
    def _forward(self, kv: tuple[Tensor, ...], batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Stores k/v into `kv` (the layer's K and V virtual tensors, from `_layer_kv`) and attends."""

    @staticmethod
    def _store(kv: tuple[Tensor, Tensor], batch: AttentionBatch, k: Tensor, v: Tensor) -> None:
        """Writes the new tokens' K/V into their rows in one indexed copy per tensor (rounded to
        the cache's precision where it is narrower than the model's)."""
        index = (batch.token_reqids, batch.token_positions)
        kv[0].index_put_(index, k.to(kv[0].dtype))
        kv[1].index_put_(index, v.to(kv[1].dtype))


def kernel_classes() -> list[type[AttentionKernel]]:
    """Every concrete kernel defined so far (the virtual cache's and the paged baseline's)."""
    found, pending = [], list(AttentionKernel.__subclasses__())
    while pending:
        kernel = pending.pop()
        pending += kernel.__subclasses__()
        if hasattr(kernel, "name"):
            found.append(kernel)
    return found


CUDA_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's CUDA backends for serving, cuDNN's left out: cuDNN builds a graph for every new
sequence length (hundreds of ms each, PyTorch's own first-call cost), and a server sees a new
length with nearly every prompt. Every kernel's layer call runs under them (`sdpa_backends`)."""


def sdpa_backends(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """SDPA's backends for one layer's attention on `device`: CUDA_SDPA_BACKENDS on CUDA (entered
    once per layer, not per request), torch's own choice elsewhere."""
    return sdpa_kernel(CUDA_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()


def sdpa_request(query: Tensor, keys: Tensor, values: Tensor, length: int, scale: float) -> Tensor:
    """torch SDPA for one request: `query` [new, heads, dim] at the last `new` of `length`
    positions over its `[length, kv_heads, dim]` keys and values; returns [new, heads, dim].
    Keys and values in a narrower precision than the query's are widened to it (a long prefill
    chunk's, once per layer: compute-bound, unlike a decode)."""
    keys, values = keys.to(query.dtype), values.to(query.dtype)
    new = query.shape[0]
    # Causal, aligned to the end (query j sits at position length - new + j); SDPA's own
    # is_causal aligns to the start, which agrees only when the whole context is new.
    all_new = new == length
    mask = (
        None
        if new == 1 or all_new
        else torch.ones(new, length, dtype=torch.bool, device=query.device).tril(length - new)
    )
    heads_per_kv = query.shape[1] // keys.shape[1]
    if mask is not None and heads_per_kv > 1 and query.device.type == "cuda":
        # On CUDA, flash attention takes no mask and memory-efficient attention no GQA, so a
        # masked GQA call falls to the math backend ([heads, new, length] scores in memory):
        # expanded heads let memory-efficient attention take it.
        keys, values = keys.repeat_interleave(heads_per_kv, dim=1), values.repeat_interleave(heads_per_kv, dim=1)
    attended = F.scaled_dot_product_attention(
        query.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=all_new and new > 1,
        scale=scale,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
    return attended.squeeze(0).transpose(0, 1)
