"""The pages behind each slot: page groups mapped, unmapped and shared, one batched backend
call each and all or nothing. The pool keeps the pages' references (vattn.page_pool); which
pages to move, and when, is the page policy's (vattn.page_policy). An unmap waits only for the
GPU work that may read the pages: that behind the fences of the slots they are unmapped from."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from vattn.backends import VMMBackend
from vattn.backends.base import Fence, MapError
from vattn.config import KVCacheConfig
from vattn.page_pool import PagePool
from vattn.prefix_cache import PrefixCache
from vattn.slot import Origin, Slot
from vattn.stats import MappingCounters


def fences(slots: Sequence[Slot]) -> list[Fence]:
    """The fences of the GPU work that may read these slots' pages."""
    return [fence for slot in slots for fence in list(slot.fences.values())]  # list(): one atomic copy


class SlotPages:
    """Page groups behind slots (group k of a slot: its k-th page in every virtual tensor).
    The caller holds the cache's lock."""

    def __init__(
        self,
        config: KVCacheConfig,
        backend: VMMBackend,
        pool: PagePool,
        bases: list[int],
        scratch: list[int],
        stranded: list[int],
        counters: MappingCounters,
    ) -> None:
        self.config = config
        self.backend = backend
        self.pool = pool
        self.bases = bases
        """Each virtual tensor's reservation."""
        self.scratch = scratch
        """Each virtual tensor's scratch unit (see CacheMemory.scratch)."""
        self.stranded = stranded
        """Addresses a failed map could not roll back (see CacheMemory.stranded)."""
        self.counters = counters

    def drop_shared(self, slot: Slot, first: int = 0) -> None:
        """Before a reused slot's request writes: unmaps its pages from the first one at or after
        group `first` that anything else maps (the prefix cache, a fork) on, so the request
        writes only its own."""
        shared = next((k for k in range(first, len(slot.pages)) if self.pool.refs(slot.pages[k][0]) > 1), None)
        if shared is not None:
            self.unmap_last_groups([(slot, len(slot.pages) - shared)])

    def map_shared(self, slot: Slot, groups: list[list[int]], first: int = 0) -> None:
        """Maps already referenced page groups as the slot's groups from `first` on (it maps
        `first` groups at least), in place of any pages it has there (one more reference each)."""
        if not groups:
            return
        count = len(groups)
        replaced = min(count, len(slot.pages) - first)
        if replaced:
            self.backend.unmap(self.addrs(slot, first, replaced), fences([slot]))
            self.pool.give_back(page for group in slot.pages[first : first + replaced] for page in group)
        pages = [page for group in groups for page in group]
        self.pool.share(pages)
        addrs = self.addrs(slot, first, count)
        try:
            self.map_pages(addrs, pages)
        except BaseException:  # the slot's pages must stay a prefix: its own ones after the gap go too
            if rest := len(slot.pages) - first - replaced:
                self.backend.unmap(self.addrs(slot, first + replaced, rest), fences([slot]))
                self.pool.give_back(page for group in slot.pages[first + replaced :] for page in group)
            del slot.pages[first:]
            del slot.origins[first:]
            raise
        slot.pages[first : first + replaced] = [list(group) for group in groups[:replaced]]
        slot.pages += [list(group) for group in groups[replaced:]]
        slot.origins[first : first + replaced] = [Origin.SHARED] * replaced
        slot.origins += [Origin.SHARED] * (count - replaced)

    def addrs(self, slot: Slot, first: int, count: int) -> list[int]:
        """Addresses of page groups first..first+count of a slot, page by page, tensor by tensor."""
        offsets = [self.config.page_offset(slot.index, k) for k in range(first, first + count)]
        return [base + offset for offset in offsets for base in self.bases]

    def map(self, growth: list[tuple[Slot, int]], origin: Origin) -> list[int]:
        """Maps `count` more page groups behind each slot in one batch; returns the addresses."""
        width = self.config.num_buffers
        addrs = [a for slot, count in growth for a in self.addrs(slot, len(slot.pages), count)]
        pages = self.pool.take(len(addrs))
        self.map_pages(addrs, pages)
        taken = iter(pages)
        for slot, count in growth:
            for _ in range(count):
                slot.pages.append([next(taken) for _ in range(width)])
                slot.origins.append(origin)
        return addrs

    def map_pages(self, addrs: list[int], pages: list[int]) -> None:
        """One batched map call of referenced pages; on failure their references are dropped,
        but those of pages left mapped somewhere (never to be handed out again). An address a
        failed rollback left mapped is unmapped first (a GPU driver refuses to map over it)."""
        started = time.perf_counter()
        if stale := [addr for addr in addrs if addr in self.stranded]:
            self.backend.unmap(stale)  # in no slot: nothing read them
            self.stranded[:] = [addr for addr in self.stranded if addr not in stale]
        try:
            self.backend.map(addrs, pages)
        except MapError as exc:
            stranded = set(exc.stranded)
            self.stranded += exc.stranded
            self.pool.give_back([page for addr, page in zip(addrs, pages, strict=True) if addr not in stranded])
            raise
        except BaseException:
            self.pool.give_back(pages)
            raise
        self.counters.map.add(len(pages), time.perf_counter() - started)

    def unmap_last_groups(self, counts: list[tuple[Slot, int]]) -> None:
        """Unmaps the last `count` page groups of each slot in one batch; pages go back to the pool."""
        addrs, pages = [], []
        for slot, count in counts:
            first = len(slot.pages) - count
            addrs += self.addrs(slot, first, count)
            pages += [page for group in slot.pages[first:] for page in group]
        started = time.perf_counter()
        self.backend.unmap(addrs, fences([slot for slot, _ in counts]))
        self.counters.unmap.add(len(pages), time.perf_counter() - started)
        for slot, count in counts:
            del slot.pages[len(slot.pages) - count :]
            del slot.origins[len(slot.origins) - count :]
        self.pool.give_back(pages)

    def populate(self, addrs: list[int]) -> tuple[int, float]:
        """Pre-faults mapped pages; returns (pages done, seconds) for `counters.populate`."""
        started = time.perf_counter()
        return self.backend.populate(addrs), time.perf_counter() - started

    def copy_partial_group(self, source: Slot, target: Slot, group: int, nbytes: int) -> None:
        """Copies the first `nbytes` of page group `group` of `source` into `target`'s (both mapped)."""
        cfg = self.config
        for base in self.bases:
            src, dst = (base + cfg.page_offset(s.index, group) for s in (source, target))
            self.backend.tensor(dst, nbytes, mapped=True).copy_(self.backend.tensor(src, nbytes, mapped=True))
        fence = self.backend.fence()  # the copy uses both slots with no lease on them
        source.add_fence(fence)
        target.add_fence(fence)

    def copy_from_pages(self, source: list[list[int]], target: Slot, group: int, nbytes: int) -> None:
        """Copies the first `nbytes` held by the page groups `source` (referenced by the caller,
        perhaps mapped nowhere) into `target`'s groups from `group` on (mapped, its own), through
        the scratch units: mapped there for the copy, unmapped once it is done."""
        cfg = self.config
        count = -(-nbytes // cfg.page_size)
        addrs = [base + k * cfg.page_size for k in range(count) for base in self.scratch]
        try:
            self.backend.map(addrs, [page for pages in source[:count] for page in pages])
        except MapError as exc:
            self.stranded += exc.stranded
            raise
        try:
            for base, scratch in zip(self.bases, self.scratch, strict=True):
                dst = base + cfg.page_offset(target.index, group)
                self.backend.tensor(dst, nbytes, mapped=True).copy_(self.backend.tensor(scratch, nbytes, mapped=True))
        finally:
            fence = self.backend.fence()
            self.backend.unmap(addrs, [fence] if fence else [])

    def check_invariants(self, slots: Sequence[Slot], prefix: PrefixCache) -> None:
        """Raises AssertionError unless the pages behind the slots are consistent: each page's
        reference count is the slots and prefix-cache entries that hold it, every page is free
        or referenced, a slot maps a page once, covers its length and writes only pages of its own."""
        cfg, pool = self.config, self.pool
        references: Counter[int] = Counter(page for slot in slots for group in slot.pages for page in group)
        # Two entries may hold one page: a child forked inside a unit of several pages shares
        # the parent's whole pages before the fork point, and its unit, keyed by other tokens
        # after it, is cached beside the parent's. Those pages hold the same KV for both.
        mapped = set(references)
        references.update(page for unit in prefix.units() for group in unit.pages for page in group)
        cache_only = len(references.keys() - mapped)
        problems = [
            *(f"page {p} has {pool.refs(p)} references, not {n}" for p, n in references.items() if pool.refs(p) != n),
            *(
                [f"{len(references)} referenced + {pool.num_recycled} recycled pages != {pool.num_created} created"]
                if len(references) + pool.num_recycled != pool.num_created
                else []
            ),
            *([f"{pool.num_created} pages created, over {pool.capacity}"] if pool.num_created > pool.capacity else []),
            *(
                [f"{pool.num_cache_only} pages counted as held by the prefix cache only, not {cache_only}"]
                if pool.num_cache_only != cache_only
                else []
            ),
        ]
        # Page groups move whole (CacheStats counts them by their first page): wherever a page
        # is held, it is in the same group.
        groups = {page: tuple(group) for slot in slots for group in slot.pages for page in group}
        groups.update((page, tuple(group)) for unit in prefix.units() for group in unit.pages for page in group)
        held = [*(g for slot in slots for g in slot.pages), *(g for unit in prefix.units() for g in unit.pages)]
        if any(groups[page] != tuple(group) for group in held for page in group):
            problems.append("a page is held in two different page groups")
        for slot in slots:
            pages = [page for group in slot.pages for page in group]
            if len(pages) != len(set(pages)):
                problems.append(f"slot {slot.index} maps a physical page twice")
            if any(len(group) != cfg.num_buffers for group in slot.pages) or len(slot.origins) != len(slot.pages):
                problems.append(f"slot {slot.index} has a malformed page table")
            if slot.active and not (
                cfg.pages_for(slot.length) <= len(slot.pages) and slot.shared_groups <= len(slot.pages)
            ):
                problems.append(f"slot {slot.index} maps fewer pages than its length or shared prefix")
            writable = slot.pages[slot.shared_groups :] if slot.active and not slot.fresh else []
            if any(pool.refs(page) != 1 for group in writable for page in group):
                problems.append(f"slot {slot.index} may write a shared page")
        if problems:
            raise AssertionError("; ".join(problems))
