"""Geometry and validation of KVCacheConfig."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from vattn import KVCacheConfig

SHAPE: dict[str, Any] = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64, "max_slots": 4, "max_context": 1000}


def test_any_context_rounds_the_slot_to_whole_pages() -> None:
    config = KVCacheConfig(**SHAPE, dtype="float16", page_size=64 * 1024)
    assert config.bytes_per_token == 3 * 64 * 2
    assert config.max_slot_groups == 6  # 1000 * 384 B = 375 KiB -> 6 pages of 64 KiB, not a power of two
    assert config.slot_stride == 6 * 64 * 1024
    assert config.pages_for(0) == 0
    assert config.pages_for(170) == 1 and config.pages_for(171) == 2
    assert config.tokens_in(1) == 170
    assert config.tokens_in(config.max_slot_groups) == 1000


def test_mega_layout_has_two_buffers_and_grows_by_whole_tokens_of_all_layers() -> None:
    per_layer = KVCacheConfig(**SHAPE, dtype="float16", page_size=64 * 1024)
    mega = KVCacheConfig(**SHAPE, dtype="float16", page_size=64 * 1024, layout="mega")
    assert per_layer.num_buffers == 60 and mega.num_buffers == 2
    assert mega.bytes_per_token == 30 * per_layer.bytes_per_token
    # A 100-token request: per layer it maps 60 pages (3.75 MiB), in one mega tensor 2 x 18 (2.25 MiB).
    assert per_layer.pages_for(100) * per_layer.num_buffers == 60
    assert mega.pages_for(100) * mega.num_buffers == 2 * 18


def test_budget_limits_the_pool_and_defaults_to_full_capacity() -> None:
    full = KVCacheConfig(**SHAPE, page_size=64 * 1024)
    assert full.dtype is torch.float16
    assert full.pool_pages == 4 * full.max_slot_groups * 60
    budget = KVCacheConfig(**SHAPE, page_size=64 * 1024, memory_budget=100 * 64 * 1024)
    assert budget.pool_pages == 100


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_layers": 0}, "num_layers must be a positive integer"),
        ({"num_kv_heads": -1}, "num_kv_heads must be a positive integer"),
        ({"head_dim": 2.5}, "head_dim must be a positive integer"),
        ({"max_slots": True}, "max_slots must be a positive integer"),
        ({"max_context": 0}, "max_context must be a positive integer"),
        ({"page_size": 0}, "page_size must be a positive integer"),
        ({"dtype": "uint8"}, "dtype must be one of"),
        ({"dtype": "int8", "num_kv_heads": 1, "head_dim": 6}, "an int8 cache needs num_kv_heads x head_dim divisible"),
        ({"dtype": torch.int32}, "dtype must be one of"),
        ({"layout": "paged"}, "layout must be one of"),
        ({"reclaim_watermark": 1.0}, "reclaim_watermark must be in"),
        ({"prefix_cache_share": -0.1}, "prefix_cache_share must be in"),
        ({"prefix_cache_share": "all"}, "prefix_cache_share must be in"),
        ({"lookahead_tokens": -1}, "lookahead_tokens must be an integer >= 0"),
        ({"eager_pages": -2}, "eager_pages must be an integer >= 0"),
        ({"memory_budget": 0}, "memory_budget must be a positive integer"),
        ({"memory_budget": 64 * 1024}, "one page group of this layout needs 60"),
    ],
)
def test_bad_config_raises_value_error(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KVCacheConfig(**{**SHAPE, "page_size": 64 * 1024, **overrides})


def test_a_large_kv_budget_gets_host_pages_the_map_count_can_hold() -> None:
    """EngineConfig's default host page: 64 KiB for the default budget, doubled for budgets whose
    pages could otherwise need more memory mappings than vm.max_map_count allows (2 GiB of 64 KiB
    pages was refused at start under the usual 65,530); a cache of that budget is then built."""
    from serving.config import MAP_COUNT_SHARE, EngineConfig, host_page_size
    from vattn import KVCache
    from vattn.backends.host import max_map_count

    assert EngineConfig().page_size == 64 * 1024
    limit = MAP_COUNT_SHARE * max_map_count()
    for budget in (1 << 30, 2 << 30, 16 << 30):
        page = host_page_size(budget)
        assert 2 * (budget // page) <= limit and (page == 64 * 1024 or 2 * (budget // (page // 2)) > limit)
    page = EngineConfig(kv_budget=2 << 30).page_size
    shape = {**SHAPE, "max_slots": 48, "max_context": 2048, "dtype": "float32"}
    KVCache(KVCacheConfig(**shape, memory_budget=2 << 30, page_size=page)).close()
