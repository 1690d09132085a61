"""A cold prefix cache (`KVCacheConfig.prefix_cold_after` prompts in a row that found nothing):
a reused slot's entries are evicted where they lie, its pages kept as its own, and a prompt that
would have found one of them warms the cache again."""

from __future__ import annotations

import torch

from tests.test_sharing import ODD, MakeCache, write
from vattn import KVCache, KVCacheConfig

COLD_AFTER = KVCacheConfig.prefix_cold_after


def holds(cache: KVCache, reqid: int, tokens: list[int]) -> bool:
    """Whether the request reads at each position of `tokens` what `write` stores there."""
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv(layer, reqid)
        for position in range(len(tokens)):
            value = float(hash(tuple(tokens[: position + 1])) % 10_007 + layer)
            if not (torch.all(keys[position] == value) and torch.all(values[position] == -value)):
                return False
    return True


def run_and_cache(cache: KVCache, prompt: list[int]) -> tuple[int, int]:
    """One request of `prompt`, its units cached, ended; returns its reqid and what it found."""
    reqid = cache.alloc_reqid()
    found = cache.match_prefix(reqid, prompt)
    write(cache, reqid, prompt, start=found)
    cache.cache_prefix(reqid, prompt)
    cache.free_reqid(reqid)
    return reqid, found


def test_a_cold_cache_drops_a_reused_slots_entries_in_place(make_cache: MakeCache) -> None:
    """Once COLD_AFTER prompts in a row find nothing, a reused slot's pages are not moved
    out to keep its last request's entries (an unmap and a map per page): the entries go, the
    pages stay its own. The first hit warms the cache again."""
    cache = make_cache(**ODD, max_slots=4, background=False, prefix_cache_share=1.0)  # room for all
    unit = cache.config.unit_tokens
    prompts = [list(range(1000 * k, 1000 * k + unit + 6)) for k in range(1, COLD_AFTER + 1)]  # a unit, a tail
    *warm, last, cold = prompts
    for prompt in warm:
        run_and_cache(cache, prompt)
    reqid = cache.alloc_reqid()
    assert cache.match_prefix(reqid, last) == 0
    write(cache, reqid, last)
    cache.cache_prefix(reqid, last)
    table = cache.page_table(reqid)
    cache.free_reqid(reqid)
    before, digests = cache.stats(), cache.prefix_digests()
    assert before.prefix.evictions == 0 and len(digests) == COLD_AFTER - 1

    reqid, found = run_and_cache(cache, cold)  # the 32nd miss: the last prompt's unit and tail go
    after = cache.stats()
    assert found == 0 and after.counters.unmap.pages == before.counters.unmap.pages
    assert after.prefix.evictions == 2 and digests[-1] not in cache.prefix_digests()
    reader = cache.alloc_reqid()
    assert reader == reqid and cache.page_table(reader)[: len(table)] == table  # the same pages
    cache.check_invariants()

    assert cache.match_prefix(reader, [*warm[0][:unit], 9]) == unit  # a hit: the cache is warm again
    assert holds(cache, reader, warm[0][:unit])  # what the other entries hold is untouched
    assert cache.stats().counters.unmap.pages > after.counters.unmap.pages  # cold's unit moved out, kept
    cache.free_reqid(reader)
    assert cache.match_prefix(cache.alloc_reqid(), [*cold[:unit], 9]) == unit
    cache.check_invariants()


def test_a_cold_cache_keeps_entries_that_others_build_on(make_cache: MakeCache) -> None:
    """In place, an entry goes only with every entry cached after it, and only while no other
    slot maps its pages: otherwise the reused slot's pages are moved out as when warm."""
    cache = make_cache(**ODD, max_slots=4, background=False, prefix_cache_share=1.0)
    unit, width = cache.config.unit_tokens, cache.config.num_buffers
    for k in range(1, COLD_AFTER):
        run_and_cache(cache, list(range(1000 * k, 1000 * k + unit)))
    parent = cache.alloc_reqid()
    prompt, more = list(range(unit)), list(range(500, 500 + unit))
    assert cache.match_prefix(parent, prompt) == 0  # the 32nd miss: cold
    write(cache, parent, prompt)
    cache.cache_prefix(parent, prompt)
    child = cache.fork_reqid(parent)  # maps the parent's unit; its own unit is cached after it
    write(cache, child, [*prompt, *more], start=unit)
    cache.cache_prefix(child, [*prompt, *more])
    cache.free_reqid(child)
    cache.free_reqid(parent)
    digests, evictions = cache.prefix_digests(), cache.stats().prefix.evictions
    unmapped = cache.stats().counters.unmap.pages
    for reused, groups in ((child, 6), (parent, 3)):  # the child's first unit is the parent's too
        reqid = cache.alloc_reqid()
        assert reqid == reused and cache.match_prefix(reqid, [7] * 10) == 0
        assert cache.stats().counters.unmap.pages - unmapped == groups * width
        unmapped = cache.stats().counters.unmap.pages
    assert cache.prefix_digests() == digests and cache.stats().prefix.evictions == evictions
    assert cache.match_prefix(cache.alloc_reqid(), [*prompt, *more, 9]) == 2 * unit
    cache.check_invariants()


def test_a_prompt_that_would_have_found_an_entry_evicted_in_place_warms_the_cache(make_cache: MakeCache) -> None:
    """Many chats whose first turns share nothing: once the cache is cold, a returning chat
    finds its history gone, but its prompt names a ghost of what went, so the cache warms
    again and the slot it reuses keeps another chat's history (no chat keeps it cold)."""
    cache = make_cache(**ODD, max_slots=4, background=False, prefix_cache_share=1.0)
    chats = [list(range(1000 * k, 1000 * k + 40)) for k in range(1, COLD_AFTER + 2)]  # first turns, inside a unit
    for chat in chats:
        run_and_cache(cache, chat)
    assert cache.stats().prefix.evictions == 2  # the 32nd and 33rd reused the slot cold
    unmapped = cache.stats().counters.unmap.pages
    assert run_and_cache(cache, [*chats[-3], 7, 8])[1] == 0  # its history went, but it would have hit
    assert cache.stats().counters.unmap.pages > unmapped  # warm: the last chat's history moved out, kept
    assert cache.match_prefix(cache.alloc_reqid(), [*chats[-1], 9]) == len(chats[-1])
    cache.check_invariants()
