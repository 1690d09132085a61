"""Which pages move, and in what order: the slot handed out next, what step() may reclaim
(cheapest loss first), and the background thread's next batch of work."""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

from vattn.config import KVCacheConfig
from vattn.errors import OutOfPagesError
from vattn.page_pool import PagePool
from vattn.prefix_cache import CachedUnit, PartialMatch, PrefixCache
from vattn.slot import Origin, Slot
from vattn.slot_pages import SlotPages

Reclaim = tuple[Slot, int] | CachedUnit
"""Pages that can go: a slot's last page groups (how many), or a prefix-cache entry."""


class PagePolicy:
    """The cache's decisions over its slots, pool and prefix cache; the caller holds its lock."""

    def __init__(
        self,
        config: KVCacheConfig,
        slots: Sequence[Slot],
        pool: PagePool,
        prefix: PrefixCache,
        pages: SlotPages,
        borrow: Callable[[int], object] | None = None,
    ) -> None:
        self.config = config
        self.slots = slots
        self.pool = pool
        self.prefix = prefix
        self.pages = pages
        self.borrow = borrow
        """On a shared budget: asks the other caches to give back that many pages' bytes."""

    def next_free_slot(self) -> Slot | None:
        """The slot alloc_reqid hands out next: most pages mapped, then lowest index."""
        free = (slot for slot in self.slots if not slot.active and not slot.leases)  # leases: pinned
        return max(free, key=lambda slot: (len(slot.pages), -slot.index), default=None)

    def reclaimable(self, keep: Mapping[int, int], for_step: bool) -> list[Reclaim]:
        """What can go, cheapest loss first: idle slots' pages (the next reqid's last); for
        step(), also prefix-cache entries (least recently used first, before the next reqid's
        pages) and active slots' pages past what they need. `keep` overrides what a slot
        needs. Slots that live views hold keep every page."""
        nxt = self.next_free_slot()
        idle = sorted((s for s in self.slots if not s.active and s is not nxt), key=lambda s: len(s.pages))
        active = [s for s in self.slots if s.active] if for_step else []

        def spare_groups(slots: list[Slot]) -> list[Reclaim]:
            spare: list[Reclaim] = []
            for slot in slots:
                need = keep.get(slot.index, self.config.pages_for(slot.length) if slot.active else 0)
                if len(slot.pages) > need and not slot.pinned():
                    spare.append((slot, len(slot.pages) - need))
            return spare

        units: list[Reclaim] = list(self.prefix.units()) if for_step else []
        return spare_groups(idle) + units + spare_groups([nxt] if nxt else []) + spare_groups(active)

    def available_pages(self, keep: Mapping[int, int]) -> int:
        """Free pages plus those that reclaiming everything step() may take would free: the
        pages all of whose references it drops."""
        drops: Counter[int] = Counter()
        for action in self.reclaimable(keep, for_step=True):
            for group in action.pages if isinstance(action, CachedUnit) else action[0].pages[-action[1] :]:
                drops.update(group)
        return self.pool.num_free + sum(count == self.pool.refs(page) for page, count in drops.items())

    def make_room(self, needed: int, keep: Mapping[int, int]) -> None:
        """Frees pages until `needed` are free, or raises OutOfPagesError having changed nothing
        here. On a shared budget, what this cache cannot free itself is asked of the others."""
        if self.pool.num_free >= needed:
            return
        available = self.borrowed_available(needed, keep)
        if available < needed:
            raise OutOfPagesError(needed, available)
        self.reclaim(needed, keep, for_step=True)

    def borrowed_available(self, needed: int, keep: Mapping[int, int]) -> int:
        """`available_pages`, after asking the budget's other caches for what it lacks of `needed`."""
        available = self.available_pages(keep)
        if available < needed and self.borrow:
            self.borrow(needed - available)
            available = self.available_pages(keep)
        return available

    def lend(self, count: int) -> int:
        """Destroys up to `count` pages for another cache on the budget: free ones first, then
        what reclaiming for a step would take, but never a page an active slot maps. Returns
        how many were destroyed."""
        if self.pool.num_recycled < count:
            keep = {slot.index: len(slot.pages) for slot in self.slots if slot.active}
            self.reclaim(self.pool.num_creatable + count, keep, for_step=True)
        return self.pool.shrink(count)

    def reclaim(self, target_free: int, keep: Mapping[int, int], for_step: bool) -> bool:
        """Takes reclaimable pages in order until the pool has `target_free` free; returns
        whether anything went. A first pass spares prefix-cache entries that would free
        nothing (their pages still mapped in a slot); a second takes whatever is left."""
        done = False
        goal = target_free - self.pool.num_creatable  # in recycled pages: others may create meanwhile
        for sparing in (True, False):
            for action in self.reclaimable(keep, for_step):
                deficit = goal - self.pool.num_recycled
                if deficit <= 0:
                    return done
                if isinstance(action, CachedUnit):
                    pages = [page for group in action.pages for page in group]
                    if not sparing or any(self.pool.refs(page) == 1 for page in pages):
                        self.prefix.evict(action)
                        done = True
                    continue
                slot, spare = action
                groups, freed = 0, 0
                while groups < spare and freed < deficit:  # from the last, until they free enough
                    groups += 1
                    freed += sum(self.pool.refs(page) == 1 for page in slot.pages[-groups])
                self.pages.unmap_last_groups([(slot, groups)])
                done = True
        return done

    def grow(self, targets: Sequence[tuple[Slot, int]]) -> None:
        """Step's work: each slot gets pages for its new length (room made first; all or
        nothing, OutOfPagesError with no slot changed) and that length; the prefix cache is
        trimmed after. Counts which needs the background thread had met."""
        cfg = self.config
        for slot, _ in targets:
            self.settle(slot, 0)
        growth = [(slot, cfg.pages_for(n) - len(slot.pages)) for slot, n in targets]
        growth = [(slot, missing) for slot, missing in growth if missing > 0]
        met = [(slot, range(cfg.pages_for(slot.length), min(cfg.pages_for(n), len(slot.pages)))) for slot, n in targets]
        counters = self.pages.counters
        if growth:
            self.make_room(
                sum(missing for _, missing in growth) * cfg.num_buffers, {s.index: cfg.pages_for(n) for s, n in targets}
            )
            counters.populate.add(*self.pages.populate(self.pages.map(growth, Origin.STEP)))
        already_mapped = (slot.origins[k] is Origin.BACKGROUND for slot, needed in met for k in needed)
        counters.count_needs(already_mapped, sum(missing for _, missing in growth))
        for slot, n in targets:
            slot.length = n
            self.prefix.forget_past(slot, n, cfg.unit_tokens)  # a shrink drops its KV
        self.trim_prefix_cache()

    def adopt_prefix(self, slot: Slot, units: Sequence[CachedUnit], partial: PartialMatch | None) -> None:
        """A new request's matched prefix: the whole cached units' page groups mapped behind its
        slot (shared, never copied; those it already maps kept), and with `token` matching the
        partial unit's tokens copied into pages of its own (skipped, left to compute, if no
        pages are free); its length is what it got. Counts the hits."""
        cfg = self.config
        groups = [group for found in units for group in found.pages]
        kept = next((k for k, group in enumerate(groups[: len(slot.pages)]) if slot.pages[k] != group), None)
        kept = min(len(groups), len(slot.pages)) if kept is None else kept  # already mapped: not remapped
        self.settle(slot, len(groups))
        if units:
            self.pages.map_shared(slot, groups[kept:], kept)
            slot.length = len(units) * cfg.unit_tokens
            slot.shared_groups = len(units) * cfg.unit_groups
        if partial and cfg.prefix_match == "token":
            with contextlib.suppress(OutOfPagesError):
                self.copy_prefix(slot, partial.unit.pages, partial.tokens)
                slot.length += partial.tokens
        self.trim_prefix_cache()
        self.prefix.counters.hits += slot.length

    def settle(self, slot: Slot, keep: int) -> None:
        """A fresh slot's kept pages that it may not write go, from page group `keep` on. With a
        cold prefix cache (`prefix_cold_after`), the entries its last request left on them go
        instead where they can (`evict_left_units`): the pages stay mapped, its own."""
        if slot.fresh:
            if self.prefix.misses_in_a_row >= self.config.prefix_cold_after:
                self.evict_left_units(slot, keep)
            self.pages.drop_shared(slot, keep)
            slot.fresh = False

    def evict_left_units(self, slot: Slot, keep: int) -> None:
        """Evicts the prefix-cache entries that the slot's last request left on its page groups
        from `keep` on, all or none: only where they are those pages' only other holders and
        no entry cached after one of them would be left unreachable."""
        units: dict[bytes, CachedUnit] = {}
        held: set[int] = set()  # the page groups they hold
        for index, digest in enumerate(slot.left_units):
            start, unit = index * self.config.unit_groups, self.prefix.get(digest)
            if unit is None or start + len(unit.pages) <= keep:
                continue
            if start < keep or slot.pages[start : start + len(unit.pages)] != unit.pages:
                return
            units[digest] = unit
            held.update(range(start, start + len(unit.pages)))
        for k, group in enumerate(slot.pages[keep:], keep):
            if any(self.pool.refs(page) != (2 if k in held else 1) for page in group):
                return
        if any(child not in units for digest in units for child in self.prefix.children(digest)):
            return
        for unit in reversed(units.values()):
            self.prefix.evict_in_place(unit, self.config.prefix_copy_min_tokens)

    def unmap_idle(self) -> bool:
        """Unmaps every idle slot's pages but those of slots live views hold; whether any went."""
        idle = [(s, len(s.pages)) for s in self.slots if not s.active and s.pages and not s.pinned()]
        if idle:
            self.pages.unmap_last_groups(idle)
        return bool(idle)

    def trim_prefix_cache(self) -> None:
        """Evicts least recently used prefix-cache entries that hold pages no slot maps until
        those pages are within `prefix_cache_share` of the pool (entries whose pages are all
        mapped somewhere cost nothing and stay)."""
        limit = self.config.prefix_cache_pages
        for unit in self.prefix.units() if self.pool.num_cache_only > limit else ():
            if self.pool.num_cache_only <= limit:
                return
            if any(self.pool.cache_only(page) for group in unit.pages for page in group):
                self.prefix.evict(unit)

    def background_batch(self) -> list[int] | None:
        """Maps every active slot's next pages in one batch, or reclaims to
        the watermark, or pre-maps the next reqid. Returns addresses to populate, or None."""
        cfg, width = self.config, self.config.num_buffers
        floor = math.ceil(cfg.reclaim_watermark * self.pool.capacity)
        growth, budget = [], self.pool.num_free
        for slot in self.slots:
            if slot.active:
                ahead = min(slot.length + cfg.lookahead_tokens, cfg.max_context)
                missing = cfg.pages_for(ahead) - len(slot.pages)
                if 0 < missing * width <= budget:
                    growth.append((slot, missing))
                    budget -= missing * width
        if growth:
            return self.pages.map(growth, Origin.BACKGROUND)
        if self.pool.num_free < floor and self.reclaim(floor, {}, for_step=False):
            self.trim_prefix_cache()
            return []
        nxt = self.next_free_slot()
        eager = min(cfg.eager_pages, cfg.max_slot_groups)
        if nxt and len(nxt.pages) < eager and self.pool.num_free - width >= floor:
            return self.pages.map([(nxt, 1)], Origin.BACKGROUND)
        return None

    def copy_prefix(self, slot: Slot, source: list[list[int]], tokens: int) -> None:
        """Gives the slot pages of its own for `tokens` more tokens after its length and copies
        their KV from the page groups `source` (a cached unit's, held while it is copied, so
        that making room may evict the unit but not free its pages); room made first, or
        OutOfPagesError with the slot unchanged."""
        cfg = self.config
        first = slot.length * cfg.bytes_per_token // cfg.page_size  # a unit starts on a page
        wanted = cfg.pages_for(slot.length + tokens)
        held = [page for group in source for page in group]
        self.pool.share(held)
        try:
            if (missing := wanted - len(slot.pages)) > 0:
                self.make_room(missing * cfg.num_buffers, {slot.index: wanted})
                self.pages.map([(slot, missing)], Origin.STEP)
            self.pages.copy_from_pages(source, slot, first, tokens * cfg.bytes_per_token)
        finally:
            self.pool.give_back(held)
        self.pages.counters.prefix_copied_bytes += tokens * cfg.bytes_per_token * len(self.pages.bases)

    def fork(self, parent: Slot, child: Slot) -> int:
        """Maps the parent's whole page groups behind the free slot `child` and copies its
        partial last one (room made first); returns how many page groups the two now share."""
        cfg, width = self.config, self.config.num_buffers
        written = parent.length * cfg.bytes_per_token
        shared = written // cfg.page_size
        partial = cfg.pages_for(parent.length) - shared
        if child.pages:
            self.pages.unmap_last_groups([(child, len(child.pages))])
        self.make_room(partial * width, {parent.index: len(parent.pages), child.index: 0})
        self.pages.map_shared(child, parent.pages[:shared])
        partial_bytes = written - shared * cfg.page_size
        if partial:
            self.pages.map([(child, 1)], Origin.STEP)
            self.pages.copy_partial_group(parent, child, shared, partial_bytes)
        counters = self.pages.counters
        counters.forks += 1
        counters.fork_shared_pages += shared * width
        counters.fork_copied_bytes += partial_bytes * len(self.pages.bases)
        return shared
