"""Page sharing: the prefix cache and forked requests map the same physical pages behind
several slots, no page a slot shares is ever written, and eviction gives every page back."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from vattn import KVCache, OutOfPagesError
from vattn.kernels import make_kernel

MakeCache = Callable[..., KVCache]
ODD = {"num_kv_heads": 3, "page_size": 4096}
"""192 B per token per layer: a 4 KiB page holds 21 1/3 tokens, so a unit is 3 pages, 64 tokens."""


def write(cache: KVCache, reqid: int, tokens: list[int], start: int = 0) -> None:
    """Steps the request to len(tokens) and stores a value derived from each token's prefix
    (equal prefixes give equal KV, as a model's would) at every position from `start`."""
    cache.step({reqid: len(tokens)})
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv(layer, reqid)
        qparams = cache.kv_qparams(layer, reqid) if cache.config.quantized else None
        for position in range(start, len(tokens)):
            value = float(hash(tuple(tokens[: position + 1])) % 10_007 + layer)
            if qparams is None:
                keys[position], values[position] = value, -value
            else:  # an int8 cache: a small value per row, the whole one in its qparams
                keys[position], values[position] = value % 251 - 125, -(value % 251) + 125
                qparams[0][position], qparams[1][position] = value, -value


def snapshot(cache: KVCache, reqid: int, tokens: int) -> list[torch.Tensor]:
    return [part[:tokens].clone() for layer in range(cache.config.num_layers) for part in cache.kv(layer, reqid)]


def qparams_snapshot(cache: KVCache, reqid: int, tokens: int) -> list[torch.Tensor]:
    """An int8 cache's qparams as `snapshot` takes the values (none for a float cache)."""
    if not cache.config.quantized:
        return []
    return [
        part[:tokens].clone() for layer in range(cache.config.num_layers) for part in cache.kv_qparams(layer, reqid)
    ]


def test_a_cached_prefix_is_mapped_not_copied_and_reads_the_same(make_cache: MakeCache) -> None:
    cache = make_cache(**ODD, prefix_copy_min_tokens=1)  # the 7-token tail below is copied too
    unit = cache.config.unit_tokens
    assert (cache.config.unit_groups, unit) == (3, 64)
    prompt = list(range(100, 300))  # 200 tokens: 3 whole units
    first = cache.alloc_reqid()
    assert cache.match_prefix(first, prompt) == 0
    write(cache, first, prompt)
    cache.cache_prefix(first, prompt)
    expected = snapshot(cache, first, 3 * unit)

    second = cache.alloc_reqid()
    assert cache.match_prefix(second, prompt[: 2 * unit] + [7] * 50) == 2 * unit  # diverges in unit 3
    assert cache.page_table(second)[:6] == cache.page_table(first)[:6]  # the same physical pages
    cache.free_reqid(first)  # its units stay cached
    assert all(torch.equal(a, b[: 2 * unit]) for a, b in zip(snapshot(cache, second, 2 * unit), expected, strict=True))
    third = cache.alloc_reqid()  # 3 units mapped, then 7 of the 8 tokens the first had after them, copied
    assert cache.match_prefix(third, prompt) == len(prompt) - 1
    assert cache.page_table(third)[:6] == cache.page_table(second)[:6]
    assert all(torch.equal(a, b) for a, b in zip(snapshot(cache, third, 3 * unit), expected, strict=True))
    stats = cache.stats()
    assert (stats.prefix.queries, stats.prefix.hits) == (200 + 178 + 200, 2 * unit + len(prompt) - 1)


class Three(int):
    """An int subclass: accepted as the id it stores, but off the plain-int fast path."""


@pytest.mark.parametrize("bad", [-1, True, 2.0, "7"])
def test_tokens_that_are_not_ids_are_refused_and_int_subclasses_read_as_ids(make_cache: MakeCache, bad: object) -> None:
    cache = make_cache(**ODD)
    reqid = cache.alloc_reqid()
    prompt = [*range(10, 40), Three(3)]
    assert cache.match_prefix(reqid, prompt) == 0
    write(cache, reqid, list(map(int, prompt)))
    cache.cache_prefix(reqid, prompt)  # the tail, checked one by one
    with pytest.raises(ValueError, match="non-negative integers"):
        cache.match_prefix(cache.alloc_reqid(), [1, 2, bad])
    with pytest.raises(ValueError, match="non-negative integers"):
        cache.cache_prefix(reqid, [*prompt[:-1], bad])


def test_a_prompt_never_matches_whole_so_its_last_token_is_computed(make_cache: MakeCache) -> None:
    cache = make_cache(**ODD)
    prompt = list(range(128))  # exactly two units
    first = cache.alloc_reqid()
    write(cache, first, prompt)
    cache.cache_prefix(first, prompt)
    assert cache.match_prefix(cache.alloc_reqid(), prompt) == 127  # one unit mapped, 63 tokens copied


@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_prefix_that_ends_inside_a_unit_is_matched_to_the_token(make_cache: MakeCache, dtype: str) -> None:
    """A system prompt 22 tokens into a third unit, before two questions: the second request
    maps the two whole units it shares and copies the 22 tokens of the third that it shares
    too (values and, in int8, qparams) into pages of its own, which it then writes without
    touching the first's (float32: 64-token units of 3 pages; int8: 1,024 tokens of 15)."""
    cache = make_cache(**ODD, dtype=dtype, max_context=4096)
    unit, groups = cache.config.unit_tokens, cache.config.unit_groups
    system = list(range(1000, 1000 + 2 * unit + 22))
    first_prompt, second_prompt = [*system, *range(1, unit)], [*system, *range(500, 540)]
    first = cache.alloc_reqid()
    write(cache, first, first_prompt)
    cache.cache_prefix(first, first_prompt)  # 3 whole units
    first_kv = snapshot(cache, first, 3 * unit) + qparams_snapshot(cache, first, 3 * unit)
    second = cache.alloc_reqid()
    copied_before = cache.stats().counters.prefix_copied_bytes
    assert cache.match_prefix(second, second_prompt) == len(system)
    assert cache.page_table(second)[: 2 * groups] == cache.page_table(first)[: 2 * groups]  # whole units: shared
    own = {page for group in cache.page_table(second)[2 * groups :] for page in group}
    assert not own & {page for group in cache.page_table(first) for page in group}
    copied = cache.stats().counters.prefix_copied_bytes - copied_before
    assert copied == 22 * cache.config.bytes_per_token * cache.config.num_buffers
    assert cache.shared_lengths([second]) == [2 * unit]  # the copied tokens are its own
    mine = snapshot(cache, second, len(system)) + qparams_snapshot(cache, second, len(system))
    assert all(torch.equal(a, b[: len(system)]) for a, b in zip(mine, first_kv, strict=True))
    write(cache, second, second_prompt, start=len(system))
    after = snapshot(cache, first, 3 * unit) + qparams_snapshot(cache, first, 3 * unit)
    assert all(torch.equal(a, b) for a, b in zip(after, first_kv, strict=True))
    assert cache.stats().prefix.hits == len(system)


@pytest.mark.parametrize("shared", [15, 16])
def test_a_partial_unit_is_copied_from_prefix_copy_min_tokens_on(make_cache: MakeCache, shared: int) -> None:
    """Prompts of common words share their first token or two with some cached prompt, and a copy
    maps a scratch page into every virtual tensor: under `prefix_copy_min_tokens` (16) tokens of
    a unit are left to compute, from it on they are copied."""
    cache = make_cache(**ODD)
    unit = cache.config.unit_tokens
    cached = list(range(1000, 1000 + 2 * unit))
    first = cache.alloc_reqid()
    write(cache, first, cached)
    cache.cache_prefix(first, cached)
    prompt = [*cached[: unit + shared], *range(1, 30)]
    copied_before = cache.stats().counters.prefix_copied_bytes
    found = cache.match_prefix(cache.alloc_reqid(), prompt)
    copied = cache.stats().counters.prefix_copied_bytes - copied_before
    assert cache.config.prefix_copy_min_tokens == 16
    if shared < 16:
        assert (found, copied) == (unit, 0)
    else:
        assert (found, copied) == (unit + shared, shared * cache.config.bytes_per_token * cache.config.num_buffers)


def test_no_write_reaches_a_shared_page(make_cache: MakeCache) -> None:
    """A request appends after its shared prefix through the kernel; the prefix's bytes, which
    another request reads, never change, and writing into it is refused."""
    cache = make_cache(**ODD)
    prompt = list(range(1, 150))
    owner = cache.alloc_reqid()
    write(cache, owner, prompt)
    cache.cache_prefix(owner, prompt)
    before = snapshot(cache, owner, 128)
    sharer = cache.alloc_reqid()
    cached = cache.match_prefix(sharer, [*prompt, 5, 6])
    assert cached == 128 and cache.shared_lengths([sharer, owner]) == [128, 128]
    kernel = make_kernel("ragged", cache, num_query_heads=3)
    for new in (len(prompt) + 2 - cached, 1, 1):  # the rest of the prompt, then two decodes
        length = cache.lengths([sharer])[0] + new
        cache.step({sharer: length})
        batch = kernel.plan([sharer], [new])
        for layer in range(cache.config.num_layers):
            q = torch.randn(new, 3, 16)
            kernel.forward(layer, batch, q, torch.full((new, 3, 16), 9.0), torch.full((new, 3, 16), 9.0))
    assert all(torch.equal(a, b) for a, b in zip(snapshot(cache, owner, 128), before, strict=True))
    with pytest.raises(ValueError, match="after its 128 shared tokens"):
        kernel.plan([sharer], [cache.lengths([sharer])[0] - 127])
    with pytest.raises(ValueError, match="shared prefix"):
        cache.step({sharer: 100})


def test_a_fork_shares_whole_pages_and_copies_the_partial_one(make_cache: MakeCache) -> None:
    cache = make_cache(**ODD)
    tokens = list(range(50, 120))  # 70 tokens: page 3 is partial, and a token straddles pages 2 and 3
    parent = cache.alloc_reqid()
    write(cache, parent, tokens)
    child = cache.fork_reqid(parent)
    assert cache.lengths([child]) == [70]
    assert all(torch.equal(a, b) for a, b in zip(snapshot(cache, child, 70), snapshot(cache, parent, 70), strict=True))
    parent_pages, child_pages = cache.page_table(parent), cache.page_table(child)
    assert child_pages[:3] == parent_pages[:3] and child_pages[3] != parent_pages[3]
    shared = snapshot(cache, parent, 64)
    write(cache, parent, [*tokens, 1, 2, 3], start=70)  # each side appends its own tokens
    write(cache, child, [*tokens, 4, 5], start=70)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(cache, child, 64), shared, strict=True))
    assert not torch.equal(cache.kv(0, parent)[0][70], cache.kv(0, child)[0][70])
    cache.free_reqid(parent)
    assert all(torch.equal(a, b) for a, b in zip(snapshot(cache, child, 64), shared, strict=True))


def test_cached_pages_are_evicted_when_a_step_needs_them_and_all_come_back(make_cache: MakeCache) -> None:
    budget_steps = 12
    cache = make_cache(**ODD, memory_budget=budget_steps * 8 * 4096, max_slots=3, background=False)
    width = cache.config.num_buffers
    for first_token in (1000, 2000):  # two finished requests leave 2 x 3 units cached
        reqid = cache.alloc_reqid()
        prompt = list(range(first_token, first_token + 192))
        write(cache, reqid, prompt)
        cache.cache_prefix(reqid, prompt)
        cache.free_reqid(reqid)
    stats = cache.stats()
    assert stats.cached_bytes + stats.mapped_bytes + stats.free_bytes == stats.pool_pages * 4096
    big = cache.alloc_reqid()
    write(cache, big, list(range(5000, 5000 + 21 * budget_steps)))  # every page of the budget
    stats = cache.stats()
    assert stats.cached_bytes == 0 and stats.active_bytes == budget_steps * width * 4096
    with pytest.raises(OutOfPagesError):
        cache.step({big: 21 * budget_steps + 22})
    cache.free_reqid(big)
    cache.release_idle()
    cache.evict_prefix_cache()
    assert cache.num_free_pages() == budget_steps * width


def test_a_freed_slot_drops_only_shared_pages_and_keeps_deferred_reclamation(make_cache: MakeCache) -> None:
    cache = make_cache(**ODD, max_slots=1, background=False, prefix_cache_share=1.0)
    reqid = cache.alloc_reqid()
    write(cache, reqid, list(range(300)))  # 15 page groups, no sharing
    cache.free_reqid(reqid)
    assert cache.stats().idle_bytes == 15 * cache.config.page_group_bytes
    again = cache.alloc_reqid()
    assert again == reqid and len(cache.page_table(again)) == 15  # deferred reclamation: kept
    prompt = list(range(300))
    write(cache, again, prompt)
    cache.cache_prefix(again, prompt)
    kept = cache.page_table(again)
    cache.free_reqid(again)
    last = cache.alloc_reqid()  # its pages stay mapped until it is matched or stepped
    assert cache.page_table(last) == kept
    cache.step({last: 1})  # not matched: the cached ones go, a page of its own comes
    assert len(cache.page_table(last)) == 1 and cache.page_table(last)[0] not in kept
    assert cache.stats().cached_bytes == 15 * cache.config.page_group_bytes  # 4 units, and the 44-token tail


def test_the_prefix_cache_alone_holds_at_most_its_share_least_recently_used_first(make_cache: MakeCache) -> None:
    """Entries whose pages no slot maps any more go, least recently used first, once they pass
    `prefix_cache_share` of the pool: here two units' worth (2 x 3 groups of 8 pages)."""
    cache = make_cache(**ODD, max_slots=1, background=False, memory_budget=192 * 4096, prefix_cache_share=0.25)
    unit_pages = cache.config.unit_groups * cache.config.num_buffers
    assert int(0.25 * cache.config.pool_pages) == 2 * unit_pages
    prompts = {name: list(range(first, first + 64)) for name, first in (("a", 1000), ("b", 2000), ("c", 3000))}

    def run(prompt: list[int]) -> int:
        reqid = cache.alloc_reqid()
        found = cache.match_prefix(reqid, prompt)
        write(cache, reqid, prompt, start=found)
        cache.cache_prefix(reqid, prompt)
        cache.free_reqid(reqid)
        assert cache.stats().cached_bytes <= 2 * unit_pages * 4096
        return found

    assert run(prompts["a"]) == run(prompts["b"]) == 0  # one unit each; a's pages now the cache's alone
    assert run(prompts["a"] + [5] * 10) == 64  # a matched: the most recently used
    assert run(prompts["c"]) == 0  # b's and a's pages now the cache's alone, with a's tail: b, the oldest, goes
    assert cache.stats().prefix.evictions == 1
    assert run(prompts["a"] + [6] * 10) == 64 and run(prompts["b"] + [6]) == 0
    cache.check_invariants()


def test_with_no_share_the_prefix_cache_keeps_only_what_slots_map(make_cache: MakeCache) -> None:
    """`prefix_cache_share=0`: requests running together still share their prefix, but an entry
    goes as soon as no slot maps its pages."""
    cache = make_cache(**ODD, max_slots=2, background=False, prefix_cache_share=0.0)
    prompt = list(range(100, 228))  # two units
    first = cache.alloc_reqid()
    write(cache, first, prompt)
    cache.cache_prefix(first, prompt)
    second = cache.alloc_reqid()
    assert cache.match_prefix(second, [*prompt, 9]) == 128
    assert cache.page_table(second)[:6] == cache.page_table(first)[:6]
    cache.free_reqid(first)
    cache.free_reqid(second)
    cache.release_idle()
    stats = cache.stats()
    assert stats.cached_bytes == 0 and stats.prefix.evictions == 2  # both units
    cache.check_invariants()


def test_a_reused_slot_keeps_the_pages_its_new_prompt_shares(make_cache: MakeCache) -> None:
    """The slot handed out again still maps its last request's cached units: a prompt that
    shares them keeps them where they are (no unmap and map back), the rest is dropped."""
    cache = make_cache(**ODD, max_slots=1, background=False)
    unit, groups = cache.config.unit_tokens, cache.config.unit_groups
    prompt = list(range(3 * unit))
    first = cache.alloc_reqid()
    write(cache, first, prompt)
    cache.cache_prefix(first, prompt)
    table = cache.page_table(first)
    cache.free_reqid(first)
    unmapped = cache.stats().counters.unmap.pages
    second = cache.alloc_reqid()
    assert cache.match_prefix(second, [*prompt[: 2 * unit], 7, 8]) == 2 * unit
    assert cache.page_table(second) == table[: 2 * groups]
    assert cache.stats().counters.unmap.pages - unmapped == groups * cache.config.num_buffers  # the third unit only


def test_a_cache_salt_keeps_tenants_apart(make_cache: MakeCache) -> None:
    """vLLM's cache_salt: units cached under one salt are found only under the same salt, by
    later requests and by forks of a salted request alike."""
    cache = make_cache(**ODD)
    unit = cache.config.unit_tokens
    prompt = list(range(100, 300))  # 3 whole units
    tenant_a = cache.alloc_reqid()
    assert cache.match_prefix(tenant_a, prompt, salt="a") == 0
    write(cache, tenant_a, prompt)
    child = cache.fork_reqid(tenant_a)
    write(cache, child, [*prompt, 5, 6], start=len(prompt))
    cache.cache_prefix(tenant_a, prompt)
    cache.cache_prefix(child, [*prompt, 5, 6])
    found = []
    for salt in (None, "b", "a", "a"):
        reqid = cache.alloc_reqid()
        found.append(cache.match_prefix(reqid, [*prompt, 1], salt=salt))
        cache.free_reqid(reqid)
    assert found == [0, 0, 3 * unit, 3 * unit]
    with pytest.raises(ValueError, match="non-empty string"):
        cache.match_prefix(cache.alloc_reqid(), prompt, salt="")


def test_a_child_forked_inside_a_unit_caches_its_unit_beside_its_parents(make_cache: MakeCache) -> None:
    """Found by a random run of the stateful test: a fork at 50 tokens shares the two whole
    pages of the 3-page unit and copies the third; parent and child then end the unit with
    other tokens, so two entries hold those two pages, each with its own KV after them."""
    cache = make_cache(**ODD)
    prefix = list(range(300, 350))
    parent = cache.alloc_reqid()
    write(cache, parent, prefix)
    child = cache.fork_reqid(parent)
    mine, theirs = [*prefix, *range(14)], [*prefix, *range(100, 114)]  # one unit each, 64 tokens
    write(cache, parent, mine, start=50)
    write(cache, child, theirs, start=50)
    cache.cache_prefix(parent, mine)
    cache.cache_prefix(child, theirs)
    parent_pages, child_pages = cache.page_table(parent), cache.page_table(child)
    assert child_pages[:2] == parent_pages[:2] and child_pages[2] != parent_pages[2]
    expected = {tuple(mine): snapshot(cache, parent, 64), tuple(theirs): snapshot(cache, child, 64)}
    cache.free_reqid(parent)
    cache.free_reqid(child)
    for tokens, kv in expected.items():
        reader = cache.alloc_reqid()
        assert cache.match_prefix(reader, [*tokens, 7]) == 64
        assert all(torch.equal(a, b) for a, b in zip(snapshot(cache, reader, 64), kv, strict=True))
        cache.free_reqid(reader)
    assert cache.wait_for_background(10)  # it may pre-map the next reqid meanwhile
    cache.release_idle()
    cache.evict_prefix_cache()
    assert cache.num_free_pages() == cache.stats().pool_pages
