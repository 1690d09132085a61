"""The CUDA backend's control logic on the fake driver (tests/fake_cuda): what only CUDA has.

The allocator tests the host backend runs (alloc/step/free/reuse, sharing, forks, leases,
close with live views, the background thread) run on the fake too, through conftest's
`backend` parameter. Here: the stateful test, failures the driver reports part-way, GPU work
still queued when pages go, torch's cached memory, a forked child. None of it proves GPU
behaviour: tests/test_cuda.py does that on a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
from test_stateful import CacheMachine, run_machine

from tests.fake_cuda import FakeDriver, HostGpu, installed
from tests.process_memory import release_memory
from vattn import KVCache, KVCacheConfig, OutOfPagesError
from vattn.backends.base import MapError
from vattn.backends.cuda import CudaBackend

SHAPE = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32", "max_slots": 4, "max_context": 512}
"""128 B per token per layer: a 4 KiB page holds 32 tokens."""


@pytest.fixture
def fake() -> Iterator[FakeDriver]:
    with installed(FakeDriver(granularity=4096, memory=64 << 20)) as driver:
        yield driver
        release_memory()
    assert not driver.violations, driver.violations
    assert not driver.leaks(), f"left behind: {driver.leaks()}"


def cuda_cache(native: bool, **overrides: object) -> KVCache:
    return KVCache(KVCacheConfig(**{**SHAPE, "page_size": 4096, "backend": "cuda", "native": native, **overrides}))


class FakeCudaMachine(CacheMachine):
    backend = "cuda"


def test_random_operations_keep_the_invariants_on_the_fake_driver(fake: FakeDriver) -> None:
    run_machine(FakeCudaMachine, examples=25, steps=40, min_operations=500)


@pytest.mark.parametrize("call", ["cuMemMap", "cuMemSetAccess"])
def test_a_batch_failing_halfway_is_rolled_back_and_changes_nothing(fake: FakeDriver, native: bool, call: str) -> None:
    with cuda_cache(native, background=False) as cache:
        reqid = cache.alloc_reqid()
        cache.step({reqid: 40})
        before = cache.stats()
        fake.fail(call, at=3)  # 200 tokens need 5 more page groups x 4 tensors: the 3rd page fails
        with pytest.raises(MapError, match=r"mapping page 2 of \d+ failed: CUDA_ERROR_INVALID_VALUE"):
            cache.step({reqid: 200})
        after = cache.stats()
        assert (after.mapped_bytes, after.used_bytes) == (before.mapped_bytes, before.used_bytes)
        cache.step({reqid: 200})  # the driver works again: the same pages map, nothing was left mapped


def test_a_rollback_that_cannot_unmap_strands_the_pages_until_close(fake: FakeDriver, native: bool) -> None:
    with cuda_cache(native, background=False) as cache:
        reqid = cache.alloc_reqid()
        fake.fail("cuMemMap", at=3)
        fake.fail("cuMemUnmap", at=1)  # the rollback's first unmap
        with pytest.raises(OSError, match="mapping page 2"):
            cache.step({reqid: 200})
        cache.step({reqid: 200})  # around the stranded address: other pages, other addresses
    # the fixture checks that close unmapped the stranded page and released everything


def test_running_out_of_device_memory_is_out_of_pages_and_changes_nothing(fake: FakeDriver, native: bool) -> None:
    with cuda_cache(native, background=False) as cache:
        reqid = cache.alloc_reqid()
        cache.step({reqid: 40})
        fake.fail("cuMemCreate", at=3, error=fake.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        with pytest.raises(OutOfPagesError):
            cache.step({reqid: 200})
        assert cache.backend.live_pages == cache.stats().mapped_bytes // 4096 + 1  # the probe page
        cache.step({reqid: 200})


def test_torch_gives_back_its_cached_memory_before_the_cache_runs_out() -> None:
    driver = FakeDriver(granularity=4096, memory=40 * 4096)
    gpu = HostGpu(driver, cached=32 * 4096)  # torch's allocator holds most of the device
    with installed(driver, gpu):
        backend = CudaBackend(4096, max_pages=36, native=False)  # 8 free + 32 cached: fits
        pages = backend.create_pages(20)
        assert gpu.cached == 0 and len(pages) == 20
        backend.release_pages(pages)
        backend.close()
    assert not driver.leaks()


@pytest.mark.parametrize("unmapped_by", ["release_idle", "step"])
def test_an_unmap_waits_for_the_queued_work_on_its_pages_and_no_other(
    fake: FakeDriver, native: bool, unmapped_by: str
) -> None:
    """A kernel queued while a view of a request lived still runs when the view dies and the
    request ends: unmapping its pages waits for it (the fence its lease left), not for a kernel
    queued afterwards on other pages, and never for the whole device."""
    budget = 16 * 4 * 4096  # 16 page groups of 4 tensors: two requests of 256 tokens fill it
    with cuda_cache(native, background=False, memory_budget=budget) as cache:
        ended, other = cache.alloc_reqid(), cache.alloc_reqid()
        cache.step({ended: 256, other: 256})
        keys, values = cache.kv(0, ended)
        read = keys.data_ptr()
        fake.launch(read, keys.nbytes)  # a kernel reading the request's keys is queued
        del keys, values  # the lease dies: its slot is fenced after that kernel
        unrelated, unrelated_values = cache.kv(0, other)
        later = unrelated.data_ptr()
        fake.launch(later, unrelated.nbytes)  # queued after the fence
        cache.free_reqid(ended)
        if unmapped_by == "release_idle":
            cache.release_idle()
        else:
            cache.step({other: 512})  # needs the ended request's pages: reclaims them
        assert cache.stats().mapped_bytes == (16 if unmapped_by == "step" else 8) * 4 * 4096
        assert not fake.violations, fake.violations
        assert not fake.queued(read)  # the unmap waited for it
        assert fake.queued(later)  # and not for this
        assert fake.calls["cuCtxSynchronize"] == 0 and fake.calls["cuEventSynchronize"] > 0
        del unrelated, unrelated_values
    assert not fake.queued(later)  # closing the cache waits for everything


def test_an_unmap_waits_for_the_fence_of_every_stream_that_used_the_pages(fake: FakeDriver, native: bool) -> None:
    """A slot keeps the latest fence of each stream: a later lease dying on another stream does
    not replace the fence of work still queued on the first."""
    with cuda_cache(native, background=False) as cache:
        reqid = cache.alloc_reqid()
        cache.step({reqid: 100})
        gpu, side = cache.backend.gpu, fake.new_stream()
        gpu.stream = side
        keys, _ = cache.kv(0, reqid)
        fake.launch(keys.data_ptr(), keys.nbytes, stream=side)
        del keys, _  # fenced on the side stream
        gpu.stream = 0
        keys, _ = cache.kv(1, reqid)
        fake.launch(keys.data_ptr(), keys.nbytes)
        del keys, _  # fenced on stream 0
        cache.free_reqid(reqid)
        cache.release_idle()
        assert not fake.violations, fake.violations
        assert fake.calls["cuCtxSynchronize"] == 0


def test_a_fence_that_cannot_be_recorded_makes_the_unmap_wait_for_everything(fake: FakeDriver, native: bool) -> None:
    with cuda_cache(native, background=False) as cache:
        reqid = cache.alloc_reqid()
        cache.step({reqid: 100})
        keys, values = cache.kv(0, reqid)
        fake.launch(keys.data_ptr(), keys.nbytes)
        fake.fail("cuEventRecord")
        del keys, values  # its event is created, not recorded: destroyed (the fixture counts events)
        cache.free_reqid(reqid)
        cache.release_idle()
        assert not fake.violations, fake.violations
        assert fake.calls["cuCtxSynchronize"] == 1


def test_a_fake_event_completes_the_work_queued_before_it_on_its_stream(fake: FakeDriver) -> None:
    backend = CudaBackend(4096, max_pages=4, native=False)  # initialises the fake, its context current
    ok, bad = (fake.CUresult.CUDA_SUCCESS,), (fake.CUresult.CUDA_ERROR_INVALID_HANDLE,)
    try:
        err, event = fake.cuEventCreate(int(fake.CUevent_flags.CU_EVENT_DISABLE_TIMING))
        assert err == ok[0]
        fake.launch(0x1000, 16)
        assert fake.cuEventSynchronize(event) == ok and fake.queued(0x1000)  # never recorded: no work
        side = fake.new_stream()
        fake.launch(0x2000, 16, stream=side)
        assert fake.cuEventRecord(event, 0) == ok
        fake.launch(0x3000, 16)
        assert fake.cuEventSynchronize(event) == ok
        assert [fake.queued(addr) for addr in (0x1000, 0x2000, 0x3000)] == [False, True, True]
        assert fake.cuEventRecord(event, 0x1234) == bad  # no such stream
        assert fake.cuEventDestroy(event) == ok
        assert fake.cuEventSynchronize(event) == bad
        assert fake.cuCtxSynchronize() == ok and not fake.queued(0x2000)
    finally:
        backend.close()


def test_a_failed_constructor_gives_the_context_back(fake: FakeDriver) -> None:
    with pytest.raises(ValueError, match="multiple of the CUDA granularity 4096"):
        CudaBackend(4096 + 2048, max_pages=4, native=False)
    with pytest.raises(ValueError, match=r"GPU has .* free: set memory_budget"):
        CudaBackend(4096, max_pages=1 << 20, native=True)


def test_a_forked_child_makes_no_driver_call(fake: FakeDriver) -> None:
    """CUDA cannot be used in a child made by fork(): the fake refuses every call there, as the
    driver does; the child's copy of the cache neither calls it nor touches the parent's pages."""
    with cuda_cache(False) as cache:
        reqid = cache.alloc_reqid()
        cache.step({reqid: 100})
        pid = os.fork()
        if pid == 0:  # the child: every way of letting go of the cache, and then a direct call
            code = 0
            try:
                calls = sum(fake.calls.values())
                cache.close()
                del cache
                release_memory()
                code |= 1 if sum(fake.calls.values()) != calls else 0
                code |= 2 if fake.cuCtxSynchronize() != (fake.CUresult.CUDA_ERROR_NOT_INITIALIZED,) else 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        cache.step({reqid: 200})  # the parent goes on
