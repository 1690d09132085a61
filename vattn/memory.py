"""A cache's address space and pages, and the leases that keep them alive: torch's storage rule.

Every tensor the cache hands out is built over its own storage, and that storage holds a
`Lease`. A lease pins the slots its tensor can reach (they are never unmapped or handed to
another request while it lives) and holds the `CacheMemory`, which is freed only when the
cache and every lease are gone: by `close()`, or by the garbage collector after the last
tensor dies. So no tensor ever reaches memory that is unmapped, reused or another cache's.
On a GPU a tensor dies before the kernels queued on it finish: as a lease dies, its slots get
a fence after that work (`VMMBackend.fence`), and unmapping their pages waits for it.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from functools import partial

import torch

from vattn.backends.base import VMMBackend
from vattn.config import KVCacheConfig
from vattn.page_pool import PagePool
from vattn.slot import Slot


class CacheMemory:
    """The reservations, the page pool and the slots' page tables of one cache.

    Whoever holds it keeps every address and mapped page alive; `release` frees them once,
    when it is called or when the last holder lets go.
    """

    def __init__(self, config: KVCacheConfig, backend: VMMBackend, slots: Sequence[Slot], pool: PagePool) -> None:
        self.config = config
        self.backend = backend
        self.bases: list[int] = []
        self.scratch: list[int] = []
        """Per virtual tensor, a unit's worth of address space where cached pages that no slot
        maps are mapped for a moment to be read (a token-granular prefix match copies from them)."""
        self.stranded: list[int] = []
        """Addresses a failed map could not roll back: mapped, in no slot, freed with their reservation."""
        self.release = weakref.finalize(
            self, _release, config, backend, self.bases, self.scratch, slots, pool, self.stranded
        )
        self.release.atexit = False  # at exit live views may still be read; the process frees it all

    def open(
        self,
    ) -> tuple[Lease, list[tuple[torch.Tensor, torch.Tensor]], list[tuple[torch.Tensor, torch.Tensor]]]:
        """Reserves the address space and returns a lease on no slot with, over it, each layer's
        K and V `[slots, context, kv_heads, head_dim]` virtual tensors (the kernels') and, for an
        int8 cache, their `[slots, context, kv_heads, 2]` qparams (else none); releases what it
        reserved if anything fails."""
        cfg = self.config
        try:
            for _ in range(cfg.num_buffers):
                self.bases.append(self.backend.reserve(cfg.reservation_bytes))
                self.scratch.append(self.backend.reserve(cfg.unit_bytes))
            kernels_lease = Lease(self, ())
            buffers = [
                self.backend.tensor(base, cfg.reservation_bytes, kernels_lease, dtype=cfg.dtype) for base in self.bases
            ]
        except BaseException:
            self.release()
            raise
        rows, context = cfg.max_slots, cfg.max_context
        layers = [
            tuple(cfg.rows_view(buffers[b], layer, context, rows) for b in cfg.kv_buffers(layer))
            for layer in range(cfg.num_layers)
        ]
        qparams = [
            tuple(cfg.qparams_view(buffers[b], layer, context, rows) for b in cfg.kv_buffers(layer))
            for layer in range(cfg.num_layers if cfg.quantized else 0)
        ]
        return kernels_lease, layers, qparams  # type: ignore[return-value]

    def padded_batch(
        self, layer: int, layer_tensors: tuple[torch.Tensor, torch.Tensor], slots: list[Slot], device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of `slots` padded to the longest: views when the slots are consecutive, else
        a copy of their rows; every slot must have that length mapped."""
        length = max(slot.length for slot in slots)
        for slot in slots:
            if (mapped := self.config.tokens_in(len(slot.pages))) < length:
                raise ValueError(
                    f"reqid {slot.index} has {mapped} tokens mapped but the batch is padded "
                    f"to {length}: step it to {length} first"
                )
        first = slots[0].index
        if [slot.index for slot in slots] == list(range(first, first + len(slots))):
            return self.views(layer, slots, length, len(slots), device)
        keys, values = layer_tensors
        index = torch.tensor([slot.index for slot in slots], device=keys.device)
        copies = keys[:, :length].index_select(0, index), values[:, :length].index_select(0, index)
        fence = self.backend.fence()  # the copy reads the slots with no lease on them
        for slot in slots:
            slot.add_fence(fence)
        return copies

    def views(
        self, layer: int, slots: list[Slot], length: int, rows: int | None, device: torch.device, qparams: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views (`rows_view`, or an int8 cache's `qparams_view` when `qparams`) of
        consecutive slots over storages of their own, which hold a lease on exactly those slots
        (the cache's lock held)."""
        cfg = self.config
        if length == 0:
            inner = (cfg.num_kv_heads, 2) if qparams else (cfg.num_kv_heads, cfg.head_dim)
            shape = (0, *inner) if rows is None else (rows, 0, *inner)
            empty = torch.empty(shape, dtype=torch.float32 if qparams else cfg.dtype, device=device)
            return empty, empty.clone()
        lease = Lease(self, slots)
        offset, nbytes = slots[0].index * cfg.slot_stride, cfg.rows_bytes(rows or 1, length)
        k, v = (
            self.backend.tensor(self.bases[b] + offset, nbytes, lease, True, cfg.dtype) for b in cfg.kv_buffers(layer)
        )
        view = cfg.qparams_view if qparams else cfg.rows_view
        return view(k, layer, length, rows), view(v, layer, length, rows)


class Lease:
    """Alive while a tensor over the cache's memory (or a planned attention batch) may use it."""

    __slots__ = ("__weakref__", "memory")

    def __init__(self, memory: CacheMemory, slots: Sequence[Slot]) -> None:
        self.memory = memory
        if slots:  # set.add and the callback's set.discard are atomic: no lock needed
            ref = weakref.ref(self, partial(_lease_died, memory.backend, tuple(slots)))
            for slot in slots:
                slot.leases.add(ref)


def _lease_died(backend: VMMBackend, slots: tuple[Slot, ...], ref: weakref.ref[Lease]) -> None:
    """Runs in whichever thread lets go of the lease, without the cache's lock: fences the work
    queued so far on that thread's current stream (where the lease's tensors were used) on each
    slot before the lease leaves it, so whoever sees a slot unpinned sees its fence too."""
    fence = backend.fence()
    for slot in slots:
        slot.add_fence(fence)
        slot.leases.discard(ref)


def _release(
    config: KVCacheConfig,
    backend: VMMBackend,
    bases: list[int],
    scratch: list[int],
    slots: Sequence[Slot],
    pool: PagePool,
    stranded: list[int],
) -> None:
    """Frees everything. `free_reservation` waits for all the device's work first: closing is rare,
    and that covers work that no slot's fence does too (through the layer tensors)."""
    try:
        if backend.forked:  # the parent still uses these pages; the child only lets go of its handles
            return
        for base in bases:
            mapped = [base + config.page_offset(s.index, k) for s in slots for k in range(len(s.pages))]
            inside = [addr for addr in stranded if base <= addr < base + config.reservation_bytes]
            backend.free_reservation(base, config.reservation_bytes, mapped + inside)
        for base in scratch:
            backend.free_reservation(
                base, config.unit_bytes, [a for a in stranded if base <= a < base + config.unit_bytes]
            )
        bases.clear()
        scratch.clear()
        for slot in slots:
            slot.pages.clear()
            slot.origins.clear()
        pool.release_all()
    finally:
        for slot in slots:
            slot.fences.clear()  # their events go while the backend still holds the context
        backend.close()
