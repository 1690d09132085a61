"""The engine's one boundary with KV memory: a small protocol, and the two caches behind it.

The engine admits a request into a slot, grows slots before each iteration, frees them,
plans and runs attention over them, and reads stats; nothing else. `VirtualKVStore` is
vattn's cache, `PagedKVStore` the block-table baseline (`EngineConfig.kv_cache`); the
scheduler, sampler and HTTP layers never know which one they drive.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
from torch import Tensor

from serving.config import EngineConfig
from serving.model.loader import ModelShape
from vattn import CacheStats, KVCache, KVCacheConfig, PageBudget
from vattn.attention import AttentionKernel
from vattn.errors import CapacityError
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel
from vattn.prefix_cache import CacheEvent


class IterationBatch(Protocol):
    """What the engine reads of a planned iteration; the rest is the store's own."""

    @property
    def starts(self) -> tuple[int, ...]:
        """Request i's new tokens are rows `[starts[i], starts[i + 1])`."""

    @property
    def token_positions(self) -> Tensor:
        """int64 `[tokens]`: each new token's position in its request."""


class KVStore(Protocol):
    """What the engine asks of KV memory. The engine's words are a request's; the cache's are
    the paper's (vattn.KVCache), and CacheStore translates one to the other:

    | KVStore (the engine's)       | KVCache / PagedKVCache (the cache's)       |
    |------------------------------|--------------------------------------------|
    | admit                        | can_admit, then alloc_reqid                |
    | reuse_prefix                 | match_prefix                               |
    | remember                     | cache_prefix                               |
    | fork                         | fork_reqid                                 |
    | grow                         | step                                       |
    | free                         | free_reqid                                 |
    | reset_prefix_cache           | evict_prefix_cache                         |
    | plan, attend                 | the bound kernel's plan, forward           |
    | stats, take_events, close, release_memory | the same names              |

    A slot is the cache's reqid."""

    device: torch.device

    def admit(self, num_tokens: int, growing: Mapping[int, int] | None = None) -> int | None:
        """A slot for a new request that needs room for `num_tokens`, while the slots in
        `growing` grow to those lengths too; None if that cannot be promised now."""

    def reuse_prefix(self, slot: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        """Gives a newly admitted slot the KV of the longest prefix of `token_ids` that the store
        still holds for requests with the same `salt`; returns how many tokens that is (0
        without a prefix cache). The slot's tokens are remembered under that salt."""

    def remember(self, slot: int, token_ids: Sequence[int]) -> None:
        """`token_ids` are the tokens whose KV the slot now holds: later requests may reuse them."""

    def fork(self, slot: int) -> int | None:
        """A new slot holding the same KV as `slot` (whole pages shared, not copied), or None if
        there is no room or the store cannot share."""

    def fork_min_tokens(self) -> int | None:
        """The fewest tokens whose fork shares a whole page (None: the store cannot fork)."""

    def grow(self, lengths: Mapping[int, int]) -> None:
        """Makes each slot hold its length before an iteration; all or nothing (OutOfPagesError)."""

    def free(self, slot: int) -> None: ...

    def slot_bytes(self, num_tokens: int) -> int:
        """Physical bytes one slot holding `num_tokens` tokens may map, at most."""

    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> IterationBatch:
        """One iteration's attention batch (new token positions included), shared by every layer."""

    def attend(self, layer: int, batch: IterationBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Stores the new tokens' K/V and returns their attention output."""

    def stats(self) -> CacheStats: ...

    def take_events(self) -> list[CacheEvent]:
        """The prefix cache's stores and evictions since the last call (vattn.prefix_cache)."""

    def reset_prefix_cache(self) -> None: ...

    def release_memory(self) -> int:
        """Gives every page no running request maps back to the system (sleep); bytes released."""
        ...

    def close(self) -> None: ...


class CacheStore:
    """A KV store over a cache with vattn's lifecycle (alloc_reqid, can_admit, step,
    free_reqid) and a kernel bound to it (plan, forward): KVStore's table, call by call."""

    def __init__(self, cache: KVCache | PagedKVCache, kernel: AttentionKernel) -> None:
        self.cache = cache
        self.device: torch.device = cache.device
        self._kernel = kernel

    def admit(self, num_tokens: int, growing: Mapping[int, int] | None = None) -> int | None:
        return self.cache.alloc_reqid() if self.cache.can_admit(num_tokens, growing) else None

    def reuse_prefix(self, slot: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        return 0

    def remember(self, slot: int, token_ids: Sequence[int]) -> None:
        pass

    def fork(self, slot: int) -> int | None:
        return None

    def fork_min_tokens(self) -> int | None:
        return None

    def grow(self, lengths: Mapping[int, int]) -> None:
        self.cache.step(lengths)

    def free(self, slot: int) -> None:
        self.cache.free_reqid(slot)

    def plan(self, slots: Sequence[int], new_tokens: Sequence[int]) -> IterationBatch:
        return self._kernel.plan(slots, new_tokens)

    def attend(self, layer: int, batch: IterationBatch, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return self._kernel.forward(layer, batch, q, k, v)

    def stats(self) -> CacheStats:
        return self.cache.stats()

    def take_events(self) -> list[CacheEvent]:
        return []

    def reset_prefix_cache(self) -> None:
        pass

    def close(self) -> None:
        self.cache.close()


class VirtualKVStore(CacheStore):
    """vattn's KVCache: each slot's KV virtually contiguous, attention by an unmodified kernel."""

    cache: KVCache

    def __init__(
        self, config: EngineConfig, shape: ModelShape, max_context: int, page_budget: PageBudget | None = None
    ) -> None:
        cache_config = KVCacheConfig(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_slots=config.max_slots,
            max_context=max_context,
            dtype=config.kv_torch_dtype,
            page_size=config.page_size,
            backend=config.backend,
            memory_budget=config.kv_budget,
            prefix_match=config.prefix_match,  # type: ignore[arg-type]
            prefix_cache_share=config.prefix_cache_share,
            record_events=config.kv_events_endpoint is not None,
            background=config.tensor_parallel_size == 1,  # ranks map synchronously: the same decisions
            preallocate=config.kv_preallocate,
        )
        cache = KVCache(cache_config, page_budget)
        super().__init__(cache, make_kernel(config.attention_kernel, cache, shape.num_query_heads))
        self._prefix_caching = bool(config.prefix_caching)

    def slot_bytes(self, num_tokens: int) -> int:
        config = self.cache.config
        return config.pages_for(num_tokens) * config.page_group_bytes

    def reuse_prefix(self, slot: int, token_ids: Sequence[int], salt: str | None = None) -> int:
        return self.cache.match_prefix(slot, token_ids, salt) if self._prefix_caching else 0

    def remember(self, slot: int, token_ids: Sequence[int]) -> None:
        if self._prefix_caching:
            self.cache.cache_prefix(slot, token_ids)

    def take_events(self) -> list[CacheEvent]:
        return self.cache.take_events()

    def reset_prefix_cache(self) -> None:
        self.cache.evict_prefix_cache()

    def release_memory(self) -> int:
        return self.cache.release_memory()

    def fork(self, slot: int) -> int | None:
        try:
            return self.cache.fork_reqid(slot)
        except CapacityError:
            return None

    def fork_min_tokens(self) -> int | None:
        config = self.cache.config
        return -(-config.page_size // config.bytes_per_token)


class PagedKVStore(CacheStore):
    """The paged baseline: KV in blocks of `block_size` tokens found through a block table,
    attention by a paged kernel."""

    cache: PagedKVCache

    def __init__(self, config: EngineConfig, shape: ModelShape, max_context: int) -> None:
        cache_config = PagedKVCacheConfig(
            num_layers=shape.num_layers,
            num_kv_heads=shape.num_kv_heads,
            head_dim=shape.head_dim,
            max_slots=config.max_slots,
            max_context=max_context,
            dtype=config.torch_dtype,
            block_size=config.block_size,
            memory_budget=config.kv_budget,
            device="cuda" if config.backend == "cuda" else "cpu",
        )
        cache = PagedKVCache(cache_config)
        super().__init__(cache, make_paged_kernel(config.attention_kernel, cache, shape.num_query_heads))

    def slot_bytes(self, num_tokens: int) -> int:
        config = self.cache.config
        return config.blocks_for(num_tokens) * config.block_bytes

    def release_memory(self) -> int:
        raise ValueError("the paged baseline's blocks are allocated once, for good: it has no pages to give back")


def make_kv_store(
    config: EngineConfig, shape: ModelShape, max_context: int, page_budget: PageBudget | None = None
) -> KVStore:
    """The KV store `config.kv_cache` names, drawing on `page_budget` if several models share one
    (the virtual cache only); ValueError if its budget cannot hold one full request."""
    if page_budget is not None and config.kv_cache != "virtual":
        raise ValueError("several models on one KV budget need the virtual KV cache (kv_cache='virtual')")
    if config.kv_cache == "virtual":
        store: KVStore = VirtualKVStore(config, shape, max_context, page_budget)
    else:
        store = PagedKVStore(config, shape, max_context)
    if (full_request := store.slot_bytes(max_context)) > config.kv_budget:
        store.close()
        raise ValueError(
            f"kv_budget {config.kv_budget} B cannot hold one request at the max context "
            f"({max_context} tokens need {full_request} B): raise it or lower max_context"
        )
    return store
