"""One bound on the physical memory of several caches' pools (several models under one
`--kv-budget`), and the lending of idle pages between them."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

Lender = Callable[[int], int]
"""Frees up to that many bytes of a cache's idle pages if it can do so without waiting;
returns the bytes it gave back."""


class PageBudget:
    """Bytes of physical pages that every pool drawing on it may create together.

    A pool claims a page's bytes before creating it and releases them when it destroys it, so
    the budget bounds what exists, whatever each cache's own capacity. The pages a cache keeps
    mapped for reuse (idle slots', the prefix cache's) still count; when another cache needs
    room, `reclaim` asks the others to lend theirs: each destroys idle pages, in its own reclaim
    order, and never those its running requests map. A lender that is busy (its lock held) is
    skipped rather than waited for, so two caches asking each other at once cannot deadlock;
    the asker then queues as it would on a full pool of its own.
    """

    def __init__(self, limit: int) -> None:
        if limit <= 0:
            raise ValueError(f"a page budget needs a positive number of bytes, not {limit}")
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self._lenders: dict[int, Callable[[], Lender | None]] = {}

    @property
    def used(self) -> int:
        """Bytes of the pages that exist now."""
        with self._lock:
            return self._used

    @property
    def free(self) -> int:
        with self._lock:
            return self.limit - self._used

    def claim(self, nbytes: int) -> bool:
        """Takes `nbytes` for pages about to be created; False (and nothing taken) if they do not fit."""
        with self._lock:
            if self._used + nbytes > self.limit:
                return False
            self._used += nbytes
            return True

    def release(self, nbytes: int) -> None:
        """Gives back the bytes of pages just destroyed."""
        with self._lock:
            if nbytes > self._used:
                raise ValueError(f"releasing {nbytes} bytes, but only {self._used} are claimed")
            self._used -= nbytes

    def join(self, key: int, lender: Lender) -> None:
        """Registers a cache's lender (a bound method, held weakly: a dropped cache leaves)."""
        ref = weakref.WeakMethod(lender) if hasattr(lender, "__self__") else (lambda: lender)
        with self._lock:
            self._lenders[key] = ref

    def leave(self, key: int) -> None:
        with self._lock:
            self._lenders.pop(key, None)

    def reclaim(self, nbytes: int, asker: int) -> int:
        """Asks every other member, in the order they joined, to lend idle pages until `nbytes`
        are freed; returns the bytes freed (possibly fewer, or more by a page's rounding)."""
        with self._lock:
            lenders = [(key, ref) for key, ref in self._lenders.items() if key != asker]
        freed = 0
        for _, ref in lenders:
            if freed >= nbytes:
                break
            if (lender := ref()) is not None:
                freed += lender(nbytes - freed)
        return freed
