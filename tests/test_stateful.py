"""Random alloc / step / free sequences with the background thread running, invariants after each.

Kept views, close() and fork() interleave with them: a view always reads what its own
request wrote, whatever happened to the request, the cache or a forked child since. Page
sharing joins in (prefix-cache matches, cached prefixes, forked requests, eviction): every
page's reference count is the slots and cache entries that map it, and a request reads
exactly the KV of its own tokens.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests.fuzz import FUZZING
from tests.fuzz import examples as fuzz_examples
from vattn import KVCache, KVCacheConfig, OutOfPagesError, OutOfSlotsError

MAX_SLOTS, LAYERS = 6, 3
operations = 0


def choose(data: st.DataObject, items: list[Any]) -> Any:
    """One of `items`, drawn the same way however many there are: how many requests live can
    depend on the background thread's timing (a fork out of pages), and hypothesis replays
    only draws that do not depend on it."""
    return items[data.draw(st.integers(0, 1 << 16)) % len(items)]


def kv_value(ids: tuple[int, ...]) -> float:
    """The value a request stores at the last position of `ids`: a function of the whole
    prefix, as a model's KV is (requests with equal prefixes store equal values)."""
    return float(hash(ids) % 1_000_003)


def stored(tokens: torch.Tensor, layer: int, quantized: bool) -> tuple[torch.Tensor, ...]:
    """What a request stores in `layer` for KV values `tokens`: one value per K and V row, or in
    an int8 cache a small int8 per row and its K and V qparams (the values themselves)."""
    keys, values = tokens + layer, -tokens - layer
    if not quantized:
        return keys, values
    return (keys % 251 - 125).to(torch.int8), (values % 251 - 125).to(torch.int8), keys, values


def write(cache: KVCache, layer: int, reqid: int, start: int, tokens: torch.Tensor) -> None:
    """Stores `tokens[start:]` at positions `start:` of the request's K and V (and qparams)."""
    views = cache.kv(layer, reqid)
    if cache.config.quantized:
        views += cache.kv_qparams(layer, reqid)
    for view, part in zip(views, stored(tokens[start:], layer, cache.config.quantized), strict=True):
        view[start:] = part.view(-1, *[1] * (view.dim() - 1))


def assert_holds(views: tuple[torch.Tensor, ...], tokens: torch.Tensor, layer: int) -> None:
    """K and V views (then scale views, for an int8 cache) read exactly what `tokens` stored."""
    for view, part in zip(views, stored(tokens, layer, len(views) == 4), strict=True):
        assert torch.equal(view, part.view(-1, *[1] * (view.dim() - 1)).expand_as(view))


@dataclass
class Generation:
    """One request's token ids and the values it stored; frozen when it is freed (or its cache closed)."""

    tokens: torch.Tensor
    ids: list[int] = field(default_factory=list)

    def grown(self, ids: list[int], device: torch.device) -> Generation:
        """This generation's first len(tokens) positions kept, then `ids` appended."""
        kept = self.ids[: len(self.tokens)]
        full = kept + ids
        new = torch.tensor([kv_value(tuple(full[: i + 1])) for i in range(len(kept), len(full))], device=device)
        return Generation(torch.cat([self.tokens[: len(kept)], new]), full)


@dataclass
class KeptView:
    cache: KVCache
    reqid: int
    generation: Generation
    layer: int
    views: tuple[torch.Tensor, ...]
    """K and V (then their qparams, for an int8 cache)."""
    written: torch.Tensor = field(init=False)
    """What the request had written at each position when the view was taken."""

    def __post_init__(self) -> None:
        self.written = self.generation.tokens[: len(self.views[0])].clone()


class CacheMachine(RuleBasedStateMachine):
    """The model: each live request's length and the token values written to it.

    The class attributes pick the backend and a geometry where a page holds 32 tokens.
    """

    backend, page_size, kv_heads, head_dim, max_context = "host", 4096, 2, 16, 200

    def __init__(self) -> None:
        super().__init__()
        self.cache: KVCache | None = None
        self.config: KVCacheConfig | None = None
        self.generations: dict[int, Generation] = {}
        self.views: list[KeptView] = []
        self.prompts: list[list[int]] = []
        """Token ids of cached prefixes, for later prompts to begin with."""

    @initialize(
        layout=st.sampled_from(["per_layer", "mega"]),
        native=st.booleans(),
        budget_steps=st.integers(8, 40),
        dtype=st.sampled_from(["float32", "int8"]),
        prefix_cache_share=st.sampled_from([0.0, 0.25, 1.0]),
        prefix_cold_after=st.sampled_from([32, 0, 2]),
    )
    def open_cache(
        self,
        layout: str,
        native: bool,
        budget_steps: int,
        dtype: str,
        prefix_cache_share: float,
        prefix_cold_after: int,
    ) -> None:
        config = KVCacheConfig(
            num_layers=LAYERS,
            num_kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=dtype,
            max_slots=MAX_SLOTS,
            max_context=self.max_context,
            page_size=self.page_size,
            backend=self.backend,
            layout=layout,
            native=native,
            reclaim_watermark=0.1,
            prefix_cache_share=prefix_cache_share,
            prefix_cold_after=prefix_cold_after,
            memory_budget=budget_steps * (2 * LAYERS if layout == "per_layer" else 2) * self.page_size,
        )
        self.config = config
        self.cache = KVCache(config)

    def teardown(self) -> None:
        if self.cache:
            self.cache.close()

    @property
    def tokens(self) -> dict[int, torch.Tensor]:
        return {reqid: generation.tokens for reqid, generation in self.generations.items()}

    @property
    def live(self) -> list[int]:
        return sorted(self.generations)

    @property
    def held_by_views(self) -> set[int]:
        """Freed slots of this cache that kept views still reach: not to be handed out (an empty
        view reaches no memory)."""
        return {
            v.reqid
            for v in self.views
            if v.cache is self.cache and len(v.views[0]) and self.generations.get(v.reqid) is not v.generation
        }

    @rule()
    def alloc(self) -> None:
        global operations
        operations += 1
        held = self.held_by_views
        if len(self.tokens) + len(held) == MAX_SLOTS:
            try:
                self.cache.alloc_reqid()
                raise AssertionError("alloc_reqid succeeded with every slot in use or held by a view")
            except OutOfSlotsError:
                return
        reqid = self.cache.alloc_reqid()
        assert reqid not in self.tokens and reqid not in held
        self.generations[reqid] = Generation(torch.empty(0, device=self.cache.device))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        global operations
        operations += 1
        reqid = choose(data, self.live)
        self.cache.free_reqid(reqid)
        del self.generations[reqid]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        """A prefill chunk, a shrink or a jump for some requests, or one decode token for all."""
        global operations
        operations += 1
        if data.draw(st.booleans()):
            lengths = {r: min(self.max_context, len(self.tokens[r]) + 1) for r in self.live}
        else:
            picks = data.draw(st.lists(st.integers(0, 1 << 16), min_size=MAX_SLOTS, max_size=MAX_SLOTS))
            sizes = data.draw(st.lists(st.integers(0, self.max_context), min_size=MAX_SLOTS, max_size=MAX_SLOTS))
            chosen = list(dict.fromkeys(self.live[pick % len(self.live)] for pick in picks[: 1 + picks[0] % 6]))
            lengths = {r: size for r, size in zip(chosen, sizes, strict=False)}
        seed = data.draw(st.integers(0, 1 << 32))  # the new tokens' ids
        remember = data.draw(st.booleans())  # drawn first: whether the step fails may depend on timing
        shared = dict(zip(lengths, self.cache.shared_lengths(list(lengths)), strict=True))
        try:
            self.cache.step(lengths)
        except OutOfPagesError:
            return  # the invariants check that nothing changed
        except ValueError:
            assert any(length < shared[reqid] for reqid, length in lengths.items())
            return
        assert all(length >= shared[reqid] for reqid, length in lengths.items()), "stepped into a shared prefix"
        for reqid, length in lengths.items():
            generation = self.generations[reqid]
            old = len(generation.tokens)
            if length <= old:
                generation.tokens, generation.ids = generation.tokens[:length], generation.ids[:length]
                continue
            ids = random.Random(seed + reqid).choices(range(3), k=length - old)
            grown = generation.grown(ids, self.cache.device)
            generation.tokens, generation.ids = grown.tokens, grown.ids
            for layer in range(LAYERS):
                write(self.cache, layer, reqid, old, grown.tokens)
        if remember:  # as the engine does after each iteration
            for reqid in lengths:
                self.cache_prefix_of(reqid)

    def cache_prefix_of(self, reqid: int) -> None:
        """The request's whole units become findable (and its pages there shared)."""
        self.cache.cache_prefix(reqid, self.generations[reqid].ids)
        self.prompts.append(list(self.generations[reqid].ids))

    @rule(data=st.data())
    def alloc_matching(self, data: st.DataObject) -> None:
        """A new request whose prompt may begin with cached units: they are mapped, not computed."""
        global operations
        operations += 1
        if self.tokens and len(self.tokens) + len(self.held_by_views) == MAX_SLOTS:
            self.free(data)  # a full cache would turn most prompts away
        if len(self.tokens) + len(self.held_by_views) == MAX_SLOTS:
            return
        if data.draw(st.integers(0, 7)) == 0:
            self.cache.evict_prefix_cache()
        candidates = self.prompts[-8:] + [generation.ids for generation in self.generations.values()]
        known = choose(data, candidates) if candidates else []
        cut, tail_size, seed = (data.draw(st.integers(0, self.max_context)) for _ in range(3))
        head = (known if data.draw(st.booleans()) else known[:cut])[: self.max_context - 1]
        tail = random.Random(seed).choices(range(3), k=max(1, min(tail_size, self.max_context - len(head))))
        prompt = head + tail
        reqid = self.cache.alloc_reqid()
        cached = self.cache.match_prefix(reqid, prompt)
        assert cached < len(prompt)
        self.generations[reqid] = Generation(torch.empty(0, device=self.cache.device)).grown(
            prompt[:cached], self.cache.device
        )

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork_request(self, data: st.DataObject) -> None:
        global operations
        operations += 1
        parent = choose(data, self.live)
        try:
            child = self.cache.fork_reqid(parent)
        except (OutOfSlotsError, OutOfPagesError):
            return
        assert child not in self.tokens and child not in self.held_by_views
        generation = self.generations[parent]
        self.generations[child] = Generation(generation.tokens.clone(), list(generation.ids))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def keep_view(self, data: st.DataObject) -> None:
        """A caller keeps a request's views past anything that follows."""
        reqid = choose(data, self.live)
        layer = data.draw(st.integers(0, LAYERS - 1))
        views = self.cache.kv(layer, reqid)
        if self.cache.config.quantized:
            views += self.cache.kv_qparams(layer, reqid)
        self.views.append(KeptView(self.cache, reqid, self.generations[reqid], layer, views))

    @precondition(lambda self: self.views)
    @rule(data=st.data())
    def drop_view(self, data: st.DataObject) -> None:
        self.views.pop(choose(data, list(range(len(self.views)))))

    @rule()
    def close_and_reopen(self) -> None:
        """close() with views alive, then a new cache of the same config (same address space size)."""
        global operations
        operations += 1
        self.cache.close()
        self.generations.clear()
        self.cache = KVCache(self.config)

    @precondition(lambda self: self.backend == "host")
    @rule()
    def fork(self) -> None:
        """A forked child writes through every kept view and cannot use the cache."""
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                for view in self.views:
                    for tensor in view.views:
                        tensor.fill_(-1)
                try:
                    self.cache.alloc_reqid()
                except RuntimeError:
                    code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0

    @rule()
    def release_memory(self) -> None:
        """Sleep at the allocator: every page no request or kept view maps goes back to the system
        (the invariants then check the requests' and views' data)."""
        global operations
        operations += 1
        self.cache.release_memory()
        stats = self.cache.stats()
        assert stats.cached_bytes == 0 and stats.pages_created * self.cache.config.page_size == stats.mapped_bytes

    @rule()
    def compute(self) -> None:
        """The model's compute time: the background thread catches up."""
        assert self.cache.wait_for_background(10)

    @invariant()
    def pages_are_owned_once_and_data_is_intact(self) -> None:
        if self.cache is None:
            return
        cache, config = self.cache, self.cache.config
        assert cache.check_invariants() == {reqid: len(tokens) for reqid, tokens in self.tokens.items()}
        stats = cache.stats()
        assert stats.background_errors == 0, "the background mapper failed (step() mapped synchronously instead)"
        assert stats.mapped_bytes + stats.cached_bytes + stats.free_bytes == config.pool_pages * config.page_size
        used_tokens = sum(len(tokens) for tokens in self.tokens.values())
        assert stats.used_bytes == used_tokens * config.bytes_per_token * config.num_buffers
        assert stats.waste_bytes == stats.mapped_bytes - stats.used_bytes
        for reqid, tokens in self.tokens.items():
            for layer in range(LAYERS):
                views = cache.kv(layer, reqid) + (cache.kv_qparams(layer, reqid) if config.quantized else ())
                assert_holds(views, tokens, layer)

    @invariant()
    def kept_views_read_only_their_own_requests_writes(self) -> None:
        """Positions the request has not rewritten since (it may shrink and regrow) read what it
        wrote; every other kept position still holds one of its own writes."""
        for view in self.views:
            now = view.generation.tokens
            same = min(len(view.views[0]), len(now))
            assert_holds(view.views, torch.cat([now[:same], view.written[same:]]), view.layer)


def run_machine(machine: type[CacheMachine], examples: int, steps: int, min_operations: int) -> None:
    global operations
    operations = 0
    run_state_machine_as_test(
        machine,
        settings=settings(max_examples=fuzz_examples(examples), stateful_step_count=steps),
    )
    assert operations >= min_operations, f"only {operations} operations ran"


def test_random_operations_keep_the_invariants() -> None:
    run_machine(CacheMachine, examples=40, steps=60, min_operations=800)  # make fuzz: 20x the examples


@pytest.mark.skipif(FUZZING, reason="make fuzz draws new cases on purpose")
def test_property_tests_draw_the_same_cases_every_run() -> None:
    """make test's hypothesis profile: derandomized (cases follow from each test) and no example
    database, so a commit's result never depends on the run."""
    current = settings()
    assert current.derandomize and current.database is None
