"""The GPU kernels' CPU-side logic: slot pages for FlashInfer, its page tables, the refusals."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.fake_cuda import FakeDriver, installed
from tests.fake_gpu import FakeCudaMode, device_guard, fake_cuda_memory
from tests.process_memory import release_memory
from vattn import ConfigurationError, KVCache, KVCacheConfig, UnavailableError, gpu_kernels
from vattn.config import GPU_KERNEL_BLOCK_TOKENS
from vattn.gpu_kernels import (
    FlashInferPlans,
    PagedShape,
    block_table,
    decode_uses_tensor_cores,
    require_half_precision,
    token_blocks,
)
from vattn.kernels import make_kernel
from vattn.sizes import KiB, MiB

H100_PAGE = 2 * MiB
"""CUDA's allocation granularity on an H100: the page size of a cache on a GPU."""
DEFAULT_MODEL = {"num_layers": 30, "num_kv_heads": 3, "head_dim": 64}
"""The default model's KV shape: 16 tokens of one layer are 6,144 B in bfloat16, which no power
of two divides."""
PAPER_MODEL = {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
"""The paper's (Llama-3-8B's) KV shape."""


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_token_blocks_are_views_of_each_slots_tokens(make_cache: Callable[..., KVCache], layout: str) -> None:
    cache = make_cache(layout=layout, max_context=256)
    reqids = [cache.alloc_reqid() for _ in range(3)]
    cache.step(dict.fromkeys(reqids, 100))
    for reqid in reqids:
        keys, _ = cache.kv(1, reqid)
        keys.copy_(torch.arange(keys.numel(), dtype=torch.float32).reshape(keys.shape) + 1000 * reqid)
    whole, _ = cache.layer_tensors(1)
    pages, per_slot = token_blocks(whole, 16)
    assert pages.data_ptr() == whole.data_ptr() and per_slot >= 256 // 16
    indptr, indices, last = block_table(tuple(reqids), (100, 100, 100), per_slot, 16)
    assert indptr == [0, 7, 14, 21] and last == [4, 4, 4]
    tokens = torch.arange(100)
    for i, reqid in enumerate(reqids):  # token by token: past a request's length may be unmapped
        mine = torch.tensor(indices[indptr[i] : indptr[i + 1]])
        assert torch.equal(pages[mine[tokens // 16], tokens % 16], cache.kv(1, reqid)[0])


@pytest.mark.parametrize("page_size", [4 * KiB, 64 * KiB, H100_PAGE])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "int8"])
@pytest.mark.parametrize("layout", ["per_layer", "mega"])
@pytest.mark.parametrize(
    "shape",
    [DEFAULT_MODEL, PAPER_MODEL, {"num_layers": 7, "num_kv_heads": 5, "head_dim": 12}],
    ids=["default", "paper", "odd"],
)
def test_slot_strides_are_whole_gpu_kernel_pages_and_whole_pages(
    shape: dict[str, int], layout: str, dtype: str, page_size: int
) -> None:
    """The fewest bytes that are whole pages, whole 16-token rows and at least the slot's pages."""
    for max_context in (1, 1000, 2048, 4096):
        config = KVCacheConfig(
            **shape, max_slots=2, max_context=max_context, dtype=dtype, layout=layout, page_size=page_size
        )
        kernel_page = GPU_KERNEL_BLOCK_TOKENS * config.bytes_per_token
        unit = math.lcm(page_size, kernel_page)
        assert config.slot_stride % unit == 0
        assert config.max_slot_groups * page_size <= config.slot_stride < config.max_slot_groups * page_size + unit
        slot, token, *_ = config.tensor_strides  # in elements: a token row is a whole number of them
        assert token * config.element_size == config.bytes_per_token
        assert slot % (GPU_KERNEL_BLOCK_TOKENS * token) == 0
        assert config.reservation_bytes == config.max_slots * config.slot_stride
        assert config.page_offset(1, config.max_slot_groups - 1) + page_size <= 2 * config.slot_stride  # inside slot 1


@pytest.fixture(params=["host", "fakecuda"])
def make_h100_cache(request: pytest.FixtureRequest) -> Iterator[Callable[..., KVCache]]:
    """Builds caches with 2 MiB pages: on the host backend, or on the CUDA backend over the fake
    driver with an H100's granularity (host memory behind it, so the tensors hold data); closes
    them after the test, and checks the fake driver for leaks once the test's views are gone."""
    caches: list[KVCache] = []

    def make(**fields: Any) -> KVCache:
        backend = "host" if request.param == "host" else "cuda"
        caches.append(KVCache(KVCacheConfig(**fields, page_size=H100_PAGE, backend=backend, background=False)))
        return caches[-1]

    if request.param == "host":
        yield make
        for cache in caches:
            cache.close()
        return
    with installed(FakeDriver(granularity=H100_PAGE, memory=1 << 40)) as driver:
        yield make
        for cache in caches:
            cache.close()
        caches.clear()
        release_memory()
    assert not driver.violations, driver.violations
    assert not driver.leaks(), driver.leaks()


def token_rows(cache: KVCache, layer: int, kv: int, reqid: int, length: int) -> torch.Tensor:
    """What the test writes to a request's K (kv=0) or V (kv=1) in a layer: its own random rows."""
    cfg = cache.config
    generator = torch.Generator().manual_seed(((layer * 2 + kv) * cfg.max_slots + reqid) * 7919 + length)
    return torch.randn(length, cfg.num_kv_heads, cfg.head_dim, generator=generator).to(cfg.dtype)


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
@pytest.mark.parametrize(
    ("shape", "dtype", "max_context"),
    [
        (DEFAULT_MODEL, "bfloat16", 2048),
        (DEFAULT_MODEL, "bfloat16", 8192),
        (PAPER_MODEL, "bfloat16", 4096),
        (PAPER_MODEL, "float16", 4096),
        (PAPER_MODEL, "bfloat16", 32768),
        (PAPER_MODEL, "float16", 32768),
    ],
    ids=["default-bf16-2k", "default-bf16-8k", "paper-bf16-4k", "paper-fp16-4k", "paper-bf16-32k", "paper-fp16-32k"],
)
def test_flashinfer_pages_every_layer_of_a_cache_with_2mib_pages(
    make_h100_cache: Callable[..., KVCache], shape: dict[str, int], dtype: str, max_context: int, layout: str
) -> None:
    """At a GPU's page size, every layer's K and V is seen as 16-token pages (flashinfer_paged's
    check at start), and each request's page table reads its own tokens: two short requests, and
    at the last slot one that runs past its first page group where the context allows."""
    cache = make_h100_cache(**shape, dtype=dtype, max_slots=3, max_context=max_context, layout=layout)
    cfg = cache.config
    reqids = tuple(cache.alloc_reqid() for _ in range(cfg.max_slots))
    lengths = (3, 17, min(max_context, cfg.tokens_in(1) + 5))
    cache.step(dict(zip(reqids, lengths, strict=True)))
    for layer in range(cfg.num_layers):
        for reqid, length in zip(reqids, lengths, strict=True):
            for kv, rows in enumerate(cache.kv(layer, reqid)):
                rows.copy_(token_rows(cache, layer, kv, reqid, length))
    for layer in range(cfg.num_layers):
        for kv, tensor in enumerate(cache.layer_tensors(layer)):
            try:
                pages, per_slot = token_blocks(tensor, GPU_KERNEL_BLOCK_TOKENS)
            except ValueError as refusal:  # no traceback: it would print the tensor, unmapped pages and all
                pytest.fail(f"layer {layer}'s {'KV'[kv]}: {refusal}", pytrace=False)
            assert per_slot * GPU_KERNEL_BLOCK_TOKENS * cfg.bytes_per_token == cfg.slot_stride
            indptr, indices, last = block_table(reqids, lengths, per_slot, GPU_KERNEL_BLOCK_TOKENS)
            for i, (reqid, length) in enumerate(zip(reqids, lengths, strict=True)):
                mine = torch.tensor(indices[indptr[i] : indptr[i + 1]])
                tokens = torch.arange(length)
                read = pages[mine[tokens // GPU_KERNEL_BLOCK_TOKENS], tokens % GPU_KERNEL_BLOCK_TOKENS]
                assert torch.equal(read, token_rows(cache, layer, kv, reqid, length)), (layer, kv, reqid)
                assert last[i] == length - (len(mine) - 1) * GPU_KERNEL_BLOCK_TOKENS


def test_token_blocks_refuse_what_flashinfer_cannot_address() -> None:
    odd = torch.empty_strided((2, 40, 2, 16), (40 * 32, 32, 16, 1), device="meta")
    with pytest.raises(ValueError, match="multiple of 16"):
        token_blocks(odd, 16)
    strided = torch.empty_strided((2, 32, 2, 16), (40 * 32, 32, 16, 1), device="meta")
    with pytest.raises(ValueError, match=r"not a whole number of 16-token pages .* not laid out by one"):
        token_blocks(strided, 16)
    huge = torch.empty_strided((2, 32, 2, 16), (2**40, 2**28, 16, 1), device="meta")
    with pytest.raises(ValueError, match="page stride is 32-bit"):
        token_blocks(huge, 16)


def test_decode_groups_outside_the_cuda_core_kernels_take_tensor_cores() -> None:
    assert [decode_uses_tensor_cores(q, 8) for q in (8, 32, 48, 56, 64, 128)] == [
        False,
        False,
        False,
        True,
        False,
        True,
    ]


def test_a_gpu_kernel_refuses_a_precision_it_cannot_run() -> None:
    require_half_precision(torch.bfloat16, "flash_attn")
    with pytest.raises(ConfigurationError, match=r"not torch.float32: use dtype='bfloat16' \(vattn serve --dtype"):
        require_half_precision(torch.float32, "flash_attn")


class RecordingWrapper:
    """FlashInfer's wrapper interface (plan, run); records what it ran."""

    def __init__(self, workspace: torch.Tensor, layout: str, **options: Any) -> None:
        assert not workspace.any(), "FlashInfer asks for a zeroed workspace"
        self.runs = 0
        self.plans: list[tuple[Any, ...]] = []

    def plan(self, *args: Any, **options: Any) -> None:
        self.plans.append(args)

    def run(self, q: torch.Tensor, kv: Any) -> torch.Tensor:
        self.runs += 1
        return q


def test_a_batch_planned_before_the_latest_plan_is_refused() -> None:
    flashinfer = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper, BatchPrefillWithPagedKVCacheWrapper=RecordingWrapper
    )
    shape = PagedShape(8, 8, 64, 16, torch.bfloat16, 0.125)
    plans = FlashInferPlans(flashinfer, torch.device("cpu"), shape)
    first = plans.plan((0, 1), [0, 1], [0], [1], decode=True)
    plans.run(first, torch.zeros(1), None)
    second = plans.plan((0, 2), [0, 1], [0], [2], decode=False)
    with pytest.raises(RuntimeError, match="planned before the kernel's latest plan"):
        plans.run(first, torch.zeros(1), None)
    plans.run(second, torch.zeros(1), None)
    assert (plans.decode.runs, plans.prefill.runs) == (1, 1)
    assert plans.decode.plans[0][3:] == (8, 8, 64, 16)  # after indptr, indices, last: the shape
    assert len(plans.prefill.plans[0]) == 8  # the query rows' starts first


BUILD_FAILURE = RuntimeError("Ninja build failed: nvcc not found")
DEVICE_FAULT = RuntimeError("CUDA error: an illegal memory access was encountered")


class FaultyWrapper:
    """A FlashInfer wrapper whose plan (where FlashInfer builds or loads its kernels) or run
    raises `failure`, as `where` says."""

    where = ""
    failure = RuntimeError()

    def __init__(self, workspace: torch.Tensor, layout: str, **options: Any) -> None:
        pass

    def plan(self, *args: Any, **options: Any) -> None:
        if self.where == "plan":
            raise self.failure

    def run(self, q: torch.Tensor, kv: Any) -> torch.Tensor:
        if self.where == "run":
            raise self.failure
        return q


@pytest.mark.parametrize(
    ("where", "failure", "raised"),
    [
        ("plan", BUILD_FAILURE, UnavailableError),
        ("plan", ImportError("libcudart.so.13: cannot open shared object file"), UnavailableError),
        ("plan", DEVICE_FAULT, RuntimeError),
        ("run", DEVICE_FAULT, RuntimeError),
        ("run", RuntimeError("q and kv must have the same dtype"), RuntimeError),
    ],
)
def test_only_a_failed_build_makes_flashinfer_unavailable(
    monkeypatch: pytest.MonkeyPatch, where: str, failure: Exception, raised: type[Exception]
) -> None:
    """FlashInfer (a double: the machine has none) builds its kernels when planned: a build that
    fails is `unavailable`, but a fault while a built kernel runs at the warm-up is a failure."""

    Wrapper = type("Wrapper", (FaultyWrapper,), {"where": where, "failure": failure})

    library = SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=Wrapper, BatchPrefillWithPagedKVCacheWrapper=Wrapper)
    monkeypatch.setattr(gpu_kernels, "import_flashinfer", lambda kernel: library)
    with device_guard(), FakeCudaMode(), fake_cuda_memory():
        config = KVCacheConfig(2, 2, 64, 2, 256, dtype="bfloat16", backend="cuda", page_size=H100_PAGE)
        with KVCache(config) as cache:
            with pytest.raises(raised) as caught:
                make_kernel("flashinfer_paged", cache, 8)
            assert (caught.type is UnavailableError) == (raised is UnavailableError)
            assert str(failure) in str(caught.value)
            del caught  # its traceback holds views of the cache


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
@pytest.mark.parametrize("shape", [DEFAULT_MODEL, {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128}])
def test_flashinfer_paged_is_made_for_the_default_model_and_the_papers_at_2mib(
    monkeypatch: pytest.MonkeyPatch, shape: dict[str, int], layout: str
) -> None:
    """The construction that refused the default model's shape on an H100, with FlashInfer as a
    double that plans and runs (the machine has none)."""
    library = SimpleNamespace(
        BatchDecodeWithPagedKVCacheWrapper=FaultyWrapper, BatchPrefillWithPagedKVCacheWrapper=FaultyWrapper
    )
    monkeypatch.setattr(gpu_kernels, "import_flashinfer", lambda kernel: library)
    with device_guard(), FakeCudaMode(), fake_cuda_memory():
        config = KVCacheConfig(**shape, max_slots=4, max_context=2048, dtype="bfloat16", backend="cuda", layout=layout)
        with KVCache(config) as cache:
            assert cache.config.page_size == H100_PAGE
            kernel = make_kernel("flashinfer_paged", cache, 3 * shape["num_kv_heads"])
            reqids = [cache.alloc_reqid() for _ in range(2)]
            cache.step({reqids[0]: 100, reqids[1]: 7})
            assert kernel.plan(reqids, [1, 7]).wrapper.generation == kernel._plans.latest
