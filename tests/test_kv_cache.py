"""KVCache behaviour on real Linux virtual memory and on the fake CUDA driver, through the C
library and the Python calls."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest
import torch
from checks import check_page_sharing

from vattn import ConfigurationError, KVCache, KVCacheConfig, OutOfPagesError, OutOfSlotsError
from vattn.backends import VMMBackend, host_calls, native
from vattn.backends.host import HostBackend

MakeCache = Callable[..., KVCache]


def pattern(reqid: int, length: int, generation: int) -> torch.Tensor:
    """Distinct values per request, position, head and generation (reuse of a slot)."""
    base = torch.arange(length * 2 * 16, dtype=torch.float32).reshape(length, 2, 16)
    return base + 1e5 * reqid + 1e7 * generation


def write_all(cache: KVCache, reqid: int, length: int, generation: int) -> None:
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv(layer, reqid)
        keys.copy_(pattern(reqid, length, generation) + layer)
        values.copy_(-(pattern(reqid, length, generation) + layer))


def check_all(cache: KVCache, reqid: int, length: int, generation: int) -> None:
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv(layer, reqid)
        assert keys.shape == (length, 2, 16)
        assert torch.equal(keys, pattern(reqid, length, generation) + layer)
        assert torch.equal(values, -(pattern(reqid, length, generation) + layer))


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_data_survives_page_boundaries_frees_and_reuse(make_cache: MakeCache, layout: str) -> None:
    cache = make_cache(layout=layout)
    lengths = {cache.alloc_reqid(): 10 + 45 * i for i in range(8)}  # 10..325 tokens: up to 11 pages
    generation = dict.fromkeys(lengths, 0)
    cache.step(lengths)
    for reqid, length in lengths.items():
        write_all(cache, reqid, length, 0)
    for reqid in list(lengths)[::2]:  # free half, hand the slots out again, grow them past old pages
        cache.free_reqid(reqid)
        assert cache.alloc_reqid() == reqid
        lengths[reqid] += 70
        generation[reqid] = 1
    cache.step(lengths)
    for reqid in list(lengths)[::2]:
        write_all(cache, reqid, lengths[reqid], 1)
    for reqid in list(lengths)[1::2]:  # the untouched half grows page by page with the data intact
        for length in range(lengths[reqid] + 1, lengths[reqid] + 40):
            cache.step({reqid: length})
        cache.step({reqid: lengths[reqid]})
    for reqid, length in lengths.items():
        check_all(cache, reqid, length, generation[reqid])


@pytest.mark.parametrize("backend", ["host"])  # reads the host pool's memfd
def test_bytes_land_in_the_physical_pool(make_cache: MakeCache) -> None:
    cache = make_cache(dtype="float32")
    reqid = cache.alloc_reqid()
    cache.step({reqid: 100})  # 100 tokens x 128 B = 12800 B: pages 0..3 of each tensor
    write_all(cache, reqid, 100, 0)
    fd, page_size = cache.backend.pool_fd(), cache.config.page_size
    table = cache.page_table(reqid)
    assert len(table) == 4 and all(len(step) == cache.config.num_buffers for step in table)
    for layer in range(cache.config.num_layers):
        keys, values = cache.kv(layer, reqid)
        for buffer, tensor in ((2 * layer, keys), (2 * layer + 1, values)):
            expected = tensor.contiguous().view(torch.uint8).flatten().numpy().tobytes()
            stored = b"".join(os.pread(fd, page_size, step[buffer] * page_size) for step in table)
            assert stored[: len(expected)] == expected
    every_page = [page for step in table for page in step]
    assert len(set(every_page)) == len(every_page)


def rss_shmem() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no RssShmem in /proc/self/status")


def test_memory_is_on_demand(native: bool) -> None:
    """64 slots x 8K context x 30 layers reserve 15 GiB and cost nothing until pages are mapped."""
    config = KVCacheConfig(
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        max_slots=64,
        max_context=8192,
        dtype="float16",
        background=False,
        native=native,
    )
    before = rss_shmem()
    with KVCache(config) as cache:
        assert config.max_slots * config.slot_stride * config.num_buffers >= 15 << 30
        fd_bytes = lambda: os.fstat(cache.backend.pool_fd()).st_blocks * 512  # noqa: E731
        assert fd_bytes() == 0
        assert rss_shmem() - before < 4 << 20
        reqids = [cache.alloc_reqid() for _ in range(3)]
        cache.step(dict.fromkeys(reqids, 1))  # one 2 MiB page in each of 60 tensors per request
        mapped = 3 * 60 * config.page_size
        assert cache.stats().mapped_bytes == mapped
        assert fd_bytes() == mapped
        assert abs(rss_shmem() - before - mapped) < 8 << 20
    assert rss_shmem() - before < 4 << 20


def test_freed_slot_keeps_its_pages_and_is_handed_out_first(make_cache: MakeCache) -> None:
    cache = make_cache(background=False)
    first, second = cache.alloc_reqid(), cache.alloc_reqid()
    cache.step({first: 200, second: 10})
    cache.free_reqid(first)
    stats = cache.stats()
    assert stats.idle_bytes == 7 * 8 * 4096 and stats.active_slots == 1
    assert cache.alloc_reqid() == first  # the idle slot with the most pages
    cache.step({first: 150})
    counters = cache.stats().counters
    assert counters.needs_met_by_reuse == 5 and counters.map.calls == 1  # nothing mapped for reuse


def test_background_thread_maps_ahead_and_eagerly(make_cache: MakeCache) -> None:
    cache = make_cache(lookahead_tokens=1, eager_pages=2)
    assert cache.wait_for_background(10)
    assert cache.stats().pages_per_slot[0] == 2 * 8  # next reqid pre-mapped before anyone asked
    reqid = cache.alloc_reqid()
    cache.step({reqid: 64})  # pages 0 and 1 were there already
    for length in range(65, 300):
        assert cache.wait_for_background(10)  # the model's compute time, in a real loop
        cache.step({reqid: length})
    counters = cache.stats().counters
    assert counters.page_needs == 10
    assert counters.needs_met_by_background == 10 and counters.needs_mapped_in_step == 0


def test_idle_pages_are_reclaimed_when_a_step_needs_them(make_cache: MakeCache) -> None:
    cache = make_cache(background=False, memory_budget=20 * 8 * 4096)  # 20 page groups
    reqids = [cache.alloc_reqid() for _ in range(4)]
    cache.step(dict.fromkeys(reqids, 160))  # 5 steps each: the pool is full
    for reqid in reqids[1:]:
        cache.free_reqid(reqid)
    assert cache.num_free_pages() == 0
    cache.step({reqids[0]: 480})  # needs 10 more steps: taken from the idle slots
    stats = cache.stats()
    assert stats.mapped_bytes == 20 * 8 * 4096 and stats.pages_per_slot[reqids[0]] == 15 * 8
    assert stats.counters.unmap.pages == 10 * 8

    cache.free_reqid(reqids[0])
    cache.release_idle()
    assert cache.num_free_pages() == 20 * 8 and cache.stats().mapped_bytes == 0


def test_release_memory_destroys_every_page_no_running_request_maps(make_cache: MakeCache) -> None:
    """Sleep at the allocator: idle slots' pages, the prefix cache's and the pre-mapped next
    slot's go back to the system (no page stays created but the running request's); the
    reservations stay, so the same cache maps on demand again, and a live view's pages stay."""
    cache = make_cache(memory_budget=20 * 8 * 4096)
    running, idle, viewed = (cache.alloc_reqid() for _ in range(3))
    cache.step({running: 64, idle: 160, viewed: 32})
    cache.cache_prefix(idle, list(range(160)))
    view = cache.kv(0, viewed)[0]
    view.fill_(1.0)
    cache.free_reqid(idle)
    cache.free_reqid(viewed)
    assert cache.wait_for_background(10)
    held = cache.stats().pages_created
    released = cache.release_memory()
    stats = cache.stats()
    kept = stats.pages_per_slot[running] + stats.pages_per_slot[viewed]
    assert stats.pages_created == kept and released == (held - kept) * 4096
    assert stats.cached_bytes == 0 and bool((view == 1.0).all())
    cache.check_invariants()
    again = cache.alloc_reqid()
    cache.step({again: 160, running: 65})  # maps afresh, within the same budget
    cache.check_invariants()


def test_background_thread_reclaims_below_the_watermark(make_cache: MakeCache) -> None:
    cache = make_cache(memory_budget=20 * 8 * 4096, reclaim_watermark=0.5, eager_pages=0, lookahead_tokens=0)
    reqids = [cache.alloc_reqid() for _ in range(4)]
    cache.step(dict.fromkeys(reqids, 160))
    for reqid in reqids:
        cache.free_reqid(reqid)
    assert cache.wait_for_background(10)
    assert cache.num_free_pages() == 10 * 8  # back to the watermark, no further
    assert cache.stats().idle_bytes == 10 * 8 * 4096


def test_out_of_pages_leaves_every_slot_unchanged(make_cache: MakeCache) -> None:
    cache = make_cache(memory_budget=10 * 8 * 4096)
    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    cache.step({a: 100, b: 100})  # 4 steps each
    cache.wait_for_background(10)
    before = (cache.page_table(a), cache.page_table(b), cache.kv(0, a)[0].shape, cache.num_free_pages())
    with pytest.raises(OutOfPagesError) as raised:
        cache.step({a: 130, b: 300})  # 5 + 10 steps > 10
    assert raised.value.needed > raised.value.available
    assert (cache.page_table(a), cache.page_table(b), cache.kv(0, a)[0].shape, cache.num_free_pages()) == before
    cache.free_reqid(b)  # preempt b: now a fits
    cache.step({a: 300})
    assert cache.kv(0, a)[0].shape[0] == 300


def test_can_admit_counts_free_slots_and_pages(make_cache: MakeCache) -> None:
    cache = make_cache(max_slots=2, memory_budget=10 * 8 * 4096, background=False)
    assert cache.can_admit(320) and not cache.can_admit(321)
    a = cache.alloc_reqid()
    cache.step({a: 160})
    assert cache.can_admit(160) and not cache.can_admit(161)
    cache.alloc_reqid()
    assert cache.num_free_slots() == 0 and not cache.can_admit(1)
    with pytest.raises(OutOfSlotsError, match="all 2 request slots are in use"):
        cache.alloc_reqid()


def test_kv_batch_is_a_view_for_consecutive_slots_and_refuses_unmapped_padding(make_cache: MakeCache) -> None:
    cache = make_cache()
    a, b, c = (cache.alloc_reqid() for _ in range(3))
    cache.step({a: 10, b: 30, c: 20})
    keys, _ = cache.kv_batch(1, [a, b, c])
    assert keys.shape == (3, 30, 2, 16) and keys.data_ptr() == cache.kv(1, a)[0].data_ptr()
    gathered, _ = cache.kv_batch(1, [c, a])
    assert gathered.shape == (2, 20, 2, 16)
    cache.step({b: 40})  # past b's first page: a and c map only 32 tokens
    with pytest.raises(ValueError, match="has 32 tokens mapped but the batch is padded to 40"):
        cache.kv_batch(1, [a, b])
    with pytest.raises(ValueError, match="at least one reqid"):
        cache.kv_batch(1, [])


def test_step_errors_change_nothing(make_cache: MakeCache) -> None:
    cache = make_cache()
    reqid = cache.alloc_reqid()
    cache.step({reqid: 5})
    bad = [
        ([(reqid, 5)], "seq_lens must map reqid -> length"),
        ({reqid: -1}, "must be an integer in \\[0, 1000\\]"),
        ({reqid: 1001}, "\\(max_context\\) must be an integer in \\[0, 1000\\]"),
        ({reqid: 3.0}, "must be an integer"),
        ({reqid: 50, 7: 3}, "reqid 7 is not allocated"),
        ({99: 3}, "reqid must be an integer in \\[0, 7\\]"),
        ({"0": 3}, "reqid must be an integer"),
    ]
    for seq_lens, message in bad:
        with pytest.raises(ValueError, match=message):
            cache.step(seq_lens)
    assert cache.kv(0, reqid)[0].shape[0] == 5


def test_api_errors(make_cache: MakeCache) -> None:
    cache = make_cache()
    reqid = cache.alloc_reqid()
    cache.free_reqid(reqid)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free_reqid(reqid)  # double free
    with pytest.raises(ValueError, match="reqid must be an integer"):
        cache.free_reqid(-1)
    reqid = cache.alloc_reqid()
    with pytest.raises(ValueError, match="layer must be an integer in \\[0, 3\\]"):
        cache.kv(4, reqid)
    with pytest.raises(ValueError, match="not allocated"):
        cache.kv(0, reqid + 1)
    with pytest.raises(ValueError, match="num_tokens must be an integer"):
        cache.can_admit(1001)
    cache.close()
    cache.close()  # idempotent
    for call in (cache.alloc_reqid, lambda: cache.step({reqid: 1}), lambda: cache.kv(0, reqid)):
        with pytest.raises(RuntimeError, match="closed"):
            call()


def is_mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            start, end = (int(part, 16) for part in line.split(maxsplit=1)[0].split("-"))
            if start <= address < end:
                return True
    return False


def test_close_stops_the_thread_and_frees_the_address_space(make_cache: MakeCache) -> None:
    """The cache's own addresses, not the process's map count: other threads' allocations
    (malloc arenas, torch's pool) add and drop mappings of their own meanwhile."""
    cache = make_cache()
    reqid = cache.alloc_reqid()
    cache.step({reqid: 500})
    first_key, last_value = cache.kv(0, reqid)[0].data_ptr(), cache.kv(cache.config.num_layers - 1, reqid)[1].data_ptr()
    assert is_mapped(first_key) and is_mapped(last_value)
    cache.close()
    assert not any(t.name == "vattn-mapper" for t in threading.enumerate())
    assert not is_mapped(first_key) and not is_mapped(last_value)


def test_unknown_backend_and_page_size_and_map_count_are_refused() -> None:
    shape = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "max_slots": 2, "max_context": 64}
    with pytest.raises(ValueError, match="unknown backend 'tpu'"):
        KVCache(KVCacheConfig(**shape, backend="tpu"))
    with pytest.raises(ValueError, match="multiple of the OS page size"):
        KVCache(KVCacheConfig(**shape, page_size=6000))
    huge = {**shape, "max_slots": 256, "max_context": 32768, "num_layers": 30, "page_size": 4096}
    with pytest.raises(ValueError, match=r"vm\.max_map_count"):
        KVCache(KVCacheConfig(**huge))
    KVCache(KVCacheConfig(**huge, memory_budget=64 << 20)).close()  # fine with a bounded pool


@pytest.mark.parametrize("memory_budget", [64 << 20, None], ids=["bounded pool", "unbounded pool"])
def test_a_cache_the_address_space_cannot_hold_is_refused_at_once(memory_budget: int | None) -> None:
    """A million slots at a million tokens each: refused before anything is built (it used to
    build a million slots for 7 s and then fail in mmap with a bare ENOMEM)."""
    shape = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "page_size": 64 << 10}
    config = KVCacheConfig(**shape, max_slots=2**20, max_context=2**20, memory_budget=memory_budget)
    started = time.monotonic()
    with pytest.raises(ConfigurationError, match=r"address space .* use fewer max_slots or a shorter max_context"):
        KVCache(config)
    assert time.monotonic() - started < 1  # about 5 ms here; the issue asks for 100 ms, this allows a loaded machine


def test_failed_batch_map_is_rolled_back(make_vmm: Callable[..., VMMBackend]) -> None:
    backend = make_vmm(max_pages=4, reservations=1, reservation_bytes=4 * 4096)
    base = backend.reserve(4 * 4096)
    pages = backend.create_pages(2)
    with pytest.raises(OSError, match="mapping page 1 of 2"):
        backend.map([base, base + 4096 + 1], pages)  # second address is misaligned
    if isinstance(backend, HostBackend):
        assert backend.populate([base]) == 0  # the first page was unmapped again
    backend.map([base], pages[:1])  # the CUDA driver refuses a map over a mapped page
    assert backend.populate([base]) == 1
    backend.free_reservation(base, 4 * 4096, [base])
    backend.release_pages(pages)


def test_a_page_can_be_mapped_at_two_addresses(make_vmm: Callable[..., VMMBackend]) -> None:
    check_page_sharing(make_vmm(max_pages=4, reservations=2, reservation_bytes=8 * 4096))


def test_native_library_is_built_and_required_when_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    assert native.native_available(), "make test builds vattn/libvattn_native.so"
    assert host_calls.select_host_calls(None).name == "native"
    monkeypatch.setattr(native, "NATIVE_LIBRARY", native.NATIVE_LIBRARY.with_name("missing.so"))
    assert host_calls.select_host_calls(None).name == "ctypes"
    with pytest.raises(RuntimeError, match="make native"):
        host_calls.select_host_calls(True)


def test_a_preallocated_pool_has_every_page_made_and_backed_at_start(make_cache: MakeCache) -> None:
    """With `preallocate` every page the pool may hold is created, free, when the cache is made
    (on the host: the memfd's memory allocated, as its blocks show); requests then take those
    pages and none fresh. Without it a cache holds nothing physical until it maps (here nothing:
    no background thread pre-maps a slot)."""
    budget = 96 * 4096
    lazy = make_cache(memory_budget=budget, background=False)
    eager = make_cache(memory_budget=budget, preallocate=True)
    assert lazy.stats().pages_created == 0
    assert eager.stats().pages_created == eager.stats().pool_pages == 96
    if isinstance(eager.backend, HostBackend):
        for cache, backed in ((lazy, 0), (eager, budget)):
            assert os.fstat(cache.backend.pool_fd()).st_blocks * 512 == backed
    lengths = {eager.alloc_reqid(): 50, eager.alloc_reqid(): 120}
    eager.step(lengths)
    for reqid, length in lengths.items():
        write_all(eager, reqid, length, 0)
        check_all(eager, reqid, length, 0)
    eager.wait_for_background()
    stats = eager.stats()
    assert stats.fresh_pages_taken == 0 and stats.pages_created == 96 and stats.recycled_pages_taken > 0
    eager.check_invariants()


def test_a_preallocation_the_machine_cannot_hold_is_refused_at_once() -> None:
    """Twice the machine's memory to preallocate: ConfigurationError with the fix, nothing allocated."""
    shape = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "page_size": 2 << 20, "max_slots": 64}
    budget = 2 * os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    config = KVCacheConfig(**shape, max_context=2**20, memory_budget=budget, preallocate=True)
    with pytest.raises(ConfigurationError, match=r"lower the KV budget .* or do not preallocate"):
        KVCache(config)
