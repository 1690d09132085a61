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

With `record_events`, the cache lists what it stores and drops (`take_events`), as vLLM's
block pool does for its KV events: whole units stored (a run of them per registration),
whole units removed, everything cleared. Partial units (tails) are not announced: a router
that hashes whole blocks could never match them.

The cache holds one reference to each page of each entry (the pool counts them). Entries
are evicted least recently used first; a match refreshes a prefix leaf first, so a
parent always outlives its children and no entry is left unreachable while its parent
could have been evicted instead. The one exception is a cold cache's (`misses_in_a_row`,
see PagePolicy.settle): a reused slot's entries go where they lie, with their children.
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

GHOSTS = 4096
"""Keys of entries a cold cache evicted in place that it remembers (no pages): a prompt that would
have found one warms it again (`PrefixCache.match`), so that chats whose histories went while
it was cold do not keep it cold."""


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
    whole: bool = True
    """A full unit (False: a partial unit, a slot's tail cached when it ended, found only by
    matches that end inside it)."""


@dataclass(frozen=True)
class UnitsStored:
    """Whole units newly cached, each after the one before it."""

    digests: tuple[bytes, ...]
    parent: bytes | None
    """The unit before the first, None when the first begins its prompt."""
    tokens: tuple[int, ...]
    """Every token of the units, in order."""
    unit_tokens: int


@dataclass(frozen=True)
class UnitsRemoved:
    """Whole units evicted."""

    digests: tuple[bytes, ...]


@dataclass(frozen=True)
class CacheCleared:
    """Every entry dropped at once (`evict_prefix_cache`)."""


CacheEvent = UnitsStored | UnitsRemoved | CacheCleared


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

    def __init__(self, pool: PagePool, record_events: bool = False) -> None:
        self._pool = pool
        self._events: list[CacheEvent] | None = [] if record_events else None
        self._units: OrderedDict[bytes, CachedUnit] = OrderedDict()
        self._children: dict[bytes, dict[bytes, None]] = {}
        """Parent digest -> digests of the units cached after it, oldest first (a dict: ties go
        the same way every run)."""
        self.counters = PrefixCounters()
        self.misses_in_a_row = 0
        """Prompts matched since the last one that found anything cached, or would have but for
        an eviction in place (this one included)."""
        self._ghosts: OrderedDict[bytes, None] = OrderedDict()
        """Keys of the entries evicted in place (`ghost_keys`), oldest first, GHOSTS at most."""

    def __len__(self) -> int:
        return len(self._units)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._units

    def get(self, digest: bytes) -> CachedUnit | None:
        return self._units.get(digest)

    def children(self, digest: bytes) -> list[bytes]:
        """The digests of the entries cached after this one."""
        return list(self._children.get(digest, ()))

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

    def longest_partial(self, parent: bytes, following: Sequence[int], fewest: int) -> PartialMatch | None:
        """The unit cached after `parent` whose tokens begin with the longest run of `following`,
        if that run is `fewest` tokens or more (and at least one)."""
        best = None
        for digest in self._children.get(parent, ()):
            unit = self._units[digest]
            common = next((i for i, (a, b) in enumerate(zip(unit.tokens, following, strict=False)) if a != b), None)
            common = min(len(unit.tokens), len(following)) if common is None else common
            if common >= max(fewest, 1) and (best is None or common > best.tokens):
                best = PartialMatch(unit, common)
        return best

    def match(
        self, slot: Slot, tokens: Sequence[int], unit: int, salt: str | None, fewest_partial: int
    ) -> tuple[list[CachedUnit], PartialMatch | None]:
        """The cached units of the longest prefix of a new request's `tokens` (whole units), and
        the longest start of a cached unit, `fewest_partial` tokens or more, that its tokens
        continue with after them (never its last token), all refreshed; sets the slot's root (its
        salt's) and digests of the whole units. Counts `tokens` as queries; the caller counts the
        hits it maps or copies."""
        tokens = token_ids(tokens)
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise ValueError(f"a cache salt is a non-empty string, got {salt!r}")
        slot.root = salted_root(salt)
        digests = unit_digests(tokens, (len(tokens) - 1) // unit, unit, slot.root)
        found = self.longest_prefix(digests)
        parent = digests[len(found) - 1] if found else slot.root
        partial = self.longest_partial(parent, tokens[len(found) * unit : len(tokens) - 1], fewest_partial)
        for cached in [*([partial.unit] if partial else []), *reversed(found)]:  # leaves first: evicted first
            self._units.move_to_end(cached.digest)
        self.counters.queries += len(tokens)
        following = tokens[len(found) * unit : len(tokens) - 1]
        lost = not (found or partial) and self._ghosted(digests[len(found) :], parent, following, fewest_partial)
        self.misses_in_a_row = 0 if found or partial or lost else self.misses_in_a_row + 1
        slot.digests = digests[: len(found)]
        return found, partial

    def register(self, slot: Slot, tokens: Sequence[int], unit: int, groups: int) -> None:
        """Caches the full units of `tokens` (the tokens whose KV the slot holds, from its
        first) that the slot has not cached yet, `groups` page groups each, chaining the slot's
        digests on."""
        done = len(slot.digests)
        new = token_ids(tokens[done * unit : len(tokens) // unit * unit])
        parent = slot.digests[-1] if slot.digests else slot.root
        stored: list[tuple[bytes, list[int]]] = []  # the run of units cached anew, announced together
        for index, digest in enumerate(unit_digests(new, len(new) // unit, unit, parent), done):
            unit_tokens = new[(index - done) * unit : (index - done + 1) * unit]
            if self.insert(digest, slot.pages[index * groups : (index + 1) * groups], parent, unit_tokens):
                stored.append((digest, unit_tokens))
            else:
                self._announce(stored, index, unit)
            slot.digests.append(digest)
            parent = digest
        self._announce(stored, len(slot.digests), unit)

    def remember(self, slot: Slot, tokens: Sequence[int], unit: int, groups: int) -> None:
        """A running request holds the KV of `tokens` (from its first): its full units not yet
        cached are cached (`register`), their pages shared from now on, and the tokens after
        them kept as the slot's tail, cached as a partial unit when it ends (`release`)."""
        if len(tokens) // unit > len(slot.digests):
            self.register(slot, tokens, unit, groups)
            slot.share(len(slot.digests) * groups)
        slot.tail = token_ids(tokens[len(slot.digests) * unit :])

    def forget_past(self, slot: Slot, length: int, unit: int) -> None:
        """The slot now holds `length` tokens: tail tokens past it lost their KV."""
        del slot.tail[max(0, length - len(slot.digests) * unit) :]

    def release(self, slot: Slot, groups: int, tail_groups: int) -> None:
        """An ending request's tail (the tokens after its last whole unit, in its first
        `tail_groups` page groups after them) is cached as a partial unit, found only by matches
        that end inside it; nothing without one."""
        if not slot.tail:
            return
        first = len(slot.digests) * groups
        parent = slot.digests[-1] if slot.digests else slot.root
        pages = slot.pages[first : first + tail_groups]
        digest = chain_digest(parent, slot.tail)
        self.insert(digest, pages, parent, slot.tail, whole=False)
        slot.digests.append(digest)

    def insert(
        self, digest: bytes, pages: list[list[int]], parent: bytes, tokens: Sequence[int], whole: bool = True
    ) -> bool:
        """Keeps a unit's pages under its digest (one reference each), listed after its parent;
        a digest already cached keeps its pages (the same KV). Whether it was new."""
        if digest in self._units:
            self._units.move_to_end(digest)
            return False
        self._pool.share((page for group in pages for page in group), by_cache=True)
        self._units[digest] = CachedUnit(digest, [list(group) for group in pages], parent, tuple(tokens), whole)
        self._children.setdefault(parent, {})[digest] = None
        return True

    def evict(self, unit: CachedUnit) -> None:
        """Drops an entry and its references (pages no slot maps become free)."""
        self._drop(unit)
        if self._events is not None and unit.whole:
            self._events.append(UnitsRemoved((unit.digest,)))

    def evict_in_place(self, unit: CachedUnit, fewest_partial: int) -> None:
        """Evicts an entry whose pages the slot that mapped them keeps as its own, remembering its
        keys as a ghost (`ghost_keys`)."""
        self.evict(unit)
        for key in ghost_keys(unit, fewest_partial):
            self._ghosts[key] = None
            self._ghosts.move_to_end(key)
        while len(self._ghosts) > GHOSTS:
            self._ghosts.popitem(last=False)

    def _ghosted(self, digests: Sequence[bytes], parent: bytes, following: Sequence[int], fewest: int) -> bool:
        """Whether a prompt would have found an entry evicted in place: one of its whole units
        (`digests`, after `parent`), or the first `fewest` tokens of a unit after `parent`."""
        if not self._ghosts:
            return False
        start = max(fewest, 1)
        if len(following) >= start and chain_digest(parent, following[:start]) in self._ghosts:
            return True
        return any(digest in self._ghosts for digest in digests)

    def clear(self) -> None:
        for unit in self.units():
            self._drop(unit)
        if self._events is not None:
            self._events.append(CacheCleared())

    def take_events(self) -> list[CacheEvent]:
        """What was stored and removed since the last call, in order (none unless recording)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def _drop(self, unit: CachedUnit) -> None:
        del self._units[unit.digest]
        siblings = self._children[unit.parent]
        del siblings[unit.digest]
        if not siblings:
            del self._children[unit.parent]
        self.counters.evictions += 1
        self._pool.give_back((page for group in unit.pages for page in group), by_cache=True)

    def _announce(self, stored: list[tuple[bytes, list[int]]], end: int, unit: int) -> None:
        """Records the run `stored` of units cached anew, which ends before unit `end` of its prompt,
        and empties it."""
        if self._events is not None and stored:
            first = end - len(stored)
            parent = self._units[stored[0][0]].parent if first else None
            tokens = tuple(token for _, unit_tokens in stored for token in unit_tokens)
            self._events.append(UnitsStored(tuple(digest for digest, _ in stored), parent, tokens, unit))
        stored.clear()


def ghost_keys(unit: CachedUnit, fewest_partial: int) -> list[bytes]:
    """What a prompt that would have found `unit` computes: its digest (a whole unit), and the
    digest of its first `fewest_partial` tokens after its parent (the least a match copies)."""
    start = max(fewest_partial, 1)
    keys = [unit.digest] if unit.whole else []
    if len(unit.tokens) >= start:
        keys.append(chain_digest(unit.parent, unit.tokens[:start]))
    return keys


def token_ids(tokens: Sequence[int]) -> list[int]:
    """`tokens` as a list, checked: a running request's are checked at every step, so plain ints
    are checked at C speed (type set, minimum) and only anything else one by one."""
    ids = list(tokens)
    plain = not ids or (set(map(type, ids)) == {int} and min(ids) >= 0)
    if not plain and not all(is_int(t) and t >= 0 for t in ids):
        raise ValueError("tokens must be non-negative integers (token ids)")
    return ids


def unit_digests(tokens: Sequence[int], units: int, unit: int, parent: bytes = ROOT) -> list[bytes]:
    """The chained prefix-cache keys of the first `units` units of `tokens`."""
    digests = []
    for index in range(units):
        parent = chain_digest(parent, tokens[index * unit : (index + 1) * unit])
        digests.append(parent)
    return digests
