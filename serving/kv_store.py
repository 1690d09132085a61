"""The engine's one boundary with KV memory: a small protocol, and vattn's cache behind it.

The engine admits a request into a slot, grows slots before each iteration, frees them,
plans and runs attention over them, and reads stats; nothing else. Any store that
satisfies the protocol (a paged baseline is next) can stand in, and the scheduler,
sampler and HTTP layers never know which one they drive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from serving.config import EngineConfig
from serving.model_runner import ModelShape
from vattn import CacheStats, KVCache, KVCacheConfig
from vattn.kernels import AttentionBatch, make_kernel


class KVStore(Protocol):
    device: torch.device

    def admit(self, num_tokens: int) -> int | None:
        """A slot for a new request whose first iteration covers `num_tokens`, or None if it cannot start now."""

    def grow(self, lengths: Mapping[int, int]) -> None:
        """Makes each slot hold its length before an iteration; all or nothing (OutOfPagesError)."""

    def free(self, slot: int) -> None: ...

    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> AttentionBatch:
        """One iteration's attention batch (new token positions included), shared by every layer."""

    def attend(self, layer: int, batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Stores the new tokens' K/V and returns their attention output."""

    def stats(self) -> CacheStats: ...

    def close(self) -> None: ...


class VirtualKVStore:
    """vattn's KVCache: each slot's KV virtually contiguous, attention by an unmodified kernel.
    A slot here is the cache's reqid."""

    def __init__(self, config: EngineConfig, shape: ModelShape, max_context: int) -> None:
        cache_config = KVCacheConfig(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_slots=config.max_slots,
            max_context=max_context,
            dtype=config.torch_dtype,
            page_size=config.page_size,
            backend=config.backend,
            memory_budget=config.kv_budget,
        )
        full_request = cache_config.pages_for(max_context) * cache_config.page_step_bytes
        if config.kv_budget < full_request:
            raise ValueError(
                f"kv_budget {config.kv_budget} B cannot hold one request at the max context "
                f"({max_context} tokens need {full_request} B): raise it or lower max_context"
            )
        self.cache = KVCache(cache_config)
        self.device = self.cache.device
        kernel = config.kernel if config.kernel != "auto" else "ragged" if config.backend == "host" else "sdpa"
        self._kernel = make_kernel(kernel, self.cache, shape.num_query_heads)

    def admit(self, num_tokens: int) -> int | None:
        return self.cache.alloc_reqid() if self.cache.can_admit(num_tokens) else None

    def grow(self, lengths: Mapping[int, int]) -> None:
        self.cache.step(lengths)

    def free(self, slot: int) -> None:
        self.cache.free_reqid(slot)

    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> AttentionBatch:
        return self._kernel.plan(slots, new_tokens)

    def attend(self, layer: int, batch: AttentionBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._kernel.forward(layer, batch, q, k, v)

    def stats(self) -> CacheStats:
        return self.cache.stats()

    def close(self) -> None:
        self.cache.close()
