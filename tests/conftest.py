"""Shared fixtures: every cache test runs through both the C library and the Python calls, on
the host backend and on the CUDA backend over the fake driver (tests/fake_cuda)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from tests.fake_cuda import FakeDriver, installed
from tests.fuzz import register_profiles
from tests.process_memory import release_memory
from vattn import KVCache, KVCacheConfig
from vattn.backends import VMMBackend
from vattn.backends.cuda import CudaBackend
from vattn.backends.host import HostBackend

register_profiles()

SMALL_SHAPE: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
"""128 B per token per layer: a 4 KiB page holds 32 tokens, so page boundaries are cheap to cross."""


OPS_THREADS = 4
"""Threads the native operators' tests run on (tests/test_kernels.py etc.: `several_threads`),
whatever a worker has, so the shares each thread takes are checked too."""


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist (`make test` runs a worker a core), each worker and the servers it
    starts share the cores out instead of each spinning up a thread per core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


SLOWEST_FILES = (
    "test_engine.py",
    "test_cuda_dry_run.py",
    "test_kernels.py",
    "test_replicas.py",
    "test_cli.py",
    "test_server_api.py",
    "test_fake_cuda_bites.py",
    "test_api_parity.py",
    "test_memory_safety.py",
)
"""The files that took longest on a 2-core VM (`pytest --durations`): `make test`'s workers take
files in collection order as they free up, so these go first and the workers finish together."""


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order


@pytest.fixture
def several_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(OPS_THREADS)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(params=[True, False], ids=["native", "ctypes"])
def native(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture(params=["host", "cuda"], ids=["host", "fakecuda"])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fake_cuda(backend: str) -> Iterator[FakeDriver | None]:
    """For the cuda backend, a fake driver with the host's page granularity, checked for leaks
    and contract violations at the end."""
    if backend != "cuda":
        yield None
        return
    with installed(FakeDriver(granularity=4096, memory=256 << 20)) as driver:
        yield driver
        release_memory()  # caches a test dropped (and their backends) go now, inside the fake
    assert not driver.violations, driver.violations
    assert not driver.leaks(), f"left behind: {driver.leaks()}"


@pytest.fixture
def make_vmm(native: bool, backend: str, fake_cuda: FakeDriver | None) -> Iterator[Callable[..., VMMBackend]]:
    """Builds bare VMM backends with 4 KiB pages (the fixture's backend and call path); closes them after."""
    backends: list[VMMBackend] = []

    def make(max_pages: int, reservations: int, reservation_bytes: int) -> VMMBackend:
        if backend == "host":
            made: VMMBackend = HostBackend(4096, max_pages, reservations, reservation_bytes, native)
        else:
            made = CudaBackend(4096, max_pages, native)
        backends.append(made)
        return made

    yield make
    for made in backends:
        made.close()


@pytest.fixture
def make_cache(native: bool, backend: str, fake_cuda: FakeDriver | None) -> Iterator[Callable[..., KVCache]]:
    """Builds caches with SMALL_SHAPE defaults, the fixture's backend and call path; after the
    test, checks that the background mapper never failed and closes them."""
    caches: list[KVCache] = []
    python_calls = {"host": "ctypes", "cuda": "cuda-python"}[backend]

    def make(**overrides: Any) -> KVCache:
        fields = {
            **SMALL_SHAPE,
            "max_slots": 8,
            "max_context": 1000,
            "page_size": 4096,
            "native": native,
            "backend": backend,
        }
        cache = KVCache(KVCacheConfig(**{**fields, **overrides}))
        caches.append(cache)
        assert cache.backend.calls.name == ("native" if native else python_calls)
        return cache

    yield make
    for cache in caches:
        errors = cache.stats().background_errors
        cache.close()
        assert errors == 0, "the background mapper failed (step() mapped synchronously instead)"


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back() -> Iterator[None]:
    """After each module, what its engines left behind goes back to the OS."""
    yield
    release_memory()


def pytest_unconfigure(config: pytest.Config) -> None:
    """The run's last line, for tests skipped because a peer tool is missing (vllm-router), so a
    green run without it is not mistaken for one that covered it."""
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    missing: dict[str, int] = {}
    for report in reporter.stats.get("skipped", []) if reporter else []:
        reason = str(report.longrepr[2]) if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if "could not be installed" in reason:
            tool = reason.removeprefix("Skipped: ").split(" could not be installed")[0]
            missing[tool] = missing.get(tool, 0) + 1
    for tool, count in missing.items():
        reporter.write_line(
            f"NOT COVERED: {count} tests skipped because {tool} could not be installed here (`make router`)",
            yellow=True,
            bold=True,
        )
