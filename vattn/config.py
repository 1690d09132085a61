"""What a KV cache looks like: model shape, capacity, page size, layout and policies."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from vattn.sizes import MiB

Layout = Literal["per_layer", "mega"]
LAYOUTS: tuple[str, ...] = get_args(Layout)
DTYPES: dict[str, torch.dtype] = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
}


@dataclass(frozen=True)
class KVCacheConfig:
    """Shape and policy of one KV cache.

    Layouts: ``per_layer`` reserves one K and one V tensor per layer, each
    ``[max_slots, max_context, num_kv_heads, head_dim]``; ``mega`` reserves one K and one
    V ``[max_slots, max_context, num_layers, num_kv_heads, head_dim]`` and hands out
    strided per-layer views, so a request grows by 2 pages instead of 2 x layers.
    Each slot's stride is rounded up to whole pages, so any ``max_context`` works.
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
    """Page steps pre-mapped behind the reqid that will be handed out next."""
    reclaim_watermark: float = 0.05
    """Idle slots give their pages back when free pages fall under this share of the pool."""
    native: bool | None = None
    """Host backend: True needs the C library, False uses ctypes, None picks C if built."""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "max_slots", "max_context", "page_size"):
            require_positive_int(name, getattr(self, name))
        for name in ("lookahead_tokens", "eager_pages"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if isinstance(self.dtype, str):
            if self.dtype not in DTYPES:
                raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
            object.__setattr__(self, "dtype", DTYPES[self.dtype])
        if self.dtype not in DTYPES.values():
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {self.layout!r}")
        if not 0.0 <= self.reclaim_watermark < 1.0:
            raise ValueError(f"reclaim_watermark must be in [0, 1), got {self.reclaim_watermark!r}")
        if self.memory_budget is not None:
            require_positive_int("memory_budget", self.memory_budget)
            if self.pool_pages < self.num_buffers:
                raise ValueError(
                    f"memory_budget {self.memory_budget} B holds {self.pool_pages} pages of "
                    f"{self.page_size} B, but one page step of this layout needs {self.num_buffers}"
                )

    @property
    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def num_buffers(self) -> int:
        """Virtual tensors reserved: K and V per layer, or one K and one V for all layers."""
        return 2 * self.num_layers if self.layout == "per_layer" else 2

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token occupies in one virtual tensor."""
        per_layer = self.num_kv_heads * self.head_dim * self.element_size
        return per_layer if self.layout == "per_layer" else per_layer * self.num_layers

    @property
    def slot_pages(self) -> int:
        """Pages behind one slot of one virtual tensor at full context."""
        return math.ceil(self.max_context * self.bytes_per_token / self.page_size)

    @property
    def slot_stride(self) -> int:
        """Bytes between two slots of a virtual tensor (whole pages)."""
        return self.slot_pages * self.page_size

    @property
    def reservation_bytes(self) -> int:
        """Address space reserved for each virtual tensor: every slot at full context."""
        return self.max_slots * self.slot_stride

    @property
    def page_step_bytes(self) -> int:
        """Physical bytes of one page step: one page in every virtual tensor."""
        return self.num_buffers * self.page_size

    @property
    def pool_pages(self) -> int:
        """Physical pages the pool may create: the budget, capped at what all slots can use."""
        capacity = self.max_slots * self.slot_pages * self.num_buffers
        if self.memory_budget is None:
            return capacity
        return min(capacity, self.memory_budget // self.page_size)

    @property
    def tensor_shape(self) -> tuple[int, ...]:
        """Shape of each virtual tensor: `[slots, context, kv_heads, head_dim]`, with layers before
        the heads in the mega layout."""
        layers = () if self.layout == "per_layer" else (self.num_layers,)
        return (self.max_slots, self.max_context, *layers, self.num_kv_heads, self.head_dim)

    @property
    def tensor_strides(self) -> tuple[int, ...]:
        """Element strides of `tensor_shape`: slots `slot_stride` bytes apart, the rest packed."""
        row = self.num_kv_heads * self.head_dim
        per_token = (row,) if self.layout == "per_layer" else (self.num_layers * row, row)
        return (self.slot_stride // self.element_size, *per_token, self.head_dim, 1)

    def virtual_tensor(self, reservation: torch.Tensor) -> torch.Tensor:
        """A reservation's flat bytes viewed as `tensor_shape` (no copy)."""
        return reservation.view(self.dtype).as_strided(self.tensor_shape, self.tensor_strides)

    def layer_views(self, buffers: list[torch.Tensor], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's K and V `[slots, context, kv_heads, head_dim]` among the virtual tensors."""
        if self.layout == "per_layer":
            return buffers[2 * layer], buffers[2 * layer + 1]
        return buffers[0][:, :, layer], buffers[1][:, :, layer]

    def page_offset(self, slot: int, page: int) -> int:
        """Byte offset of page `page` of slot `slot` inside any one virtual tensor."""
        return slot * self.slot_stride + page * self.page_size

    def pages_for(self, tokens: int) -> int:
        """Page steps (one page in every virtual tensor) a slot needs to hold `tokens`."""
        return math.ceil(tokens * self.bytes_per_token / self.page_size)

    def tokens_in(self, page_steps: int) -> int:
        """Tokens that lie wholly inside the first `page_steps` pages of a slot."""
        return min(self.max_context, page_steps * self.page_size // self.bytes_per_token)


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_positive_int(name: str, value: object) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
