"""A block-table KV cache, as vLLM's PagedAttention: the paged baseline of the paper's comparisons.

Every layer's K and V live in one tensor of `num_blocks` blocks of `block_size` tokens,
allocated up front from the same physical budget the virtual cache maps on demand. A
request owns a list of blocks, in any order; its row of the block table says which, and
kernels must follow it. The lifecycle is the virtual cache's (alloc_reqid, step,
free_reqid; OutOfPagesError when blocks run out, nothing changed), so the engine drives
either one. The engine thread owns it: it takes no lock.

Nothing is ever unmapped: the blocks are one tensor that lives while anything references
it, and `kv()` returns copies, so no caller holds a view into a block that a freed request
gave back to the pool.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from vattn.config import DTYPES, QPARAM_BYTES
from vattn.errors import OutOfSlotsError
from vattn.paged.block_pool import BlockPool
from vattn.stats import CacheStats, MappingCounters
from vattn.validate import exact_int, require_positive_int


@dataclass(frozen=True)
class PagedKVCacheConfig:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_slots: int
    max_context: int
    dtype: torch.dtype | str = torch.float16
    block_size: int = 16
    """Tokens per block (vLLM's default is 16)."""
    memory_budget: int | None = None
    """Bytes of blocks; None means enough for every slot at full context."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_slots", "max_context", "block_size"):
            require_positive_int(name, getattr(self, name))
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.memory_budget is not None:
            require_positive_int("memory_budget", self.memory_budget)
            if self.num_blocks < 1:
                raise ValueError(f"memory_budget {self.memory_budget} B holds no block of {self.block_bytes} B")

    @cached_property
    def quantized(self) -> bool:
        """int8 values with a float32 scale and midpoint per (token, kv head), as the virtual cache's."""
        return self.dtype == torch.int8

    @cached_property
    def bytes_per_token(self) -> int:
        """One token's K and V in every layer (and an int8 cache's qparams)."""
        values = self.num_kv_heads * self.head_dim * self.dtype.itemsize  # type: ignore[union-attr]
        return 2 * self.num_layers * (values + (QPARAM_BYTES * self.num_kv_heads if self.quantized else 0))

    @cached_property
    def block_bytes(self) -> int:
        return self.block_size * self.bytes_per_token

    @cached_property
    def blocks_per_slot(self) -> int:
        return math.ceil(self.max_context / self.block_size)

    @cached_property
    def num_blocks(self) -> int:
        """Blocks the budget holds, capped at what all slots can use."""
        capacity = self.max_slots * self.blocks_per_slot
        return capacity if self.memory_budget is None else min(capacity, self.memory_budget // self.block_bytes)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)


class PagedKVCache:
    """KV in fixed blocks found through a block table; see the module docstring."""

    def __init__(self, config: PagedKVCacheConfig) -> None:
        self.config = cfg = config
        shape = (cfg.num_layers, 2, cfg.num_blocks, cfg.block_size, cfg.num_kv_heads, cfg.head_dim)
        self._blocks = torch.empty(shape, dtype=cfg.dtype, device=cfg.device)  # type: ignore[arg-type]
        self._qparams = torch.empty((*shape[:-1], 2) if cfg.quantized else 0, device=cfg.device)
        """An int8 cache's float32 (scale, midpoint) pairs, `[layers, 2, num_blocks, block_size, kv_heads, 2]`."""
        self.device = self._blocks.device
        self._pool = BlockPool(cfg.num_blocks)
        self._owned: list[list[int]] = [[] for _ in range(cfg.max_slots)]
        self._lengths = [0] * cfg.max_slots
        self._active = [False] * cfg.max_slots
        self._free_slots = deque(range(cfg.max_slots))
        self.block_table = torch.zeros(cfg.max_slots, cfg.blocks_per_slot, dtype=torch.int32)
        """Host copy: row r lists slot r's blocks in token order (kernels copy the rows they need)."""
        self._blocks_taken = 0
        self._closed = False

    # ---------------------------------------------------------------- requests

    def alloc_reqid(self) -> int:
        self._check_open()
        if not self._free_slots:
            raise OutOfSlotsError(self.config.max_slots)
        slot = self._free_slots.popleft()
        self._active[slot], self._lengths[slot] = True, 0
        return slot

    def free_reqid(self, reqid: int) -> None:
        """Ends a request; its blocks go straight back to the pool."""
        slot = self._active_slot(reqid)
        self._pool.give_back(self._owned[slot])
        self._owned[slot] = []
        self._active[slot], self._lengths[slot] = False, 0
        self._free_slots.append(slot)

    def step(self, seq_lens: Mapping[int, int]) -> None:
        """Gives each listed request blocks for its length; all or nothing (OutOfPagesError)."""
        self._check_open()
        targets = [
            (
                self._active_slot(reqid),
                exact_int(n, f"length of reqid {reqid} (max_context)", 0, self.config.max_context),
            )
            for reqid, n in seq_lens.items()
        ]
        missing = [(slot, self.config.blocks_for(n) - len(self._owned[slot])) for slot, n in targets]
        taken = self._pool.take(sum(max(0, m) for _, m in missing))
        self._blocks_taken += len(taken)
        for slot, count in missing:
            if count > 0:
                first = len(self._owned[slot])
                new, taken = taken[:count], taken[count:]
                self._owned[slot] += new
                self.block_table[slot, first : first + count] = torch.tensor(new, dtype=torch.int32)
        for slot, n in targets:
            self._lengths[slot] = n

    def can_admit(self, num_tokens: int, growing: Mapping[int, int] | None = None) -> bool:
        """As `KVCache.can_admit`: room for a new request of `num_tokens` and for the active
        reqids in `growing` to reach those lengths."""
        cfg = self.config
        num_tokens = exact_int(num_tokens, "num_tokens", 0, cfg.max_context)
        self._check_open()
        grow = sum(
            max(0, cfg.blocks_for(exact_int(n, "length", 0, cfg.max_context)) - len(self._owned[self._active_slot(r)]))
            for r, n in (growing or {}).items()
        )
        return bool(self._free_slots) and cfg.blocks_for(num_tokens) + grow <= self._pool.num_free

    # ---------------------------------------------------------------- reading

    @property
    def num_free_blocks(self) -> int:
        return self._pool.num_free

    def lengths(self, reqids: Sequence[int]) -> list[int]:
        return [self._lengths[self._active_slot(reqid)] for reqid in reqids]

    def layer_blocks(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V blocks, each `[num_blocks, block_size, kv_heads, head_dim]`."""
        self._check_open()
        layer = exact_int(layer, "layer", 0, self.config.num_layers - 1)
        return self._blocks[layer, 0], self._blocks[layer, 1]

    def layer_qparams(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 cache's K and V (scale, midpoint) pairs of a layer, each `[num_blocks, block_size, kv_heads, 2]`."""
        self._require_quantized()
        layer = exact_int(layer, "layer", 0, self.config.num_layers - 1)
        return self._qparams[layer, 0], self._qparams[layer, 1]

    def kv(self, layer: int, reqid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of one request's K and V in one layer, `[length, kv_heads, head_dim]`
        (gathered: a paged request has no contiguous view)."""
        return self._gathered(reqid, self.layer_blocks(layer))

    def kv_qparams(self, layer: int, reqid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of an int8 cache's K and V (scale, midpoint) pairs of one request, `[length, kv_heads, 2]`."""
        return self._gathered(reqid, self.layer_qparams(layer))

    def stats(self) -> CacheStats:
        """The virtual cache's figures for blocks: a page is one block (every layer's K and V
        for `block_size` tokens); nothing is ever mapped or unmapped, so no mapping work."""
        cfg = self.config
        owned = [len(blocks) for blocks in self._owned]
        used = sum(owned) * cfg.block_bytes
        return CacheStats(
            page_size=cfg.block_bytes,
            pool_pages=cfg.num_blocks,
            mapped_bytes=used,
            active_bytes=used,
            idle_bytes=0,
            cached_bytes=0,
            free_bytes=self._pool.num_free * cfg.block_bytes,
            used_bytes=sum(self._lengths) * cfg.bytes_per_token,
            pages_created=cfg.num_blocks,
            fresh_pages_taken=self._blocks_taken,
            recycled_pages_taken=0,
            pages_per_slot=tuple(owned),
            active_slots=sum(self._active),
            pinned_slots=0,
            counters=MappingCounters(),
            background_errors=0,
        )

    def close(self) -> None:
        """Marks the cache closed; the blocks are freed with the last tensor that reaches them."""
        self._closed = True

    # ---------------------------------------------------------------- internals

    def _gathered(self, reqid: int, parts: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self._active_slot(reqid)
        blocks = torch.tensor(self._owned[slot], dtype=torch.long, device=self.device)
        return tuple(part[blocks].flatten(0, 1)[: self._lengths[slot]] for part in parts)  # type: ignore[return-value]

    def _require_quantized(self) -> None:
        self._check_open()
        if not self.config.quantized:
            raise ValueError(f"only an int8 cache has qparams; this one is {self.config.dtype}")

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the paged KV cache is closed")

    def _active_slot(self, reqid: int) -> int:
        self._check_open()
        slot = exact_int(reqid, "reqid", 0, self.config.max_slots - 1)
        if not self._active[slot]:
            raise ValueError(f"reqid {reqid} is not allocated")
        return slot
