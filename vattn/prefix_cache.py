"""Finished and running requests' KV pages, findable by the tokens they hold.

A request's KV is cut into units of `KVCacheConfig.unit_tokens` tokens (whole page groups
whose ends are also token ends, see there). A full unit is keyed by a digest chained over
every token up to its end, as vLLM's block hashes are: the KV of a token depends on all
the tokens before it, so equal digests mean equal KV. A flat table of chained digests
(rather than SGLang's radix tree) finds a prefix with one lookup per unit and evicts one
unit at a time.

Matching is at token granularity all the same: each unit keeps its tokens and is listed
under its parent's digest, so after the last whole unit a new request shares, the units
cached after that parent are compared token by token with what follows in its prompt, and
the longest common run is copied out of the best one (the unit's pages stay shared, the
copy is the request's own). vLLM matches whole 16-token blocks only; SGLang's radix tree
matches single tokens but walks a node per divergence. Here a prefix costs one lookup per
unit plus one comparison inside the last, and only the part of a unit that differs is
computed again.

The cache holds one reference to each page of each entry (the pool counts them). Entries
are evicted least recently used first; a match refreshes a prefix leaf first, so a
parent always outlives its children and no entry is left unreachable while its parent
could have been evicted instead.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from vattn.page_pool import PagePool
from vattn.slot import Slot
from vattn.validate import is_int

ROOT = b""
"""The digest before the first unit."""


def salted_root(salt: str | None) -> bytes:
    """The digest before the first unit of a request with `salt` (vLLM's `cache_salt`): requests
    with different salts never find each other's units, as tenants must not."""
    if salt is None:
        return ROOT
    return hashlib.blake2b(b"cache_salt\0" + salt.encode(errors="surrogatepass"), digest_size=16).digest()


def chain_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a unit: its tokens after its parent's key (blake2b, 128 bits: a collision
    would hand one request another's KV, so no 64-bit Python hash)."""
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


@dataclass
class CachedUnit:
    digest: bytes
    pages: list[list[int]]
    """The unit's page groups, each one page per virtual tensor."""
    parent: bytes = ROOT
    """The digest before it (its salt's root for a first unit)."""
    tokens: tuple[int, ...] = ()
    """Its tokens, for matches that end inside it."""


@dataclass(frozen=True)
class PartialMatch:
    """The first `tokens` tokens of a cached unit that a new request's prompt continues with."""

    unit: CachedUnit
    tokens: int


@dataclass
class PrefixCounters:
    """vLLM's prefix-cache metrics, in tokens."""

    queries: int = 0
    """Prompt tokens looked up."""
    hits: int = 0
    """... found cached (mapped instead of computed)."""
    evictions: int = 0
    """Units dropped to free their pages (or by `evict_prefix_cache`)."""


class PrefixCache:
    """Digest -> cached unit, in least-recently-used order; see the module docstring."""

    def __init__(self, pool: PagePool) -> None:
        self._pool = pool
        self._units: OrderedDict[bytes, CachedUnit] = OrderedDict()
        self._children: dict[bytes, dict[bytes, None]] = {}
        """Parent digest -> digests of the units cached after it, oldest first (a dict: ties go
        the same way every run)."""
        self.counters = PrefixCounters()

    def __len__(self) -> int:
        return len(self._units)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._units

    def units(self) -> list[CachedUnit]:
        """Every entry, least recently used first."""
        return list(self._units.values())

    def longest_prefix(self, digests: Sequence[bytes]) -> list[CachedUnit]:
        """The cached units of the longest run of `digests` from the first (not refreshed)."""
        found = []
        for digest in digests:
            unit = self._units.get(digest)
            if unit is None:
                break
            found.append(unit)
        return found

    def longest_partial(self, parent: bytes, following: Sequence[int]) -> PartialMatch | None:
        """The unit cached after `parent` whose tokens begin with the longest run of `following`."""
        best = None
        for digest in self._children.get(parent, ()):
            unit = self._units[digest]
            common = next((i for i, (a, b) in enumerate(zip(unit.tokens, following, strict=False)) if a != b), None)
            common = min(len(unit.tokens), len(following)) if common is None else common
            if common and (best is None or common > best.tokens):
                best = PartialMatch(unit, common)
        return best

    def match(
        self, slot: Slot, tokens: Sequence[int], unit: int, salt: str | None
    ) -> tuple[list[CachedUnit], PartialMatch | None]:
        """The cached units of the longest prefix of a new request's `tokens` (whole units), and
        the longest start of a cached unit that its tokens continue with after them (never its
        last token), all refreshed; sets the slot's root (its salt's) and digests of the whole
        units. Counts `tokens` as queries; the caller counts the hits it maps or copies."""
        tokens = token_ids(tokens)
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"a cache salt is a non-empty string, got {salt!r}")
        slot.root = salted_root(salt)
        digests = unit_digests(tokens, (len(tokens) - 1) // unit, unit, slot.root)
        found = self.longest_prefix(digests)
        parent = digests[len(found) - 1] if found else slot.root
        partial = self.longest_partial(parent, tokens[len(found) * unit : len(tokens) - 1])
        for cached in [*([partial.unit] if partial else []), *reversed(found)]:  # leaves first: evicted first
            self._units.move_to_end(cached.digest)
        self.counters.queries += len(tokens)
        slot.digests = digests[: len(found)]
        return found, partial

    def register(self, slot: Slot, tokens: Sequence[int], unit: int, groups: int) -> None:
        """Caches the full units of `tokens` (the tokens whose KV the slot holds, from its
        first) that the slot has not cached yet, `groups` page groups each, chaining the slot's
        digests on."""
        done = len(slot.digests)
        new = token_ids(tokens[done * unit : len(tokens) // unit * unit])
        parent = slot.digests[-1] if slot.digests else slot.root
        for index, digest in enumerate(unit_digests(new, len(new) // unit, unit, parent), done):
            unit_tokens = new[(index - done) * unit : (index - done + 1) * unit]
            self.insert(digest, slot.pages[index * groups : (index + 1) * groups], parent, unit_tokens)
            slot.digests.append(digest)
            parent = digest

    def register_tail(self, slot: Slot, groups: int, tail_groups: int) -> None:
        """Caches the tokens of an ending request after its last whole unit (`slot.tail`, in its
        first `tail_groups` page groups after them) as a partial unit, found only by matches
        that end inside it."""
        first = len(slot.digests) * groups
        parent = slot.digests[-1] if slot.digests else slot.root
        self.insert(chain_digest(parent, slot.tail), slot.pages[first : first + tail_groups], parent, slot.tail)

    def insert(self, digest: bytes, pages: list[list[int]], parent: bytes, tokens: Sequence[int]) -> None:
        """Keeps a full unit's pages under its digest (one reference each), listed after its
        parent; a digest already cached keeps its pages (the same KV)."""
        if digest in self._units:
            self._units.move_to_end(digest)
            return
        self._pool.share((page for group in pages for page in group), by_cache=True)
        self._units[digest] = CachedUnit(digest, [list(group) for group in pages], parent, tuple(tokens))
        self._children.setdefault(parent, {})[digest] = None

    def evict(self, unit: CachedUnit) -> None:
        """Drops an entry and its references (pages no slot maps become free)."""
        del self._units[unit.digest]
        siblings = self._children[unit.parent]
        del siblings[unit.digest]
        if not siblings:
            del self._children[unit.parent]
        self.counters.evictions += 1
        self._pool.give_back((page for group in unit.pages for page in group), by_cache=True)

    def clear(self) -> None:
        for unit in self.units():
            self.evict(unit)


def token_ids(tokens: Sequence[int]) -> list[int]:
    ids = list(tokens)
    if not all(is_int(t) and t >= 0 for t in ids):
        raise ValueError("tokens must be non-negative integers (token ids)")
    return ids


def unit_digests(tokens: Sequence[int], units: int, unit: int, parent: bytes = ROOT) -> list[bytes]:
    """The chained prefix-cache keys of the first `units` units of `tokens`."""
    digests = []
    for index in range(units):
        parent = chain_digest(parent, tokens[index * unit : (index + 1) * unit])
        digests.append(parent)
    return digests
