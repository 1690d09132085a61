"""Locked, checked access to a KV cache's slots and tensors: the views of a request's K/V and
the whole virtual tensors the kernels read, each holding the slots it reaches (torch's
storage rule, vattn.memory). KVCache builds on it; what it reads is KVCache's state."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import torch

from vattn.backends import VMMBackend
from vattn.config import KVCacheConfig
from vattn.memory import CacheMemory, Lease
from vattn.slot import Slot
from vattn.validate import exact_int


class CacheAccess:
    """The cache's readers' side: every method takes the cache's lock and checks it is open
    and that the reqids and layers it is given exist."""

    config: KVCacheConfig
    backend: VMMBackend
    device: torch.device
    _lock: threading.Lock
    _closed: bool
    _slots: list[Slot]
    _memory: CacheMemory | None
    _layers: list[tuple[torch.Tensor, torch.Tensor]]
    """Each layer's K and V virtual tensors."""
    _qparams: list[tuple[torch.Tensor, torch.Tensor]]
    """An int8 cache's K and V (scale, midpoint) pairs, per layer."""

    def kv(self, layer: int, reqid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of one request in one layer, `[length, kv_heads, head_dim]` views.

        They hold the request's slot: while they live it is never unmapped and, once freed,
        not handed out again, so they always read what this request wrote.
        """
        with self._lock:
            self._check_open()
            layer = self._layer_index(layer)
            slot = self._active_slot(reqid)
            return self._open_memory().views(layer, [slot], slot.length, None, self.device)

    def kv_qparams(self, layer: int, reqid: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 cache's K and V qparams of one request in one layer, float32 `[length, kv_heads,
        2]` views that hold its slot as `kv`'s do: with (scale, midpoint) = kv_qparams(...)[0][t, h],
        value d of head h at token t is `kv(...)[0][t, h, d] * scale + midpoint`."""
        with self._lock:
            self._check_open()
            self._require_quantized()
            layer = self._layer_index(layer)
            slot = self._active_slot(reqid)
            return self._open_memory().views(layer, [slot], slot.length, None, self.device, qparams=True)

    def kv_batch(self, layer: int, reqids: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V `[len(reqids), max length, kv_heads, head_dim]` for padded batched attention.

        Every request must have the padded length mapped (pages are whole, so this holds
        whenever the lengths share their last page; otherwise step the short ones up).
        A view when the reqids are consecutive slots (holding them, as `kv` does), a copy of
        the mapped rows otherwise.
        """
        with self._lock:
            self._check_open()
            layer = self._layer_index(layer)
            if not reqids:
                raise ValueError("kv_batch needs at least one reqid")
            if self.config.quantized:
                raise ValueError("kv_batch pads float K/V; an int8 cache's need their qparams: use kv and kv_qparams")
            slots = [self._active_slot(r) for r in reqids]
            return self._open_memory().padded_batch(layer, self._layers[layer], slots, self.device)

    def lengths(self, reqids: Sequence[int]) -> list[int]:
        """Tokens the last step() guaranteed for each request: all that attention may read."""
        with self._lock:
            self._check_open()
            return [self._active_slot(reqid).length for reqid in reqids]

    def pin(self, reqids: Sequence[int]) -> Lease:
        """Holds these requests' slots as their views would, while the returned lease lives
        (an attention batch holds one for its iteration)."""
        with self._lock:
            self._check_open()
            return Lease(self._open_memory(), [self._active_slot(reqid) for reqid in reqids])

    def layer_tensors(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's whole K and V virtual tensors, `[max_slots, max_context, kv_heads, head_dim]`.

        For the attention kernels, within an iteration whose batch holds a `pin` of its
        requests: the kernels index rows by reqid and bound every access by `lengths()`.
        Anything else in these tensors may be unmapped or another request's.
        """
        with self._lock:
            self._check_open()
            return self._layers[self._layer_index(layer)]

    def layer_qparams(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """An int8 cache's K and V qparams of one layer, `[max_slots, max_context, kv_heads, 2]`, for
        the kernels under the same rule as `layer_tensors`."""
        with self._lock:
            self._check_open()
            self._require_quantized()
            return self._qparams[self._layer_index(layer)]

    def page_table(self, reqid: int) -> list[list[int]]:
        """Physical pages behind a request: entry k lists page k of each virtual tensor."""
        with self._lock:
            self._check_open()
            return [list(pages) for pages in self._active_slot(reqid).pages]

    # ---------------------------------------------------------------- checks

    def _require_quantized(self) -> None:
        if not self.config.quantized:
            raise ValueError(f"only an int8 cache has qparams; this one is {self.config.dtype}")

    def _layer_index(self, layer: int) -> int:
        return exact_int(layer, "layer", 0, self.config.num_layers - 1)

    def _open_memory(self) -> CacheMemory:
        if self._memory is None:
            raise RuntimeError("this KVCache is closed")
        return self._memory

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this KVCache is closed")
        if self.backend.forked:
            raise RuntimeError("this KVCache belongs to the process that forked this one and cannot be used here")

    def _active_slot(self, reqid: int) -> Slot:
        slot = self._slots[exact_int(reqid, "reqid", 0, self.config.max_slots - 1)]
        if not slot.active:
            raise ValueError(f"reqid {slot.index} is not allocated (never handed out, or already freed)")
        return slot
