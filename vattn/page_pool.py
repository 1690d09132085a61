"""Physical pages: created on first need up to the budget, then recycled."""

from __future__ import annotations

from vattn.backends.base import VMMBackend


class PagePool:
    """Owns every physical page that is mapped nowhere.

    Pages are created lazily (a cache costs nothing physical until it maps), and an
    unmapped page goes back on a LIFO free list: on the host a recycled page is already
    faulted in, several times cheaper to map and touch than a fresh one.
    """

    def __init__(self, backend: VMMBackend, capacity: int) -> None:
        self._backend = backend
        self.capacity = capacity
        self._recycled: list[int] = []
        self._created: list[int] = []
        self.fresh_pages_taken = 0
        self.recycled_pages_taken = 0

    @property
    def num_free(self) -> int:
        """Pages mapped nowhere: recycled ones plus those not created yet."""
        return len(self._recycled) + self.capacity - len(self._created)

    @property
    def num_created(self) -> int:
        return len(self._created)

    def take(self, count: int) -> list[int]:
        if count > self.num_free:
            raise ValueError(f"asked for {count} pages, {self.num_free} free")
        recycled = min(count, len(self._recycled))
        fresh = self._backend.create_pages(count - recycled) if count > recycled else []
        self._created.extend(fresh)  # created first: if creating fails, nothing was taken
        pages = self._recycled[len(self._recycled) - recycled :] + fresh
        del self._recycled[len(self._recycled) - recycled :]
        self.recycled_pages_taken += recycled
        self.fresh_pages_taken += count - recycled
        return pages

    def give_back(self, pages: list[int]) -> None:
        self._recycled.extend(pages)

    def release_all(self) -> None:
        """Frees every created page; all must be unmapped (or their reservations gone)."""
        self._backend.release_pages(self._created)
        self._created.clear()
        self._recycled.clear()
