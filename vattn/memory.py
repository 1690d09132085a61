"""A cache's address space and pages, and the leases that keep them alive: torch's storage rule.

Every tensor the cache hands out is built over its own storage, and that storage holds a
`Lease`. A lease pins the slots its tensor can reach (they are never unmapped or handed to
another request while it lives) and holds the `CacheMemory`, which is freed only when the
cache and every lease are gone: by `close()`, or by the garbage collector after the last
tensor dies. So no tensor ever reaches memory that is unmapped, reused or another cache's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

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
        self.stranded: list[int] = []
        """Addresses a failed map could not roll back: mapped, in no slot, freed with their reservation."""
        self.release = weakref.finalize(self, _release, config, backend, self.bases, slots, pool, self.stranded)
        self.release.atexit = False  # at exit live views may still be read; the process frees it all

    def views(
        self, layer: int, slots: list[Slot], length: int, rows: int | None, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V views (`rows_view`) of consecutive slots over storages of their own, which
        hold a lease on exactly those slots (the cache's lock held)."""
        cfg = self.config
        if length == 0:
            shape = (0, cfg.num_kv_heads, cfg.head_dim) if rows is None else (rows, 0, cfg.num_kv_heads, cfg.head_dim)
            empty = torch.empty(shape, dtype=cfg.dtype, device=device)
            return empty, empty.clone()
        lease = Lease(self, slots)
        offset, nbytes = slots[0].index * cfg.slot_stride, cfg.rows_bytes(rows or 1, length)
        k, v = (
            self.backend.tensor(self.bases[b] + offset, nbytes, lease, True, cfg.dtype) for b in cfg.kv_buffers(layer)
        )
        return cfg.rows_view(k, layer, length, rows), cfg.rows_view(v, layer, length, rows)

    def reserve(self) -> None:
        """Reserves one range per virtual tensor (freed by `release` even if this fails part-way)."""
        for _ in range(self.config.num_buffers):
            self.bases.append(self.backend.reserve(self.config.reservation_bytes))


class Lease:
    """Alive while a tensor over the cache's memory (or a planned attention batch) may use it."""

    __slots__ = ("__weakref__", "memory")

    def __init__(self, memory: CacheMemory, slots: Sequence[Slot]) -> None:
        self.memory = memory
        for slot in slots:  # set.add and the callback's set.discard are atomic: no lock needed
            slot.leases.add(weakref.ref(self, slot.leases.discard))


def _release(
    config: KVCacheConfig,
    backend: VMMBackend,
    bases: list[int],
    slots: Sequence[Slot],
    pool: PagePool,
    stranded: list[int],
) -> None:
    try:
        if backend.forked:  # the parent still uses these pages; the child only lets go of its handles
            return
        for base in bases:
            mapped = [base + config.page_offset(s.index, k) for s in slots for k in range(len(s.pages))]
            inside = [addr for addr in stranded if base <= addr < base + config.reservation_bytes]
            backend.free_reservation(base, config.reservation_bytes, mapped + inside)
        bases.clear()
        for slot in slots:
            slot.pages.clear()
            slot.origins.clear()
        pool.release_all()
    finally:
        backend.close()
