"""What the cache reports about its memory and its mapping work."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from vattn.config import KVCacheConfig
from vattn.page_pool import PagePool
from vattn.prefix_cache import PrefixCache, PrefixCounters
from vattn.slot import Slot


@dataclass
class CallTotals:
    """Batched calls of one kind to the VMM backend, the pages they covered and their time."""

    calls: int = 0
    pages: int = 0
    seconds: float = 0.0

    def add(self, pages: int, seconds: float) -> None:
        self.calls += 1
        self.pages += pages
        self.seconds += seconds


@dataclass
class MappingCounters:
    """Running totals, updated under the cache lock."""

    map: CallTotals = field(default_factory=CallTotals)
    unmap: CallTotals = field(default_factory=CallTotals)
    populate: CallTotals = field(default_factory=CallTotals)
    """Pre-faulting mapped pages (host: MADV_POPULATE_WRITE)."""
    page_needs: int = 0
    """Page groups a step() newly needed (a slot's length crossed into a page)."""
    needs_met_by_background: int = 0
    """... already mapped by the background thread (overlap or eager allocation)."""
    needs_met_by_reuse: int = 0
    """... already mapped because the slot kept a finished request's pages."""
    needs_mapped_in_step: int = 0
    """... that step() had to map itself, on the critical path."""
    forks: int = 0
    """fork_reqid calls that succeeded."""
    fork_shared_pages: int = 0
    """Pages the forks mapped behind their new slots instead of copying."""
    fork_copied_bytes: int = 0
    """Bytes the forks copied: each one's last partial page, in every virtual tensor."""
    prefix_copied_bytes: int = 0
    """Bytes prefix matches copied: the tokens they found inside a cached unit, in every virtual tensor."""

    def copy(self) -> MappingCounters:
        """An independent copy, its CallTotals too (copy.deepcopy took ~15 us, a third of a snapshot)."""
        return replace(self, map=copy.copy(self.map), unmap=copy.copy(self.unmap), populate=copy.copy(self.populate))

    def count_needs(self, already_mapped: Iterable[bool], mapped_in_step: int) -> None:
        """Page needs of one step(): for those mapped before it, whether the background thread did it."""
        for by_background in already_mapped:
            self.page_needs += 1
            if by_background:
                self.needs_met_by_background += 1
            else:
                self.needs_met_by_reuse += 1
        self.page_needs += mapped_in_step
        self.needs_mapped_in_step += mapped_in_step


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of `KVCache.stats()`. Bytes are physical; a page is `page_size` bytes."""

    page_size: int
    pool_pages: int
    mapped_bytes: int
    """Behind any slot, active or idle (a page shared by several counts once)."""
    active_bytes: int
    """Behind slots that hold a request."""
    idle_bytes: int
    """Kept behind finished requests' slots only (deferred reclamation)."""
    cached_bytes: int
    """Held by the prefix cache only, mapped behind no slot."""
    free_bytes: int
    """Referenced by nothing: the budget minus `mapped_bytes` and `cached_bytes`."""
    used_bytes: int
    """Holding the active requests' tokens (a shared prefix counts once per request)."""
    pages_created: int
    fresh_pages_taken: int
    recycled_pages_taken: int
    pages_per_slot: tuple[int, ...]
    active_slots: int
    pinned_slots: int
    """Slots a live view (or planned batch) can reach: never unmapped, not handed out again meanwhile."""
    counters: MappingCounters
    background_errors: int
    prefix: PrefixCounters = field(default_factory=PrefixCounters)
    """Prefix-cache queries and hits, in tokens."""

    @classmethod
    def of(
        cls,
        config: KVCacheConfig,
        slots: Sequence[Slot],
        pool: PagePool,
        prefix: PrefixCache,
        counters: MappingCounters,
        errors: int,
    ) -> CacheStats:
        """The figures of a cache's slots, pool and prefix cache (taken under the cache lock)."""

        def groups(chosen: Iterable[Slot]) -> set[int]:
            """The page groups behind the slots, each by its first page: a group's pages (one per
            virtual tensor) are mapped, shared and unmapped together, so counting groups counts
            pages `num_buffers` times faster (a server takes this snapshot every iteration)."""
            return {group[0] for slot in chosen for group in slot.pages}

        active = groups(s for s in slots if s.active)
        idle = groups(s for s in slots if not s.active) - active
        group_bytes = config.page_group_bytes
        return cls(
            page_size=config.page_size,
            pool_pages=pool.capacity,
            mapped_bytes=len(active | idle) * group_bytes,
            active_bytes=len(active) * group_bytes,
            idle_bytes=len(idle) * group_bytes,
            cached_bytes=pool.num_cache_only * config.page_size,
            free_bytes=pool.num_free * config.page_size,
            used_bytes=sum(s.length for s in slots if s.active) * config.bytes_per_token * config.num_buffers,
            pages_created=pool.num_created,
            fresh_pages_taken=pool.fresh_pages_taken,
            recycled_pages_taken=pool.recycled_pages_taken,
            pages_per_slot=tuple(len(s.pages) * config.num_buffers for s in slots),
            active_slots=sum(s.active for s in slots),
            pinned_slots=sum(s.pinned() for s in slots),
            counters=counters.copy(),
            background_errors=errors,
            prefix=copy.copy(prefix.counters),
        )

    @property
    def waste_bytes(self) -> int:
        """Mapped but holding no token (without sharing; a shared prefix makes it negative)."""
        return self.mapped_bytes - self.used_bytes
