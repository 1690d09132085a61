"""One request slot: a row of every virtual tensor and the pages mapped behind it."""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vattn.backends.base import Fence


class Origin(Enum):
    """Who mapped a page group, so stats can say whether a need was met ahead of step()."""

    STEP = "step"
    BACKGROUND = "background"
    REUSED = "reused"
    SHARED = "shared"
    """Mapped from the prefix cache or a forked request."""


@dataclass
class Slot:
    """Row `index` of every virtual tensor (the reqid of the request it holds).

    `pages[k][b]` is the physical page behind page k of virtual tensor b; pages always
    form a prefix of the slot, so its first `len(pages)` page groups are mapped.
    """

    index: int
    active: bool = False
    length: int = 0
    """Tokens the last step() guaranteed; views of the slot stop here."""
    pages: list[list[int]] = field(default_factory=list)
    origins: list[Origin] = field(default_factory=list)
    fresh: bool = False
    """Handed out, not yet stepped or matched: the pages it kept from its last request are still
    mapped, shared ones too, until `match_prefix` keeps those the new prompt shares or the
    first step drops them (never written while it is fresh)."""
    shared_groups: int = 0
    """Leading page groups that other slots or the prefix cache may also map: this request
    never writes them again (its length cannot go back below them)."""
    digests: list[bytes] = field(default_factory=list)
    """Prefix-cache keys of this request's first units (vattn.prefix_cache), in order; once it
    ends, its partial tail's after them."""
    left_units: list[bytes] = field(default_factory=list)
    """The keys `digests` held when its last request ended: the prefix-cache entries that may
    still hold the pages it keeps mapped (PagePolicy.settle)."""
    root: bytes = b""
    """The key its first unit's digest chains from (its cache salt's, vattn.prefix_cache)."""
    tail: list[int] = field(default_factory=list)
    """The tokens after its last whole cached unit that `cache_prefix` was last given: cached
    as a partial unit when the request ends (its pages are written no more then)."""
    leases: set[weakref.ref[Any]] = field(default_factory=set)
    """Live leases of tensors (or attention batches) that can reach this slot; each one's
    weak reference takes itself out when the lease dies (see vattn.memory)."""

    fences: dict[int, Fence] = field(default_factory=dict)
    """Per stream, the fence after the latest GPU work known to use the slot's pages (recorded as
    a lease on it dies, or after a copy from or into it): unmapping them waits for these."""

    def begin(self) -> None:
        """Handed to a new request: no tokens yet, its last request's pages still mapped (fresh)."""
        self.active, self.length, self.fresh = True, 0, True

    def end(self) -> None:
        """Its request ended: no tokens, nothing shared or cached by it; its pages stay mapped
        (deferred reclamation), now for its next request."""
        self.active, self.length, self.fresh, self.shared_groups = False, 0, False, 0
        self.left_units, self.digests, self.root, self.tail = self.digests, [], b"", []
        self.origins = [Origin.REUSED] * len(self.pages)

    def adopt(self, parent: Slot, shared_groups: int) -> None:
        """A fork of `parent`: its tokens and cached units, the first `shared_groups` page groups
        mapped behind both (neither writes them again)."""
        parent.share(shared_groups)
        self.active, self.length, self.shared_groups = True, parent.length, shared_groups
        self.digests, self.root = list(parent.digests), parent.root

    def share(self, groups: int) -> None:
        """Its first `groups` page groups may be mapped elsewhere too: never written again."""
        self.shared_groups = max(self.shared_groups, groups)

    def add_fence(self, fence: Fence | None) -> None:
        """Keeps `fence` in place of the stream's earlier one, which it covers (in any thread:
        one dict store, atomic)."""
        if fence is not None:
            self.fences[fence.stream] = fence

    def pinned(self) -> bool:
        """Whether a live lease can reach the slot: then none of its pages may be unmapped,
        and once freed it is not handed out again until the lease dies."""
        return bool(self.leases)
