"""Physical pages: created on first need up to the budget, then recycled; the one owner of
their reference counts."""

from __future__ import annotations

from collections.abc import Iterable

from vattn.backends.base import VMMBackend


class PagePool:
    """Owns every physical page and counts who references it.

    A page's count is the number of slots that map it plus the prefix-cache entries that
    hold it (as vLLM v1's block pool keeps the refcounts, not its users). A page nobody
    references goes back on a LIFO free list: on the host a recycled page is already
    faulted in, several times cheaper to map and touch than a fresh one. Pages are created
    lazily, so a cache costs nothing physical until it maps.
    """

    def __init__(self, backend: VMMBackend, capacity: int) -> None:
        self._backend = backend
        self.capacity = capacity
        self._recycled: list[int] = []
        self._created: list[int] = []
        self._refs: dict[int, int] = {}
        self.fresh_pages_taken = 0
        self.recycled_pages_taken = 0

    @property
    def num_free(self) -> int:
        """Pages nobody references: recycled ones plus those not created yet."""
        return len(self._recycled) + self.capacity - len(self._created)

    @property
    def num_created(self) -> int:
        return len(self._created)

    def refs(self, page: int) -> int:
        return self._refs.get(page, 0)

    def take(self, count: int) -> list[int]:
        """`count` free pages, each now referenced once."""
        if count > self.num_free:
            raise ValueError(f"asked for {count} pages, {self.num_free} free")
        recycled = min(count, len(self._recycled))
        fresh = self._backend.create_pages(count - recycled) if count > recycled else []
        self._created.extend(fresh)  # created first: if creating fails, nothing was taken
        pages = self._recycled[len(self._recycled) - recycled :] + fresh
        del self._recycled[len(self._recycled) - recycled :]
        self.recycled_pages_taken += recycled
        self.fresh_pages_taken += count - recycled
        for page in pages:
            self._refs[page] = 1
        return pages

    def share(self, pages: Iterable[int]) -> None:
        """One more reference to each of these referenced pages."""
        for page in pages:
            if page not in self._refs:
                raise ValueError(f"page {page} is free: only a referenced page can be shared")
            self._refs[page] += 1

    def give_back(self, pages: Iterable[int]) -> None:
        """Drops one reference to each page; one nobody references any more is free again."""
        for page in pages:
            left = self._refs[page] - 1
            if left:
                self._refs[page] = left
            else:
                del self._refs[page]
                self._recycled.append(page)

    def release_all(self) -> None:
        """Frees every created page; all must be unmapped (or their reservations gone)."""
        self._backend.release_pages(self._created)
        self._created.clear()
        self._recycled.clear()
        self._refs.clear()
