"""The paged baseline: the block-table cache's lifecycle and its kernels against float64 attention."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from checks import check_kernel
from conftest import SMALL_SHAPE

from vattn import OutOfPagesError, OutOfSlotsError, UnavailableError
from vattn.paged import PAGED_KERNELS, PagedKVCache, PagedKVCacheConfig, make_paged_kernel

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads

CPU_PAGED_KERNELS = ["paged", "paged_gather", "paged_blockwise"]


def paged_cache(**overrides: Any) -> PagedKVCache:
    fields = {**SMALL_SHAPE, "max_slots": 8, "max_context": 1000, "block_size": 16}
    return PagedKVCache(PagedKVCacheConfig(**{**fields, **overrides}))


@pytest.mark.parametrize("kernel", CPU_PAGED_KERNELS)
@pytest.mark.parametrize("block_size", [16, 7])
def test_paged_kernels_match_reference_through_chunked_prefill_and_decode(kernel: str, block_size: int) -> None:
    check_kernel(kernel, paged_cache(block_size=block_size), query_heads=8, tolerance=1e-5)


@pytest.mark.parametrize("kernel", CPU_PAGED_KERNELS)
def test_paged_kernels_at_long_contexts_with_few_requests(kernel: str) -> None:
    """Fewer work items than OPS_THREADS: the native kernel splits keys."""
    long_context = [{"a": 600, "b": 20}, {"a": 20, "b": 1}, {"a": 1, "b": 1}, {"a": 1}]
    check_kernel(kernel, paged_cache(), query_heads=8, tolerance=1e-5, iterations=long_context)


@pytest.mark.parametrize("kernel", CPU_PAGED_KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_paged_kernels_in_half_precision(kernel: str, dtype: str) -> None:
    check_kernel(kernel, paged_cache(dtype=dtype), query_heads=4, tolerance=2e-2)


@pytest.mark.parametrize("block_size", [16, 5])
def test_the_paged_kernel_reads_and_writes_an_int8_cache(block_size: int) -> None:
    """The virtual cache's int8 rows and qparams, through the block table: stored exactly as
    quantized, attention over them within float32 rounding, short and split long contexts."""
    check_kernel("paged", paged_cache(dtype="int8", block_size=block_size), query_heads=8, tolerance=1e-5)
    long_context = [{"a": 600, "b": 20}, {"a": 20, "b": 1}, {"a": 1, "b": 1}, {"a": 1}]
    check_kernel("paged", paged_cache(dtype="int8"), query_heads=8, tolerance=1e-5, iterations=long_context)
    for name in ("paged_gather", "paged_blockwise"):
        with pytest.raises(ValueError, match=f"the {name} kernel cannot read an int8 KV cache"):
            make_paged_kernel(name, paged_cache(dtype="int8"), num_query_heads=8)


def test_blocks_come_and_go_all_or_nothing() -> None:
    cache = paged_cache(memory_budget=10 * 16 * 128 * 4 * 2)  # 10 blocks of 16 tokens
    assert cache.config.num_blocks == 10
    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    cache.step({a: 100})  # 7 blocks
    assert cache.stats().pages_per_slot[a] == 7 and cache.num_free_blocks == 3
    with pytest.raises(OutOfPagesError):
        cache.step({a: 110, b: 60})  # 4 more for b: nothing may change
    assert cache.lengths([a, b]) == [100, 0] and cache.num_free_blocks == 3
    assert not cache.can_admit(64) and cache.can_admit(48)
    blocks_of_a = cache.block_table[a, :7].tolist()
    cache.free_reqid(a)
    assert cache.num_free_blocks == 10
    cache.step({b: 160})
    assert sorted(cache.block_table[b, :10].tolist()) == list(range(10))
    assert set(blocks_of_a) <= set(cache.block_table[b, :10].tolist())


def test_a_request_reads_back_what_it_wrote_across_scattered_blocks() -> None:
    cache = paged_cache(block_size=4)
    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    for length in range(1, 13):  # interleaved growth scatters both requests' blocks
        cache.step({a: length, b: length})
    assert cache.block_table[a, :3].tolist() == [0, 2, 4] and cache.block_table[b, :3].tolist() == [1, 3, 5]
    kernel = make_paged_kernel("paged_gather", cache, num_query_heads=2)
    batch = kernel.plan([a, b], [12, 12])
    k = torch.randn(24, SMALL_SHAPE["num_kv_heads"], SMALL_SHAPE["head_dim"])
    kernel.forward(0, batch, torch.randn(24, 2, SMALL_SHAPE["head_dim"]), k, k.clone())
    assert torch.equal(cache.kv(0, a)[0], k[:12]) and torch.equal(cache.kv(0, b)[0], k[12:])


def test_slots_and_bad_calls_get_clear_errors() -> None:
    cache = paged_cache(max_slots=1)
    reqid = cache.alloc_reqid()
    with pytest.raises(OutOfSlotsError):
        cache.alloc_reqid()
    with pytest.raises(ValueError, match="max_context"):
        cache.step({reqid: 1001})
    with pytest.raises(ValueError, match="reqid must be"):
        cache.free_reqid(1)
    kernel = make_paged_kernel("paged", cache, num_query_heads=2)
    cache.step({reqid: 3})
    with pytest.raises(ValueError, match="new tokens"):
        kernel.plan([reqid], [4])
    with pytest.raises(ValueError, match="unknown paged attention kernel"):
        make_paged_kernel("ragged", cache, 2)
    cache.free_reqid(reqid)
    with pytest.raises(ValueError, match="not allocated"):
        cache.free_reqid(reqid)
    assert cache.stats().active_slots == 0 and cache.num_free_blocks == cache.config.num_blocks


@pytest.mark.parametrize("name", [name for name in PAGED_KERNELS if name not in CPU_PAGED_KERNELS])
def test_gpu_paged_kernels_refuse_a_host_cache_clearly(name: str) -> None:
    with pytest.raises(UnavailableError, match="GPU"):
        make_paged_kernel(name, paged_cache(), 2)
