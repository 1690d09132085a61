"""FlashAttention 2 as torch ships it, on both caches, built and planned on fake CUDA tensors.

torch's CPU build registers `aten::_flash_attention_forward` with its shape logic (a meta
kernel) but without its CUDA kernel, and says it has no FlashAttention. The tests stand in for
the CUDA build the machine lacks in one place: `torch.backends.cuda.is_flash_attention_available`
answers True (what a CUDA build of torch answers on an sm80+ GPU). Everything else is real:
the schema checked, the plan's index tensors, the call into the operator with the kernel's
actual arguments (its fake kernel checks their shapes, dtypes and devices), and on the
virtual cache the 2 MiB granularity of an H100 through tests/fake_cuda's driver. What the
GPU computes is not shown here: benchmarks/gpu_suite.sh runs it on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

from tests.fake_gpu import FakeCudaMode, device_guard, fake_cuda_memory
from vattn import ConfigurationError, KVCache, KVCacheConfig, UnavailableError
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel
from vattn.sizes import MiB
from vattn.torch_flash_attention import VARLEN_ARGUMENTS, TorchFlashAttention, token_rows

SHAPES = {"default model": (30, 9, 3, 64), "paper": (32, 32, 8, 128)}
"""(layers, query heads, KV heads, head size): SmolLM2-135M's, and Llama-3-8B's (the paper's)."""
NEW_TOKENS = (1, 37, 1)
"""A decode, a prefill chunk and a decode in one iteration."""
LENGTHS = (300, 37, 5)


@pytest.fixture
def flash_attention_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)


@pytest.fixture
def fake_gpu(flash_attention_built: None) -> Iterator[FakeCudaMode]:
    with device_guard():
        yield FakeCudaMode()


@pytest.fixture
def on_fake_gpu(fake_gpu: FakeCudaMode) -> Iterator[None]:
    """A fake CUDA device with an H100's 2 MiB granularity under the virtual cache."""
    with fake_gpu, fake_cuda_memory():
        yield


def fake_qkv(heads: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, ...]:
    tokens, device = sum(NEW_TOKENS), torch.device("cuda", 0)
    return tuple(torch.empty(tokens, n, dim, dtype=torch.bfloat16, device=device) for n in (heads, kv_heads, kv_heads))


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
@pytest.mark.parametrize("shape", SHAPES)
def test_virtual_cache_keys_are_read_from_each_slots_first_row(on_fake_gpu: None, shape: str, layout: str) -> None:
    layers, heads, kv_heads, dim = SHAPES[shape]
    config = KVCacheConfig(layers, kv_heads, dim, 4, 4096, dtype="bfloat16", backend="cuda", layout=layout)
    with KVCache(config) as cache:
        assert cache.config.page_size == 2 * MiB
        kernel = make_kernel("torch_flash_attn", cache, heads)
        reqids = [cache.alloc_reqid() for _ in LENGTHS]
        cache.step(dict(zip(reqids, LENGTHS, strict=True)))
        rows_per_slot = token_rows(cache.layer_tensors(0)[0])[1]
        batch = kernel.plan(reqids, NEW_TOKENS)
        plan = batch.wrapper
        assert plan.block_table is None
        assert isinstance(plan.cum_k, FakeTensor) and plan.cum_k.device.type == "cuda"
        assert plan.cum_k.dtype == plan.cum_q.dtype == plan.used_k.dtype == torch.int32
        assert (plan.max_q, plan.max_k) == (max(NEW_TOKENS), max(LENGTHS))
        for layer in (0, layers - 1):
            out = kernel.forward(layer, batch, *fake_qkv(heads, kv_heads, dim))
            assert isinstance(out, FakeTensor) and out.shape == (sum(NEW_TOKENS), heads, dim)
            assert out.dtype == torch.bfloat16 and out.device.type == "cuda"
            for tensor in cache.layer_tensors(layer):  # every layer's rows at the same offsets
                assert token_rows(tensor)[1] == rows_per_slot
        del batch, plan


def test_the_plan_names_each_requests_rows(on_fake_gpu: None) -> None:
    """The plan's host values, read before they go to the device (fake tensors hold none)."""
    config = KVCacheConfig(2, 2, 64, 4, 1024, dtype="float16", backend="cuda")
    with KVCache(config) as cache:
        kernel = make_kernel("torch_flash_attn", cache, 8)
        reqids = [cache.alloc_reqid() for _ in LENGTHS]
        cache.step(dict(zip(reqids, LENGTHS, strict=True)))
        calls: list[tuple[tuple[int, ...], ...]] = []
        plan = kernel._attend.plan
        kernel._attend.plan = lambda *args: calls.append(tuple(map(tuple, args))) or plan(*args)  # type: ignore[method-assign]
        order = [reqids[2], reqids[0], reqids[1]]  # any order: each request's rows are its slot's
        kernel.plan(order, [NEW_TOKENS[reqids.index(r)] for r in order])
        rows = token_rows(cache.layer_tensors(0)[0])[1]
        starts, key_starts, lengths, new = calls[0]
        assert key_starts == (*(r * rows for r in order), 4 * rows)
        assert lengths == tuple(LENGTHS[reqids.index(r)] for r in order)
        assert starts == (0, 1, 2, 39) and new == (1, 1, 37)


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_token_rows_are_views_of_each_slots_tokens(layout: str) -> None:
    """On real memory: row `reqid * rows_per_slot + t` is token t of slot reqid, in every layer."""
    cache = KVCache(KVCacheConfig(2, 2, 16, 4, 256, dtype="float32", page_size=4096, layout=layout))
    reqids = [cache.alloc_reqid() for _ in range(3)]
    cache.step(dict.fromkeys(reqids, 100))
    for reqid in reqids:
        keys, values = cache.kv(1, reqid)
        keys.copy_(torch.arange(keys.numel(), dtype=torch.float32).reshape(keys.shape) + 1000 * reqid)
        values.copy_(-keys)
    for tensor, sign in zip(cache.layer_tensors(1), (1, -1), strict=True):
        rows, per_slot = token_rows(tensor)
        assert rows.data_ptr() == tensor.data_ptr() and per_slot >= 256
        for reqid in reqids:
            mine = rows[reqid * per_slot : reqid * per_slot + 100]
            assert torch.equal(mine, sign * cache.kv(1, reqid)[0])
    cache.close()


@pytest.mark.parametrize("shape", SHAPES)
def test_paged_cache_passes_its_block_table(fake_gpu: FakeCudaMode, shape: str) -> None:
    layers, heads, kv_heads, dim = SHAPES[shape]
    with fake_gpu:
        config = PagedKVCacheConfig(layers, kv_heads, dim, 4, 4096, dtype="bfloat16", block_size=256, device="cuda")
        cache = PagedKVCache(config)
        kernel = make_paged_kernel("paged_torch_flash_attn", cache, heads)
        reqids = [cache.alloc_reqid() for _ in LENGTHS]
        cache.step(dict(zip(reqids, LENGTHS, strict=True)))
        batch = kernel.plan(reqids, NEW_TOKENS)
        plan = batch.wrapper
        assert plan.block_table is batch.block_table and plan.block_table.dtype == torch.int32
        assert tuple(plan.block_table.shape) == (3, 2)  # 300 tokens: two blocks of 256
        assert (plan.max_q, plan.max_k) == (max(NEW_TOKENS), max(LENGTHS))
        out = kernel.forward(layers - 1, batch, *fake_qkv(heads, kv_heads, dim))
        assert isinstance(out, FakeTensor) and out.shape == (sum(NEW_TOKENS), heads, dim)


def test_a_torch_without_an_argument_is_refused_with_its_name(flash_attention_built: None) -> None:
    TorchFlashAttention("torch_flash_attn", torch.device("cuda", 0), 128, VARLEN_ARGUMENTS)
    with pytest.raises(UnavailableError, match=r"to take page_table; torch .*'s takes .*block_table"):
        TorchFlashAttention("torch_flash_attn", torch.device("cuda", 0), 128, (*VARLEN_ARGUMENTS, "page_table"))


def test_a_torch_without_flash_attention_is_unavailable() -> None:
    """This CPU build of torch has none: the kernel says so rather than failing at its first call."""
    with pytest.raises(UnavailableError, match="a torch built with FlashAttention"):
        TorchFlashAttention("torch_flash_attn", torch.device("cuda", 0), 128, VARLEN_ARGUMENTS)


def test_what_flash_attention_cannot_run_is_refused_when_made(on_fake_gpu: None) -> None:
    for dtype, dim, error, message in [
        ("float32", 64, ConfigurationError, "runs float16 or bfloat16 caches"),
        ("bfloat16", 12, ConfigurationError, "multiples of 8 up to 256, not 12"),
    ]:
        config = KVCacheConfig(2, 2, dim, 2, 256, dtype=dtype, backend="cuda")
        with KVCache(config) as cache, pytest.raises(error, match=message):
            make_kernel("torch_flash_attn", cache, 8)
    blocks = PagedKVCache(PagedKVCacheConfig(2, 2, 64, 2, 512, dtype="bfloat16", block_size=16, device="cuda"))
    with pytest.raises(ValueError, match="block_size % 256 == 0, got 16"):
        make_paged_kernel("paged_torch_flash_attn", blocks, 8)


def test_token_rows_refuse_what_flash_attention_cannot_address() -> None:
    uneven = torch.empty_strided((2, 32, 2, 16), (32 * 48, 48, 16, 1), device="meta")  # rows 48 apart, slots 1,536
    assert token_rows(uneven)[1] == 32
    with pytest.raises(ValueError, match="not a whole number of token rows"):
        token_rows(torch.empty_strided((2, 32, 2, 16), (1000, 32, 16, 1), device="meta"))
    with pytest.raises(ValueError, match="32-bit and 4096 slots span"):
        token_rows(torch.empty_strided((4096, 2**20, 2, 16), (2**25, 32, 16, 1), device="meta"))


def test_the_virtual_cache_needs_no_block_table_from_torch(on_fake_gpu: None) -> None:
    """torch's FA2 entry point took `block_table` later than `seqused_k`: the virtual cache's call
    never passes it, so a torch without it still runs the paper's side of the comparison."""
    with KVCache(KVCacheConfig(2, 2, 64, 4, 1024, dtype="bfloat16", backend="cuda")) as cache:
        kernel = make_kernel("torch_flash_attn", cache, 8)
        reqids = [cache.alloc_reqid() for _ in LENGTHS]
        cache.step(dict(zip(reqids, LENGTHS, strict=True)))
        calls: list[dict[str, object]] = []
        forward = kernel._attend._forward
        kernel._attend._forward = lambda *args, **options: calls.append(options) or forward(*args, **options)  # type: ignore[method-assign]
        kernel.forward(0, kernel.plan(reqids, NEW_TOKENS), *fake_qkv(8, 2, 64))
        assert sorted(calls[0]) == ["scale", "seqused_k"]
