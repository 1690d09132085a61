"""What a KV cache looks like: model shape, capacity, page size, layout and policies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Literal, get_args

import torch

from vattn.sizes import MiB
from vattn.validate import is_int, require_positive_int

Layout = Literal["per_layer", "mega"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
PrefixMatch = Literal["token", "unit"]
PREFIX_MATCHES: tuple[str, ...] = get_args(PrefixMatch)
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "int8": torch.int8,
}
"""int8 keeps each token's K (and V) per kv head as round((x - midpoint) / scale) with its own
float32 scale and midpoint: the middle of the row's range and its width / 254 (asymmetric per
token and head, as OpenVINO's u8 cache). They sit after the values in each token's row of the
same virtual tensor, so they are mapped, shared, copied and leased with the values and need no
page schedule of their own."""
QPARAM_BYTES = 8
"""An int8 cache's qparams (quantization parameters): a float32 (scale, midpoint) pair per (token, kv head)."""
GPU_KERNEL_BLOCK_TOKENS = 16
"""Tokens of the blocks that GPU kernels see a slot as (what FlashInfer's paged wrappers call
pages, via `gpu_kernels.token_blocks`; a *page* here is always a physical page): every slot
stride is a whole number of them in every virtual tensor, so slot s's block k is block
`s * blocks_per_slot + k` and slot s's first token row is row `s * rows_per_slot`
(FlashAttention-2's varlen offsets)."""


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape and policy of one KV cache (frozen: the layout figures are computed once).

    Layouts: ``per_layer`` reserves one K and one V tensor per layer, each
    ``[max_slots, max_context, num_kv_heads, head_dim]``; ``mega`` reserves one K and one
    V ``[max_slots, max_context, num_layers, num_kv_heads, head_dim]`` and hands out
    strided per-layer views, so a request grows by 2 pages instead of 2 x layers.
    Each slot's stride is rounded up to whole pages and whole `GPU_KERNEL_BLOCK_TOKENS`-token
    pages, so any ``max_context`` works.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_slots: int
    max_context: int
    dtype: torch.dtype | str = torch.float16
    page_size: int = 2 * MiB
    backend: str = "host"
    memory_budget: int | None = None
    """Physical bytes the pool may hold; None means enough for every slot at full context."""
    layout: Layout = "per_layer"
    background: bool = True
    """Map the next iteration's pages in a background thread (overlap)."""
    lookahead_tokens: int = 1
    """How far past its current length the background thread maps each active slot."""
    eager_pages: int = 1
    """Page groups pre-mapped behind the reqid that will be handed out next."""
    reclaim_watermark: float = 0.05
    """Idle slots give their pages back when free pages fall under this share of the pool."""
    native: bool | None = None
    """Host backend: True needs the C library, False uses ctypes, None picks C if built."""
    preallocate: bool = False
    """Give the pool's pages their memory when the cache is made (as vLLM and OpenVINO allocate
    their KV space at start), so that no step pays for touching fresh memory; False: a page
    gets its memory when first mapped. Not with a shared PageBudget (each pool would take it)."""
    prefix_match: PrefixMatch = "token"
    """`match_prefix` reuses a cached prefix to the token (the part of a unit copied) or in
    whole units only (mapped, nothing copied)."""
    prefix_copy_min_tokens: int = 16
    """The fewest tokens of a unit that `match_prefix` copies rather than leaves to compute. A
    copy maps a scratch page into every virtual tensor, copies, and unmaps (about 2 ms for the
    default model's 60 tensors on the host, where a prefill chunk computes a token in ~0.3-0.5
    ms); prompts of common words share their first token or two with some cached prompt
    nearly always. 16 tokens is vLLM's block, the least its prefix cache reuses."""
    prefix_cache_share: float = 0.5
    """The share of the pool that prefix-cache entries may hold in pages no slot maps: past it,
    the least recently used go at once. Pages that running or idle slots map cost the cache
    nothing and do not count. 1.0 keeps entries until a step needs their pages (vLLM and
    SGLang keep them until their preallocated pool is full; here that would commit the whole
    budget's physical memory to entries that may never match again)."""
    prefix_cold_after: int = 32
    """Prompts in a row that find nothing cached after which the prefix cache counts as cold: a
    reused slot's entries then go where they lie (its pages stay mapped, its own) instead of
    being moved out at an unmap and a map per page, which a cache that finds nothing does not
    repay; the next prompt that finds something, or would have found an entry so evicted,
    warms it again. 0: always cold."""

    record_events: bool = False
    """List the prefix cache's stores and evictions for `KVCache.take_events` (what a server
    publishes as vLLM's KV events); off, nothing accumulates."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_slots", "max_context", "page_size"):
            require_positive_int(name, getattr(self, name))
        for name in ("lookahead_tokens", "eager_pages", "prefix_copy_min_tokens", "prefix_cold_after"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.dtype == torch.int8 and self.num_kv_heads * self.head_dim % 4:
            raise ValueError(
                "an int8 cache needs num_kv_heads x head_dim divisible by 4 (its float32 qparams "
                f"follow the values), got {self.num_kv_heads} x {self.head_dim}"
            )
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if self.prefix_match not in PREFIX_MATCHES:
            raise ValueError(f"prefix_match must be one of {PREFIX_MATCHES}, got {self.prefix_match!r}")
        if not (isinstance(self.prefix_cache_share, int | float) and 0.0 <= self.prefix_cache_share <= 1.0):
            raise ValueError(f"prefix_cache_share must be in [0, 1], got {self.prefix_cache_share!r}")
        if not 0.0 <= self.reclaim_watermark < 1.0:
            raise ValueError(f"reclaim_watermark must be in [0, 1), got {self.reclaim_watermark!r}")
        if self.memory_budget is not None:
            require_positive_int("memory_budget", self.memory_budget)
            if self.pool_pages < self.num_buffers:
                raise ValueError(
                    f"memory_budget {self.memory_budget} B holds {self.pool_pages} pages of "
                    f"{self.page_size} B, but one page group of this layout needs {self.num_buffers}"
                )

    @cached_property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @cached_property
    def num_buffers(self) -> int:
        """Virtual tensors reserved: K and V per layer, or one K and one V for all layers."""
        return 2 * self.num_layers if self.layout == "per_layer" else 2

    @cached_property
    def quantized(self) -> bool:
        """int8 values with a scale and midpoint per (token, kv head)."""
        return self.dtype == torch.int8

    @cached_property
    def layer_row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer: its values, then an int8 cache's qparams."""
        values = self.num_kv_heads * self.head_dim * self.element_size
        return values + (QPARAM_BYTES * self.num_kv_heads if self.quantized else 0)

    @cached_property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in one virtual tensor."""
        return self.layer_row_bytes if self.layout == "per_layer" else self.layer_row_bytes * self.num_layers

    @cached_property
    def max_slot_groups(self) -> int:
        """Page groups behind one slot at full context (`max_context` tokens)."""
        return math.ceil(self.max_context * self.bytes_per_token / self.page_size)

    @cached_property
    def unit_groups(self) -> int:
        """Page groups of a prefix-cache unit: the fewest whole pages that end on a token's end.

        A token that straddles a page boundary has bytes on both sides, so a page before it
        can be shared only if the token after it is never written again: sharing stops at
        boundaries that are also token boundaries (every page when a page holds whole tokens)."""
        return self.bytes_per_token // math.gcd(self.page_size, self.bytes_per_token)

    @cached_property
    def unit_tokens(self) -> int:
        """Tokens in a prefix-cache unit."""
        return self.unit_groups * self.page_size // self.bytes_per_token

    @cached_property
    def unit_bytes(self) -> int:
        """Bytes of a prefix-cache unit in one virtual tensor."""
        return self.unit_groups * self.page_size

    @cached_property
    def slot_stride(self) -> int:
        """Bytes between two slots of a virtual tensor: at least `max_slot_groups` pages, rounded up to a
        common multiple of the page size and of `GPU_KERNEL_BLOCK_TOKENS` token rows (a token's row
        is `bytes_per_token` apart in both layouts). Address space only: past `max_slot_groups`, nothing
        is ever mapped."""
        unit = math.lcm(self.page_size, GPU_KERNEL_BLOCK_TOKENS * self.bytes_per_token)
        return -(-self.max_slot_groups * self.page_size // unit) * unit

    @cached_property
    def reservation_bytes(self) -> int:
        """Address space reserved for each virtual tensor: every slot at full context."""
        return self.max_slots * self.slot_stride

    @cached_property
    def page_group_bytes(self) -> int:
        """Physical bytes of one page group: one page in every virtual tensor."""
        return self.num_buffers * self.page_size

    @cached_property
    def pool_pages(self) -> int:
        """Physical pages the pool may create: the budget, capped at what all slots can use."""
        capacity = self.max_slots * self.max_slot_groups * self.num_buffers
        if self.memory_budget is None:
            return capacity
        return min(capacity, self.memory_budget // self.page_size)

    @cached_property
    def prefix_cache_pages(self) -> int:
        """The most pages prefix-cache entries may hold that no slot maps (`prefix_cache_share`)."""
        return int(self.prefix_cache_share * self.pool_pages)

    @cached_property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of each virtual tensor: `[slots, context, kv_heads, head_dim]`, with layers before
        the heads in the mega layout."""
        layers = () if self.layout == "per_layer" else (self.num_layers,)
        return (self.max_slots, self.max_context, *layers, self.num_kv_heads, self.head_dim)

    @cached_property
    def tensor_strides(self) -> tuple[int, ...]:
        """Element strides of `tensor_shape`: slots `slot_stride` bytes apart, the rest packed."""
        row = self.layer_row_bytes // self.element_size
        per_token = (row,) if self.layout == "per_layer" else (self.num_layers * row, row)
        return (self.slot_stride // self.element_size, *per_token, self.head_dim, 1)

    def kv_buffers(self, layer: int) -> tuple[int, int]:
        """Which virtual tensors hold a layer's K and V."""
        return (2 * layer, 2 * layer + 1) if self.layout == "per_layer" else (0, 1)

    def rows_bytes(self, rows: int, length: int) -> int:
        """Bytes from the start of a slot's row to the end of token `length` of the row `rows - 1` later."""
        return (rows - 1) * self.slot_stride + length * self.bytes_per_token

    def rows_view(self, flat: torch.Tensor, layer: int, length: int, rows: int | None = None) -> torch.Tensor:
        """One layer's `[rows, length, kv_heads, head_dim]` (`[length, ...]` if `rows` is None) in
        elements `flat` of `dtype` that start at a slot's row of a virtual tensor and span
        `rows_bytes(rows or 1, length)` (no copy)."""
        heads, dim = self.num_kv_heads, self.head_dim
        if self.layout == "per_layer" and rows is None and not self.quantized:
            return flat.view(length, heads, dim)
        slot, token, *_ = self.tensor_strides
        offset = 0 if self.layout == "per_layer" else layer * self.layer_row_bytes // self.element_size
        if rows is None:
            return flat.as_strided((length, heads, dim), (token, dim, 1), offset)
        return flat.as_strided((rows, length, heads, dim), (slot, token, dim, 1), offset)

    def qparams_view(self, flat: torch.Tensor, layer: int, length: int, rows: int | None = None) -> torch.Tensor:
        """An int8 cache's float32 (scale, midpoint) pairs, `[rows, length, kv_heads, 2]`
        (`[length, kv_heads, 2]` if `rows` is None), over the same elements `flat` as `rows_view`
        (no copy)."""
        words = flat.view(torch.float32)
        word = torch.float32.itemsize
        slot, token = self.slot_stride // word, self.bytes_per_token // word
        values = self.num_kv_heads * self.head_dim * self.element_size
        offset = ((0 if self.layout == "per_layer" else layer * self.layer_row_bytes) + values) // word
        if rows is None:
            return words.as_strided((length, self.num_kv_heads, 2), (token, 2, 1), offset)
        return words.as_strided((rows, length, self.num_kv_heads, 2), (slot, token, 2, 1), offset)

    def page_offset(self, slot: int, page: int) -> int:
        """Byte offset of page `page` of slot `slot` inside any one virtual tensor."""
        return slot * self.slot_stride + page * self.page_size

    def pages_for(self, tokens: int) -> int:
        """Page groups (one page in every virtual tensor) a slot needs to hold `tokens`."""
        return math.ceil(tokens * self.bytes_per_token / self.page_size)

    def tokens_in(self, page_groups: int) -> int:
        """Tokens that lie wholly inside the first `page_groups` pages of a slot."""
        return min(self.max_context, page_groups * self.page_size // self.bytes_per_token)
