"""What the cache reports about its memory and its mapping work."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MappingCounters:
    """Running totals, updated under the cache lock."""

    map_calls: int = 0
    map_pages: int = 0
    map_seconds: float = 0.0
    unmap_calls: int = 0
    unmap_pages: int = 0
    unmap_seconds: float = 0.0
    populate_pages: int = 0
    populate_seconds: float = 0.0
    page_needs: int = 0
    """Page steps a step() newly needed (a slot's length crossed into a page)."""
    needs_met_by_background: int = 0
    """... already mapped by the background thread (overlap or eager allocation)."""
    needs_met_by_reuse: int = 0
    """... already mapped because the slot kept a finished request's pages."""
    needs_mapped_in_step: int = 0
    """... that step() had to map itself, on the critical path."""


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of `KVCache.stats()`. Bytes are physical; a page is `page_size` bytes."""

    page_size: int
    pool_pages: int
    mapped_bytes: int
    """Behind any slot, active or idle."""
    active_bytes: int
    """Behind slots that hold a request."""
    idle_bytes: int
    """Kept behind finished requests' slots (deferred reclamation)."""
    free_bytes: int
    """Mapped nowhere: the budget minus `mapped_bytes`."""
    token_bytes: int
    """Holding the active requests' tokens."""
    waste_bytes: int
    """Mapped but holding no token: `mapped_bytes - token_bytes`."""
    pages_created: int
    fresh_pages_taken: int
    recycled_pages_taken: int
    pages_per_slot: tuple[int, ...]
    active_slots: int
    counters: MappingCounters
    background_errors: int

    @property
    def background_share(self) -> float:
        """Share of page needs met ahead of step() by the background thread."""
        c = self.counters
        return c.needs_met_by_background / c.page_needs if c.page_needs else 0.0
