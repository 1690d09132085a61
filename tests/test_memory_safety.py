"""The allocator's storage rule, one reproduction per way a view used to reach memory not its own.

Where the old behaviour killed the process the reproduction runs in a child interpreter,
so a regression fails the test instead of the test run.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
import torch

from vattn import KVCache, OutOfPagesError, OutOfSlotsError
from vattn.kernels import make_kernel

MakeCache = Callable[..., KVCache]

PRELUDE = """
import os, threading, time
import torch
from vattn import ConfigurationError, KVCache, KVCacheConfig, OutOfPagesError
from vattn.backends.host import current_map_count

def make(**overrides):
    fields = dict(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", max_slots=4,
                  max_context=1000, page_size=4096, backend=BACKEND)
    return KVCache(KVCacheConfig(**{**fields, **overrides}))
"""

ON_FAKE_CUDA = """
from tests.fake_cuda import FakeDriver, installed
FAKE = FakeDriver(granularity=4096, memory=256 << 20)
INSTALLED = installed(FAKE)  # for the whole interpreter
INSTALLED.__enter__()
"""


def run_isolated(body: str, backend: str = "host") -> str:
    """Runs `body` after PRELUDE in a fresh interpreter (on the fake CUDA driver for "cuda");
    fails on a crash or a non-zero exit."""
    setup = f"BACKEND = {backend!r}\n" + (ON_FAKE_CUDA if backend == "cuda" else "")
    code = setup + PRELUDE + textwrap.dedent(body)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_a_freed_slot_is_not_handed_out_while_its_old_views_live(make_cache: MakeCache) -> None:
    cache = make_cache(max_slots=2)
    a = cache.alloc_reqid()
    cache.step({a: 100})
    stale, _ = cache.kv(0, a)
    stale.fill_(1)
    cache.free_reqid(a)
    b = cache.alloc_reqid()
    assert b != a, "the slot a live view can reach was handed out again"
    cache.step({b: 100})
    cache.kv(0, b)[0].fill_(2)
    stale.fill_(7)  # writes only into request a's own, finished memory
    assert torch.all(cache.kv(0, b)[0] == 2)
    with pytest.raises(OutOfSlotsError, match="1 freed ones wait for their old views"):
        cache.alloc_reqid()
    assert cache.stats().pinned_slots == 1
    del stale, _
    assert cache.alloc_reqid() == a  # reclaimed once the views died, pages still mapped
    assert cache.stats().pinned_slots == 0


def test_views_stay_mapped_through_release_idle_and_reclamation(make_cache: MakeCache) -> None:
    step = 8 * 4096  # one page in each of the 8 virtual tensors
    cache = make_cache(max_slots=2, memory_budget=40 * step, background=False)  # 40 steps of 32 tokens
    a = cache.alloc_reqid()
    cache.step({a: 1000})
    keys, _ = cache.kv(0, a)
    keys.fill_(3)
    cache.step({a: 10})  # a shrink: the tail is reclaimable, but the view still reaches it
    b = cache.alloc_reqid()
    with pytest.raises(OutOfPagesError):
        cache.step({b: 1000})
    cache.free_reqid(a)
    cache.release_idle()
    assert torch.all(keys == 3) and cache.stats().idle_bytes == 32 * step
    del keys, _
    cache.step({b: 1000})  # now a's pages can go
    cache.release_idle()
    assert cache.stats().idle_bytes == 0


def test_views_outlive_close_and_are_freed_with_their_last_tensor(backend: str) -> None:
    run_isolated(
        """
        def scenario():
            cache = make()
            a = cache.alloc_reqid()
            cache.step({a: 500})
            keys, values = cache.kv(1, a)
            keys.fill_(5)
            cache.close()
            assert keys.sum().item() == 5 * keys.numel()  # used to kill the process (SIGSEGV)
            values.fill_(1)
            assert current_map_count() > maps
            del keys
            assert current_map_count() > maps, "freed while a view still lived"

        maps = 0
        scenario()  # a first run loads libraries and starts torch's threads, which stay
        maps, fds = current_map_count(), len(os.listdir("/proc/self/fd"))
        scenario()
        assert current_map_count() == maps and len(os.listdir("/proc/self/fd")) == fds
    """,
        backend,
    )


def test_a_view_of_a_closed_cache_never_reaches_the_next_cache(backend: str) -> None:
    run_isolated(
        """
        first = make()
        a = first.alloc_reqid()
        first.step({a: 200})
        stale, _ = first.kv(0, a)
        first.close()
        second = make()
        b = second.alloc_reqid()
        second.step({b: 200})
        fresh, _ = second.kv(0, b)
        fresh.fill_(2)
        stale.fill_(9)  # used to land in the second cache (same address range, reused)
        assert torch.all(fresh == 2)
        assert abs(stale.data_ptr() - fresh.data_ptr()) >= second.config.reservation_bytes
    """,
        backend,
    )


def test_close_while_other_threads_write_through_views(backend: str) -> None:
    run_isolated(
        """
        cache = make(max_slots=4)
        views = []
        for _ in range(4):
            r = cache.alloc_reqid()
            cache.step({r: 900})
            views.append(cache.kv(0, r)[0])
        stop = time.monotonic() + 1.0
        def write(view):
            while time.monotonic() < stop:
                view.fill_(1.0)
                view.sum()
        threads = [threading.Thread(target=write, args=(v,)) for v in views]
        for t in threads:
            t.start()
        time.sleep(0.2)
        cache.close()  # used to unmap under the writers (SIGSEGV)
        for t in threads:
            t.join()
        print("ok")
    """,
        backend,
    )


def test_an_int_subclass_cannot_name_one_slot_twice() -> None:
    run_isolated("""
        class Twin(int):
            def __hash__(self):
                return 12345
            def __index__(self):
                return 3
        cache = make()
        a = cache.alloc_reqid()
        before = cache.stats()
        try:
            cache.step({a: 100, Twin(a): 300})  # used to map the slot's pages twice
        except ValueError as exc:
            assert "listed twice" in str(exc)
        else:
            raise AssertionError("accepted two keys for one slot")
        after = cache.stats()
        assert (after.mapped_bytes, after.pages_per_slot) == (before.mapped_bytes, before.pages_per_slot)
        cache.step({Twin(a): 300})  # read by its value (a), not its __index__ (3)
        assert cache.lengths([a]) == [300] and len(cache.page_table(a)) == cache.config.pages_for(300)
        cache.close()
    """)


def test_the_map_count_budget_is_shared_by_every_cache_in_the_process() -> None:
    run_isolated("""
        from vattn.backends.host import max_map_count
        pages = int(0.35 * max_map_count()) // 2  # each cache alone fits; three do not
        def budgeted():
            return make(num_layers=1, max_slots=2, max_context=pages * 32, memory_budget=pages * 4096)
        first, second = budgeted(), budgeted()
        try:
            budgeted()
        except ValueError as exc:
            assert "other caches may need" in str(exc), exc
        else:
            raise AssertionError("a third cache was allowed past vm.max_map_count")
        for cache in (first, second):  # interleaved growth: every page a mapping of its own
            a, b = cache.alloc_reqid(), cache.alloc_reqid()
            for n in range(32, pages // 4 * 32 + 1, 32):
                cache.step({a: n, b: n})
            cache.free_reqid(a)
            cache.release_idle()
        first.close()
        third = budgeted()
        second.close()
        third.close()
    """)


def test_a_failed_constructor_and_a_dropped_cache_leave_nothing_behind() -> None:
    run_isolated("""
        import gc
        def held():
            threads = sum(t.name == "vattn-mapper" for t in threading.enumerate())
            return len(os.listdir("/proc/self/fd")), current_map_count(), threads

        def scenario(rounds):
            for _ in range(rounds):  # 1 PiB of address space: refused before anything is made
                try:
                    make(num_layers=1, head_dim=128, max_slots=2**10, max_context=2**30, memory_budget=1 << 20)
                except ConfigurationError as exc:
                    assert "address space" in str(exc)
            for _ in range(rounds):
                cache = make()  # dropped without close()
                cache.step({cache.alloc_reqid(): 300})
            del cache
            gc.collect()
            for thread in threading.enumerate():
                if thread.name == "vattn-mapper":
                    thread.join(5)

        scenario(5)  # a first run loads libraries and starts torch's threads, which stay
        (fds, maps, threads) = baseline = held()
        scenario(50)  # a leak held 1 fd, about 40 mappings and a thread per cache
        now = held()
        assert now[0] == fds and now[2] == threads and now[1] <= maps + 16, (now, baseline)  # + glibc's thread arenas
    """)


def test_a_forked_child_cannot_write_into_the_parents_pages() -> None:
    out = run_isolated("""
        cache = make()
        a = cache.alloc_reqid()
        cache.step({a: 300})
        keys, _ = cache.kv(0, a)
        keys.fill_(1)
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                keys.fill_(7)  # lands in the child's private zero pages
                try:
                    cache.alloc_reqid()
                except RuntimeError as exc:
                    code = 0 if "forked" in str(exc) else 2
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert torch.all(keys == 1)
        del keys, _
        cache.free_reqid(a)
        b = cache.alloc_reqid()  # the parent's next request gets the same pages back
        cache.step({b: 300})
        assert not torch.any(cache.kv(0, b)[0] == 7)
        print("parent ok")
    """)
    assert "parent ok" in out


def test_an_attention_batch_holds_its_slots_until_dropped(make_cache: MakeCache) -> None:
    cache = make_cache(max_slots=1)
    kernel = make_kernel("sdpa", cache, num_query_heads=4)
    a = cache.alloc_reqid()
    cache.step({a: 4})
    q = torch.randn(4, 4, 16)
    kv = torch.randn(4, 2, 16)
    batch = kernel.plan([a], [4])
    kernel.forward(0, batch, q, kv, kv)
    cache.free_reqid(a)
    assert cache.num_free_slots() == 0  # the batch still holds the slot
    del batch
    assert cache.num_free_slots() == 1 and cache.alloc_reqid() == a


def test_views_and_gathers_of_several_requests(make_cache: MakeCache) -> None:
    cache = make_cache(max_slots=3)
    a, b, c = (cache.alloc_reqid() for _ in range(3))
    cache.step({a: 20, b: 30, c: 25})
    rows, _ = cache.kv_batch(0, [a, b, c])  # consecutive slots: one view, holding all three
    gathered, _ = cache.kv_batch(0, [c, a])  # a copy, holding nothing
    for r in (a, b, c):
        cache.free_reqid(r)
    assert cache.num_free_slots() == 0
    del rows, _
    assert cache.num_free_slots() == 3
    assert gathered.shape == (2, 25, 2, 16)
