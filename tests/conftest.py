"""Shared fixtures: every cache test runs through both the C library and ctypes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fuzz import register_profiles
from tests.process_memory import release_memory
from vattn import KVCache, KVCacheConfig

register_profiles()

SMALL_SHAPE: dict[str, Any] = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 16, "dtype": "float32"}
"""128 B per token per layer: a 4 KiB page holds 32 tokens, so page boundaries are cheap to cross."""


@pytest.fixture(params=[True, False], ids=["native", "ctypes"])
def native(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
def make_cache(native: bool) -> Iterator[Callable[..., KVCache]]:
    """Builds caches with SMALL_SHAPE defaults and the fixture's call path; closes them after."""
    caches: list[KVCache] = []

    def make(**overrides: Any) -> KVCache:
        fields = {**SMALL_SHAPE, "max_slots": 8, "max_context": 1000, "page_size": 4096, "native": native}
        cache = KVCache(KVCacheConfig(**{**fields, **overrides}))
        caches.append(cache)
        assert cache.backend.calls.name == ("native" if native else "ctypes")
        return cache

    yield make
    for cache in caches:
        cache.close()


@pytest.fixture(autouse=True, scope="module")
def _give_memory_back() -> Iterator[None]:
    """After each module, what its engines left behind goes back to the OS."""
    yield
    release_memory()
