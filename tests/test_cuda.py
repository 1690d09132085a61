"""The CUDA backend and the GPU kernels on a real GPU; skipped, with the reason, elsewhere.

benchmarks/gpu_suite.sh runs these on a bare GPU machine.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from checks import check_kernel, check_page_sharing
from test_stateful import CacheMachine, run_machine

from vattn import KVCache, KVCacheConfig, UnavailableError
from vattn.backends.cuda import CudaBackend
from vattn.kernels import KERNELS
from vattn.paged import PAGED_KERNELS, PagedKVCache, PagedKVCacheConfig
from vattn.sizes import MiB


def has_cuda_bindings() -> bool:
    """cuda.bindings itself: any cuda-* namespace package (cuda-pathfinder, cuda-core) makes `cuda` importable."""
    try:
        return importlib.util.find_spec("cuda.bindings") is not None
    except ModuleNotFoundError:
        return False


pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not has_cuda_bindings(), reason="needs cuda-bindings (pip install 'vattn[gpu]')"),
]


PAGE = 2 * MiB
LONG_ITERATIONS = [
    {"a": 1500, "b": 2100, "c": 900},
    {"a": 1, "b": 1, "c": 700},
    {"a": 1, "b": 1, "c": 1},
    {"b": 1, "c": 1},
]
"""At 2 KiB per token (8 KV heads x 128 x 2 B) a 2 MiB page holds 1024 tokens: every request
crosses pages, and c's second chunk starts inside one."""


@pytest.fixture
def make_cuda_cache(native: bool) -> Iterator[Callable[..., KVCache]]:
    caches: list[KVCache] = []

    def make(**overrides: Any) -> KVCache:
        fields = {
            "num_layers": 2,
            "num_kv_heads": 8,
            "head_dim": 128,
            "dtype": "bfloat16",
            "max_slots": 4,
            "max_context": 4096,
            "page_size": PAGE,
            "backend": "cuda",
            "memory_budget": 256 * MiB,
            "native": native,
        }
        cache = KVCache(KVCacheConfig(**{**fields, **overrides}))
        caches.append(cache)
        assert cache.backend.calls.name == ("native" if native else "cuda-python")
        assert cache.device.type == "cuda"
        return cache

    yield make
    for cache in caches:
        backend, errors = cache.backend, cache.stats().background_errors
        cache.close()
        assert errors == 0, "the background mapper failed (step() mapped synchronously instead)"
        assert isinstance(backend, CudaBackend) and backend.live_pages == 0, "pages leaked"


def pattern(reqid: int, length: int, layer: int, generation: int) -> torch.Tensor:
    """Distinct float32 values per request, position, head, layer and generation."""
    base = torch.arange(length * 8 * 128, dtype=torch.float32, device="cuda").reshape(length, 8, 128)
    return base.remainder(100_003) + 1e6 * reqid + 1e5 * layer + 3e6 * generation


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_data_survives_page_boundaries_frees_and_reuse(make_cuda_cache: Callable[..., KVCache], layout: str) -> None:
    """Round 2 writes only what round 1 did not (the reused slots' requests, and the grown
    request's new tail), so data lost across free, reuse or regrow shows in the final check."""
    cache = make_cuda_cache(dtype="float32", layout=layout)  # 4 KiB per token: 512 tokens a page
    lengths = {cache.alloc_reqid(): n for n in (700, 1500, 513, 90)}
    generation = dict.fromkeys(lengths, 0)
    written = dict.fromkeys(lengths, 0)
    for round_ in range(2):
        cache.step(lengths)
        for reqid, length in lengths.items():
            for layer in range(cache.config.num_layers):
                keys, values = cache.kv(layer, reqid)
                start = written[reqid]
                keys[start:].copy_(pattern(reqid, length, layer, generation[reqid])[start:])
                values[start:].copy_(-pattern(reqid, length, layer, generation[reqid])[start:])
            written[reqid] = length
        if round_ == 0:  # free two, hand the slots out again with their pages, grow another past a page
            for reqid in list(lengths)[:2]:
                cache.free_reqid(reqid)
                assert cache.alloc_reqid() == reqid
                generation[reqid], written[reqid] = 1, 0
            lengths[list(lengths)[2]] += 600
    torch.cuda.synchronize()
    for reqid, length in lengths.items():
        for layer in range(cache.config.num_layers):
            keys, values = cache.kv(layer, reqid)
            assert torch.equal(keys, pattern(reqid, length, layer, generation[reqid]))
            assert torch.equal(values, -pattern(reqid, length, layer, generation[reqid]))


def test_virtual_tensors_are_gpu_tensors_over_the_reservation(make_cuda_cache: Callable[..., KVCache]) -> None:
    cache = make_cuda_cache()
    keys, _ = cache.layer_tensors(0)
    assert keys.device.type == "cuda" and keys.shape == (4, 4096, 8, 128)
    assert keys.data_ptr() % cache.backend.granularity == 0
    assert cache.stats().mapped_bytes <= PAGE * cache.config.num_buffers  # at most the eager page group
    reqid = cache.alloc_reqid()
    cache.step({reqid: 1500})
    written = torch.arange(1500 * 8 * 128, device="cuda").reshape(1500, 8, 128).remainder(1009).to(torch.bfloat16)
    cache.kv(0, reqid)[0].copy_(written)
    assert torch.equal(keys[reqid, :1500], written)  # the request's view and the whole tensor share memory


def test_a_page_can_be_mapped_at_two_addresses(native: bool) -> None:
    backend = CudaBackend(page_size=PAGE, max_pages=4, native=native)
    try:
        check_page_sharing(backend)
        assert backend.live_pages == 1  # the probe page that made the tensors
    finally:
        backend.close()
    assert backend.live_pages == 0


def test_mapping_while_kernels_run_maps_the_right_pages(
    make_cuda_cache: Callable[..., KVCache], record_property: Callable[[str, object], None]
) -> None:
    """step() and the background thread map while queued GPU work runs, and the work queued
    after step() sees the new pages, each its own. Whether mapping waited for the stream is
    recorded, not asserted: the driver documents cuMemSetAccess as synchronous "for most use cases"."""
    cache = make_cuda_cache()
    reqid = cache.alloc_reqid()
    started, mapped = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    started.record()
    torch.cuda._sleep(1_000_000_000)  # about half a second of one busy kernel
    cache.step({reqid: 3000})  # three fresh pages per tensor, mapped synchronously
    assert cache.wait_for_background(30)  # and the next ones in the thread
    record_property("stream_busy_after_mapping", not torch.cuda.current_stream().query())
    mapped.record()
    keys, values = cache.kv(0, reqid)
    expected = torch.arange(3000 * 8 * 128, device="cuda").reshape(3000, 8, 128).remainder(997).to(torch.bfloat16)
    keys.copy_(expected)
    values.copy_(-expected)
    torch.cuda.synchronize()
    record_property("sleep_and_mapping_ms", started.elapsed_time(mapped))
    assert torch.equal(keys, expected) and torch.equal(values, -expected)
    other = cache.alloc_reqid()
    cache.step({other: 3000})
    assert torch.equal(cache.kv(0, reqid)[0], expected), "another request's pages alias this one's"


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["per_layer", "mega"])
@pytest.mark.parametrize("name", list(KERNELS))
def test_kernels_match_reference(make_cuda_cache: Callable[..., KVCache], name: str, layout: str, dtype: str) -> None:
    cache = make_cuda_cache(layout=layout, dtype=dtype)
    refusal = None
    try:
        check_kernel(name, cache, query_heads=32, tolerance=2e-2, iterations=LONG_ITERATIONS)
    except UnavailableError as exc:
        refusal = str(exc)
    except ValueError as exc:
        if "use layout='per_layer'" not in str(exc):
            raise
        refusal = str(exc)
    if refusal:  # skipped outside the handler: the refusal's traceback, and any view it holds, is gone by teardown
        pytest.skip(refusal)


class CudaCacheMachine(CacheMachine):
    backend, page_size, kv_heads, head_dim, max_context = "cuda", PAGE, 8, 128, 2000
    """4 KiB per token in float32: 512 tokens a page, four pages a slot."""


def test_random_operations_keep_the_invariants_on_cuda() -> None:
    run_machine(CudaCacheMachine, examples=25, steps=40, min_operations=500)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", [name for name in PAGED_KERNELS if name != "paged"])
def test_paged_kernels_match_reference(name: str, dtype: str) -> None:
    block_size = 256 if "flash_attn" in name else 16  # FlashAttention 2's paged path needs multiples of 256
    config = PagedKVCacheConfig(2, 8, 128, 4, 4096, dtype=dtype, block_size=block_size, device="cuda")
    try:
        check_kernel(name, PagedKVCache(config), query_heads=32, tolerance=2e-2, iterations=LONG_ITERATIONS)
    except UnavailableError as exc:
        pytest.skip(str(exc))
