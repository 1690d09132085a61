"""The vAttention KV cache: virtually contiguous per-request KV, physical pages on demand."""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Mapping, Sequence

from vattn.backends import VMMBackend, make_backend
from vattn.cache_access import CacheAccess
from vattn.config import KVCacheConfig
from vattn.errors import OutOfPagesError, OutOfSlotsError
from vattn.mapper import BackgroundMapper
from vattn.memory import CacheMemory
from vattn.page_budget import PageBudget
from vattn.page_policy import PagePolicy
from vattn.page_pool import PagePool
from vattn.prefix_cache import CacheEvent, PrefixCache
from vattn.slot import Slot
from vattn.slot_pages import SlotPages
from vattn.stats import CacheStats, MappingCounters
from vattn.validate import exact_int


class KVCache(CacheAccess):
    """Per-request KV tensors in reserved address space, backed page by page.

    A reqid, as the paper calls it, is the index of a request slot: row `reqid` of every
    virtual tensor, handed out by `alloc_reqid` and given back by `free_reqid`.
    `step(seq_lens)` makes every listed request's pages present before the model runs; a
    background thread maps the next token's pages while the model computes, freed slots
    keep their pages for the next request, and the slot handed out next is pre-mapped.

    Views follow torch's storage rule (see vattn.memory): memory a live view can reach is
    never unmapped, never handed to another request and never reused by another cache,
    whatever is called meanwhile (free_reqid, step, release_idle, close, fork).

    Several caches (of any shapes) can share one `PageBudget`: together they never hold more
    than its bytes of pages, and one that needs pages takes the idle ones of the others (see
    PageBudget).
    """

    def __init__(self, config: KVCacheConfig, budget: PageBudget | None = None) -> None:
        self.config = config
        self.backend: VMMBackend = make_backend(config)
        self._slots = [Slot(i) for i in range(config.max_slots)]
        self._pool = PagePool(self.backend, config.pool_pages, budget, config.page_size)
        if config.preallocate and budget is None:
            try:
                self._pool.preallocate()
            except BaseException:
                self.backend.close()
                raise
        self._prefix = PrefixCache(self._pool, config.record_events)
        memory = CacheMemory(config, self.backend, self._slots, self._pool)
        kernels_lease, self._layers, self._qparams = memory.open()
        """Each layer's K and V virtual tensors, for the kernels (`layer_tensors`)."""
        self._memory: CacheMemory | None = memory
        """Held while open; afterwards only views hold it (see close)."""
        self._kernels_lease = weakref.ref(kernels_lease)
        self.device = self._layers[0][0].device
        self._lock = threading.Lock()
        self._counters = MappingCounters()
        self._pages = SlotPages(
            config, self.backend, self._pool, memory.bases, memory.scratch, memory.stranded, self._counters
        )
        self._budget = budget
        borrow = self._borrow if budget else None
        self._policy = PagePolicy(config, self._slots, self._pool, self._prefix, self._pages, borrow)
        self._closed = False
        if budget:
            budget.join(id(self), self._lend)
        self._mapper = BackgroundMapper(weakref.WeakMethod(self._work_ahead)) if config.background else None
        self._stop_mapper = weakref.finalize(self, self._mapper.close) if self._mapper else None
        _LIVE_CACHES.add(self)
        self._wake_mapper()

    # ---------------------------------------------------------------- requests

    def alloc_reqid(self) -> int:
        """Hands out a free slot, preferring one that still has pages mapped (never one that a
        live view of its last request can still reach)."""
        with self._lock:
            self._check_open()
            slot = self._policy.next_free_slot()
            if slot is None:
                held = sum(not s.active and s.pinned() for s in self._slots)
                raise OutOfSlotsError(self.config.max_slots, held)
            slot.begin()
        self._wake_mapper()
        return slot.index

    def free_reqid(self, reqid: int) -> None:
        """Ends a request; its pages stay mapped for the slot's next request."""
        with self._lock:
            self._check_open()
            slot = self._active_slot(reqid)
            if self.config.prefix_match == "token":
                self._prefix.release(slot, self.config.unit_groups, self.config.pages_for(len(slot.tail)))
            slot.end()
        self._wake_mapper()

    def step(self, seq_lens: Mapping[int, int]) -> None:
        """Makes sure each listed request has pages for its length before an iteration.

        All or nothing: if the pages cannot be found, raises `OutOfPagesError` and no
        slot changes, so the caller can preempt a request and try again.
        """
        with self._lock:
            self._check_open()
            self._policy.grow(self._validated_lengths(seq_lens))
        self._wake_mapper()

    # ---------------------------------------------------------------- sharing

    def match_prefix(self, reqid: int, tokens: Sequence[int], salt: str | None = None) -> int:
        """Gives a new request the KV of the longest cached prefix of its `tokens` instead of
        computing it; returns how many tokens that is (always leaving the last one to compute),
        now its length. Whole cached units are mapped behind it (shared, never copied); where
        its prompt goes on to match the start of a cached unit, that many tokens' KV is copied
        into pages of its own (skipped, those tokens left to compute, if no pages are free).

        With a `salt` (vLLM's `cache_salt`) only units cached by requests with the same salt
        match, and the request's own units are cached under it. Counts `tokens` as
        prefix-cache queries and the tokens found as hits."""
        with self._lock:
            self._check_open()
            slot = self._active_slot(reqid)
            if slot.length or slot.shared_groups:
                raise ValueError(f"reqid {slot.index} already holds tokens: match_prefix comes before its first step")
            cfg = self.config
            found = self._prefix.match(slot, tokens, cfg.unit_tokens, salt, cfg.prefix_copy_min_tokens)
            self._policy.adopt_prefix(slot, *found)
        self._wake_mapper()
        return slot.length

    def cache_prefix(self, reqid: int, tokens: Sequence[int]) -> None:
        """Makes a request's full units findable by later requests: `tokens` are the tokens
        whose KV it holds, from its first (at most its length). Its pages there are shared
        from now on: never written again while it lives, kept after it ends until evicted.
        When it ends (`free_reqid`), the tokens after its last full unit that it was last
        given are cached too, as a partial unit that later prompts can match into."""
        with self._lock:
            self._check_open()
            slot = self._active_slot(reqid)
            if len(tokens) > slot.length:
                raise ValueError(f"reqid {slot.index} holds {slot.length} tokens, not {len(tokens)}")
            self._prefix.remember(slot, tokens, self.config.unit_tokens, self.config.unit_groups)

    def fork_reqid(self, reqid: int) -> int:
        """A new request holding the same KV as `reqid` (parallel sampling, beam search): its
        whole pages mapped behind the new slot too, only the last partial page copied.

        Both requests append after the fork, so neither writes a shared page. All or
        nothing: OutOfSlotsError or OutOfPagesError with no request changed."""
        cfg = self.config
        with self._lock:
            self._check_open()
            parent = self._active_slot(reqid)
            child = self._policy.next_free_slot()
            if child is None:
                raise OutOfSlotsError(cfg.max_slots, sum(not s.active and s.pinned() for s in self._slots))
            shared = self._policy.fork(parent, child)
            self._policy.trim_prefix_cache()
            child.adopt(parent, shared)
        self._wake_mapper()
        return child.index

    def shared_lengths(self, reqids: Sequence[int]) -> list[int]:
        """Tokens at the start of each request that lie in shared pages: kernels never write
        there (a request may append only after them)."""
        with self._lock:
            self._check_open()
            return [self._frozen_tokens(self._active_slot(reqid)) for reqid in reqids]

    def prefix_digests(self) -> list[bytes]:
        """The digests of the whole units the prefix cache holds, least recently used first."""
        with self._lock:
            return [unit.digest for unit in self._prefix.units() if unit.whole]

    def take_events(self) -> list[CacheEvent]:
        """The prefix cache's stores, removals and clears since the last call, oldest first
        (`KVCacheConfig.record_events`; otherwise none)."""
        with self._lock:
            return self._prefix.take_events()

    def evict_prefix_cache(self) -> None:
        """Drops every prefix-cache entry (pages no slot maps become free)."""
        with self._lock:
            self._check_open()
            self._prefix.clear()

    # ---------------------------------------------------------------- admission

    def num_free_slots(self) -> int:
        """Slots alloc_reqid can hand out (freed ones that live views hold are not)."""
        with self._lock:
            return sum(not slot.active and not slot.pinned() for slot in self._slots)

    def num_free_pages(self) -> int:
        """Physical pages mapped nowhere (idle slots' pages are not counted)."""
        with self._lock:
            return self._pool.num_free

    def can_admit(self, num_tokens: int, growing: Mapping[int, int] | None = None) -> bool:
        """Whether a new request of `num_tokens` could get a reqid and be stepped now, while the
        active reqids in `growing` grow to those lengths as well (what a scheduler reserves)."""
        cfg = self.config
        num_tokens = exact_int(num_tokens, "num_tokens", 0, cfg.max_context)
        with self._lock:
            self._check_open()
            slot = self._policy.next_free_slot()
            if slot is None:
                return False
            targets = [(slot, num_tokens), *self._validated_lengths(growing or {})]
            missing = sum(max(0, cfg.pages_for(n) - len(s.pages)) for s, n in targets) * cfg.num_buffers
            return missing <= self._policy.borrowed_available(missing, {s.index: len(s.pages) for s, _ in targets})

    # ---------------------------------------------------------------- reporting, lifetime

    def stats(self) -> CacheStats:
        with self._lock:
            errors = self._mapper.errors if self._mapper else 0
            return CacheStats.of(self.config, self._slots, self._pool, self._prefix, self._counters, errors)

    def release_idle(self) -> None:
        """Unmaps every idle slot's pages back into the pool (deferred reclamation, now), but
        those of slots that live views still hold."""
        with self._lock:
            self._check_open()
            if self._policy.unmap_idle():
                self._policy.trim_prefix_cache()

    def release_memory(self) -> int:
        """Gives back to the system every page no running request maps (what vLLM's sleep does
        to its KV cache): the prefix cache's entries go, idle slots' pages are unmapped, and the
        free pages are destroyed. The address space stays reserved, so the cache maps pages on
        demand again as requests come. Pages that live views hold stay. Returns bytes released."""
        self.wait_for_background()  # no pre-mapping in flight
        with self._lock:
            self._check_open()
            self._prefix.clear()
            self._policy.unmap_idle()
            return self._pool.shrink() * self.config.page_size

    def check_invariants(self) -> dict[int, int]:
        """Raises AssertionError unless every page's references, and every slot's pages, are
        consistent (see SlotPages.check_invariants) and the prefix cache holds no more pages
        alone than its share; returns each active reqid's length."""
        with self._lock:
            self._pages.check_invariants(self._slots, self._prefix)
            limit = self.config.prefix_cache_pages
            if self._pool.num_cache_only > limit:
                raise AssertionError(f"the prefix cache alone holds {self._pool.num_cache_only} pages, over {limit}")
            return {slot.index: slot.length for slot in self._slots if slot.active}

    def wait_for_background(self, timeout: float | None = None) -> bool:
        """Blocks until the background thread has nothing left to map; False on timeout."""
        return self._mapper.wait_idle(timeout) if self._mapper else True

    def close(self) -> None:
        """Stops the background thread and frees all address space and physical pages, now if
        no view lives, otherwise as soon as the last one dies (views stay valid till then).
        A cache that is dropped without close() is freed the same way by the garbage collector."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        if self._budget:
            self._budget.leave(id(self))
        if self._stop_mapper:
            self._stop_mapper()
        self._layers.clear()
        self._qparams.clear()
        memory, self._memory = self._memory, None
        if memory and self._kernels_lease() is None and not any(slot.pinned() for slot in self._slots):
            memory.release()  # here, so that errors reach the caller

    def __enter__(self) -> KVCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- internals

    def _borrow(self, pages: int) -> None:
        """Asks the budget's other caches for `pages` of this cache's pages' bytes (lock held)."""
        assert self._budget is not None
        self._budget.reclaim(pages * self.config.page_size, id(self))

    def _lend(self, nbytes: int) -> int:
        """Gives back up to `nbytes` (rounded up to pages) of idle pages to the shared budget,
        unless this cache is busy: another cache asks while holding its own lock, and waiting
        here could deadlock. Returns the bytes given back."""
        if not self._lock.acquire(blocking=False):
            return 0
        try:
            if self._closed:
                return 0
            pages = -(-nbytes // self.config.page_size)
            return self._policy.lend(pages) * self.config.page_size
        finally:
            self._lock.release()

    def _validated_lengths(self, seq_lens: Mapping[int, int]) -> list[tuple[Slot, int]]:
        if not isinstance(seq_lens, Mapping):
            raise ValueError(f"seq_lens must map reqid -> length, got {type(seq_lens).__name__}")
        targets: dict[int, tuple[Slot, int]] = {}
        for reqid, length in seq_lens.items():
            slot = self._active_slot(reqid)
            if slot.index in targets:
                raise ValueError(f"reqid {slot.index} is listed twice")
            frozen = self._frozen_tokens(slot)
            limits = "max_context" if not frozen else "its shared prefix's tokens to max_context"
            name = f"length of reqid {slot.index} ({limits})"
            targets[slot.index] = (slot, exact_int(length, name, frozen, self.config.max_context))
        return list(targets.values())

    def _frozen_tokens(self, slot: Slot) -> int:
        """The first token that lies wholly after the slot's shared page groups."""
        return -(-slot.shared_groups * self.config.page_size // self.config.bytes_per_token)

    def _after_fork_in_child(self) -> None:
        """The parent's threads are gone from this copy, and locks they held would stay held."""
        self._lock = threading.Lock()
        if self._mapper:
            self._mapper.after_fork_in_child()

    def _wake_mapper(self) -> None:
        if self._mapper:
            self._mapper.wake()

    def _work_ahead(self) -> bool:
        """One batch of background work; False when there is nothing left to do."""
        with self._lock:
            if self._closed:
                return False
            try:
                addrs = self._policy.background_batch()
            except OutOfPagesError:  # another cache on the budget took the pages first
                return False
        if addrs is None:
            return False
        if addrs:  # outside the lock: a page unmapped meanwhile just ends the batch early
            done = self._pages.populate(addrs)
            with self._lock:
                self._counters.populate.add(*done)
        return True


_LIVE_CACHES: weakref.WeakSet[KVCache] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    for cache in list(_LIVE_CACHES):
        cache._after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)
