"""Physical pages: created on first need up to the budget, then recycled; the one owner of
their reference counts."""

from __future__ import annotations

from collections.abc import Iterable

from vattn.backends.base import VMMBackend
from vattn.errors import OutOfPagesError
from vattn.page_budget import PageBudget


class PagePool:
    """Owns every physical page and counts who references it.

    A page's count is the number of slots that map it plus the prefix-cache entries that
    hold it (as vLLM v1's block pool keeps the refcounts, not its users); the entries' share
    of it is counted too, so that the pages only the prefix cache holds are known at any
    time (what bounding the cache's footprint needs, see PagePolicy.trim_prefix_cache). A page nobody
    references goes back on a LIFO free list: on the host a recycled page is already
    faulted in, several times cheaper to map and touch than a fresh one. Pages are created
    lazily, so a cache costs nothing physical until it maps (unless `preallocate` made them
    all at start). With a `budget` shared with other pools, a page is created only if its
    bytes fit in what they leave.
    """

    def __init__(
        self, backend: VMMBackend, capacity: int, budget: PageBudget | None = None, page_size: int = 0
    ) -> None:
        if budget is not None and page_size <= 0:
            raise ValueError("a pool on a shared budget needs its page size")
        self._backend = backend
        self.capacity = capacity
        self.budget = budget
        self.page_size = page_size
        self._recycled: list[int] = []
        self._created: list[int] = []
        self._refs: dict[int, int] = {}
        self._cache_refs: dict[int, int] = {}
        """Of a page's references, those of prefix-cache entries."""
        self.num_cache_only = 0
        """Referenced pages all of whose references are prefix-cache entries'."""
        self.fresh_pages_taken = 0
        self.recycled_pages_taken = 0

    @property
    def num_free(self) -> int:
        """Pages nobody references: recycled ones plus those that could be created now."""
        return len(self._recycled) + self.num_creatable

    @property
    def num_recycled(self) -> int:
        return len(self._recycled)

    @property
    def num_creatable(self) -> int:
        """Pages not created yet that this pool's capacity and the shared budget allow."""
        uncreated = self.capacity - len(self._created)
        return min(uncreated, self.budget.free // self.page_size) if self.budget else uncreated

    @property
    def num_created(self) -> int:
        return len(self._created)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def cache_only(self, page: int) -> bool:
        """Whether only prefix-cache entries reference the page (no slot maps it)."""
        refs = self._refs.get(page, 0)
        return refs > 0 and self._cache_refs.get(page, 0) == refs

    def take(self, count: int) -> list[int]:
        """`count` free pages, each now referenced once; OutOfPagesError (nothing taken) if they
        are not free, as when another pool on the budget took its last bytes first."""
        if count > self.num_free:
            raise OutOfPagesError(count, self.num_free)
        recycled = min(count, len(self._recycled))
        fresh = self._create(count - recycled) if count > recycled else []
        self._created.extend(fresh)  # created first: if creating fails, nothing was taken
        pages = self._recycled[len(self._recycled) - recycled :] + fresh
        del self._recycled[len(self._recycled) - recycled :]
        self.recycled_pages_taken += recycled
        self.fresh_pages_taken += count - recycled
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: Iterable[int], by_cache: bool = False) -> None:
        """One more reference to each of these referenced pages (a prefix-cache entry's if `by_cache`)."""
        for page in pages:
            if page not in self._refs:
                raise ValueError(f"page {page} is free: only a referenced page can be shared")
            self._count(page, 1, by_cache)

    def give_back(self, pages: Iterable[int], by_cache: bool = False) -> None:
        """Drops one reference to each page (a prefix-cache entry's if `by_cache`); one nobody
        references any more is free again."""
        for page in pages:
            if not self._count(page, -1, by_cache):
                self._recycled.append(page)

    def _count(self, page: int, delta: int, by_cache: bool) -> int:
        """Adds `delta` to a referenced page's references (and to the cache's among them), keeping
        `num_cache_only`; returns how many are left."""
        refs, cached = self._refs[page], self._cache_refs.get(page, 0)
        was_cache_only = cached == refs
        refs += delta
        cached += delta if by_cache else 0
        for table, count in ((self._refs, refs), (self._cache_refs, cached)):
            if count:
                table[page] = count
            else:
                table.pop(page, None)
        self.num_cache_only += (refs > 0 and cached == refs) - was_cache_only
        return refs

    def _create(self, count: int) -> list[int]:
        nbytes = count * self.page_size
        if self.budget and not self.budget.claim(nbytes):
            raise OutOfPagesError(count, self.num_free)
        try:
            return self._backend.create_pages(count)
        except BaseException:
            if self.budget:
                self.budget.release(nbytes)
            raise

    def preallocate(self) -> int:
        """Creates every page the pool may hold and gives each its memory now (the backend's
        back_pages), all of them free; returns how many."""
        pages = self._create(self.num_creatable)
        self._created.extend(pages)
        self._backend.back_pages(pages)
        self._recycled.extend(pages)
        return len(pages)

    def shrink(self, limit: int | None = None) -> int:
        """Destroys pages nobody references (all, or the `limit` least recently freed), so that
        their memory goes back to the system and to a shared budget; the capacity is unchanged
        (pages are created afresh when next needed). Returns how many."""
        count = len(self._recycled) if limit is None else min(limit, len(self._recycled))
        pages, self._recycled = self._recycled[:count], self._recycled[count:]
        if pages:
            gone = set(pages)
            self._created = [page for page in self._created if page not in gone]
            self._destroy(pages)
        return len(pages)

    def release_all(self) -> None:
        """Frees every created page; all must be unmapped (or their reservations gone)."""
        self._destroy(self._created)
        self._created.clear()
        self._recycled.clear()
        self._refs.clear()
        self._cache_refs.clear()
        self.num_cache_only = 0

    def _destroy(self, pages: list[int]) -> None:
        self._backend.release_pages(pages)
        if self.budget:
            self.budget.release(len(pages) * self.page_size)
