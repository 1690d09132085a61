"""Attention kernels on the virtual tensors: SDPA and the ragged CPU kernel here, the GPU
kernels' clean refusal without a GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from checks import check_kernel
from float64_checks import AGAINST_FLOAT64, WIDEST, printed_under_cap

from serving.model.cpu_features import cpu_flags
from vattn import KVCache, KVCacheConfig, UnavailableError
from vattn.backends.cuda_calls import NativeCudaCalls
from vattn.backends.native import load_native, native_available
from vattn.kernels import KERNELS, make_kernel
from vattn.ops import vattn_ops

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads

MakeCache = Callable[..., KVCache]
CPU_KERNELS = ["sdpa", "ragged"]
GPU_KERNELS = [name for name in KERNELS if name not in CPU_KERNELS]


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_cpu_kernels_match_reference_through_chunked_prefill_and_decode(
    make_cache: MakeCache, kernel: str, layout: str
) -> None:
    check_kernel(kernel, make_cache(layout=layout), query_heads=8, tolerance=1e-5)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_cpu_kernels_at_long_contexts_with_few_requests(make_cache: MakeCache, kernel: str) -> None:
    """Fewer work items than OPS_THREADS: the ragged kernel splits each one's keys into chunks
    and merges them, for decodes and for a multi-row chunk whose rows end mid-context."""
    long_context = [{"a": 600, "b": 20}, {"a": 20, "b": 1}, {"a": 1, "b": 1}, {"a": 1}]
    check_kernel(kernel, make_cache(), query_heads=8, tolerance=1e-5, iterations=long_context)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cpu_kernels_in_half_precision(make_cache: MakeCache, kernel: str, dtype: str) -> None:
    check_kernel(kernel, make_cache(dtype=dtype), query_heads=4, tolerance=2e-2)


@pytest.mark.parametrize("layout", ["per_layer", "mega"])
def test_ragged_kernel_reads_and_writes_an_int8_cache(make_cache: MakeCache, layout: str) -> None:
    """Stored rows and qparams exactly as quantized per (token, kv head); attention over them
    within float32 rounding, through chunked prefill, decodes and a split long context."""
    check_kernel("ragged", make_cache(dtype="int8", layout=layout), query_heads=8, tolerance=1e-5)
    long_context = [{"a": 600, "b": 20}, {"a": 20, "b": 1}, {"a": 1, "b": 1}, {"a": 1}]
    check_kernel("ragged", make_cache(dtype="int8"), query_heads=8, tolerance=1e-5, iterations=long_context)


def test_ragged_kernel_reads_an_int8_cache_with_bfloat16_queries(make_cache: MakeCache) -> None:
    """A bfloat16 model over an int8 KV cache: rows quantized from the bf16 K/V, attention within
    bf16's rounding."""
    check_kernel("ragged", make_cache(dtype="int8"), query_heads=8, tolerance=2e-2, query_dtype=torch.bfloat16)


def test_kernels_that_cannot_read_int8_refuse_it_when_made(make_cache: MakeCache) -> None:
    cache = make_cache(dtype="int8")
    for name in [n for n in KERNELS if n != "ragged"]:
        with pytest.raises(ValueError, match=f"the {name} kernel cannot read an int8 KV cache; the kernels that can: "):
            make_kernel(name, cache, num_query_heads=8)


# Head dims that take each SIMD body and every width of their many-lane value sums (AVX-512:
# 64 + 48, 48; AVX2: 32 + 32, 32 + 16, 32 + 8, 32 + 24), over lengths that end mid-block (blocks
# of 16 keys) and chunks whose rows end mid-block, with float32 queries on float32, float16,
# bfloat16 and int8 caches (an int8 row widened by its scale and midpoint: the reference reads the same
# dequantized values).
SIMD_CHECK = (
    AGAINST_FLOAT64
    + """
lengths, news = [1, 17, 40, 300, 33], [1, 1, 20, 1, 33]
dims, dtypes = (64, 112, 48, 40, 56, 12), (torch.float32, torch.float16, torch.bfloat16)
for dim, cache_dtype in [(d, t) for d in dims for t in dtypes]:
    k, v = (torch.randn(5, 300, 3, dim, generator=generator).to(cache_dtype) for _ in range(2))
    check(torch.randn(56, 9, dim, generator=generator), k, v, lengths, news, 1e-5)
    if cache_dtype == torch.float32:
        print(ops.attention_simd(dim), end=" ")
for dim in dims:
    raw = [torch.randn(5, 300, 3, dim, generator=generator) for _ in range(2)]
    k8, v8, scales = int8_cache(raw)
    check(torch.randn(56, 9, dim, generator=generator), k8, v8, lengths, news, 1e-5, scales)
# decodes' 1, 2, 4 and 7 query heads per kv head: the few-lane scores (a float16 cache's rows read as stored)
for heads, cache_dtype in [(h, t) for h in (3, 6, 12, 21) for t in (torch.float32, torch.float16)]:
    k, v = (torch.randn(5, 300, 3, 64, generator=generator).to(cache_dtype) for _ in range(2))
    check(torch.randn(56, heads, 64, generator=generator), k, v, lengths, news, 1e-5)
"""
)


@pytest.mark.parametrize("capability", ["", "avx2", "default"])
def test_ragged_kernel_simd_bodies_match_float64(capability: str) -> None:
    """Each SIMD body (AVX-512, AVX2, scalar) is chosen as torch chooses its own kernels
    (ATEN_CPU_CAPABILITY caps it), by head_dim's fit, and matches float64 attention. "": this
    process's own capability, a cap it runs under included."""
    if capability == "avx2" and WIDEST == "scalar":
        pytest.skip("this CPU (or its ATEN_CPU_CAPABILITY) has no AVX2")
    if capability == "" and WIDEST == "avx2":
        pytest.skip("this process's own bodies are the avx2 case's: it runs them")
    env = os.environ | ({"ATEN_CPU_CAPABILITY": capability} if capability else {})
    result = subprocess.run([sys.executable, "-c", SIMD_CHECK], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    widest = {"": WIDEST, "avx2": "avx2", "default": "scalar"}[capability]
    by_widest = {"avx512": ["avx512"] * 3 + ["avx2"] * 2 + ["scalar"], "avx2": ["avx2"] * 5 + ["scalar"]}
    expected = by_widest.get(widest, ["scalar"] * 6)
    assert result.stdout.split() == expected


# bf16 queries over a bf16 cache: head dims that take the AVX512_BF16 body where the CPU has it
# (64, 96: multiples of 32) and one that does not (48), lengths and chunks ending mid-block and
# mid-pair; each against float64 attention at bf16's rounding, and `attention_bf16_dots` saying
# which body ran.
BF16_CHECK = (
    AGAINST_FLOAT64
    + """
for dim in (64, 96, 48):
    k, v = (torch.randn(6, 300, 3, dim, generator=generator).bfloat16() for _ in range(2))
    q = torch.randn(101, 9, dim, generator=generator).bfloat16()
    check(q, k, v, [1, 17, 40, 300, 33, 101], [1, 1, 20, 1, 33, 45], 1e-2)
    print(ops.attention_bf16_dots(dim), end=" ")
for dim, heads in [(d, h) for d in (64, 96) for h in (3, 6, 12, 21)]:  # 1, 2, 4, 7 query heads per kv head
    k, v = (torch.randn(6, 300, 3, dim, generator=generator).bfloat16() for _ in range(2))
    q = torch.randn(101, heads, dim, generator=generator).bfloat16()
    check(q, k, v, [1, 17, 40, 300, 33, 101], [1, 1, 20, 1, 33, 45], 1e-2)
"""
)


@pytest.mark.parametrize("onednn_cap", ["", "AVX512_CORE"])
def test_ragged_kernel_bf16_bodies_match_float64(onednn_cap: str) -> None:
    """The AVX512_BF16 body (vdpbf16ps on the cache's own rows) where the CPU has it and
    ONEDNN_MAX_CPU_ISA does not cap it, the widening bodies elsewhere: both match float64."""
    if onednn_cap and "avx512_bf16" not in cpu_flags():
        pytest.skip("without AVX512_BF16 the cap changes no body: the uncapped case runs these")
    native = WIDEST == "avx512" and "avx512_bf16" in cpu_flags() and not onednn_cap
    assert printed_under_cap(BF16_CHECK, onednn_cap) == [str(native), str(native), "False"]


# bf16 queries over an int8 cache: head dims that take the AVX512_VNNI body where the CPU has it
# (64 and 128 with their queries held in registers, 96 without; multiples of 32) and one that
# does not (48), 1-7 query heads a kv head, decodes and short chunks beside long ones, lengths
# ending mid-block; each against float64 attention over the dequantized rows, and
# `attention_int8_dots` saying which body ran.
INT8_CHECK = (
    AGAINST_FLOAT64
    + """
for dim, heads in [(64, 9), (128, 6), (96, 3), (48, 9), (64, 12), (64, 21)]:
    raw = [torch.randn(6, 300, 3, dim, generator=generator) for _ in range(2)]
    k8, v8, scales = int8_cache(raw)
    q = torch.randn(101, heads, dim, generator=generator).bfloat16()
    check(q, k8, v8, [1, 17, 40, 300, 33, 101], [1, 1, 20, 1, 33, 45], 2e-2, scales)  # 33, 45: brgemm on AMX
    print(ops.attention_int8_dots(dim), end=" ")
"""
)


@pytest.mark.parametrize("onednn_cap", ["", "AVX512_CORE"])
def test_ragged_kernel_int8_bodies_match_float64(onednn_cap: str) -> None:
    """The AVX512_VNNI body (int16 queries by the cache's own bytes) where the CPU has it and
    ONEDNN_MAX_CPU_ISA does not cap it, the widening bodies elsewhere: both match float64."""
    if onednn_cap and "avx512_vnni" not in cpu_flags():
        pytest.skip("without AVX512_VNNI the cap changes no body: the uncapped case runs these")
    native = WIDEST == "avx512" and "avx512_vnni" in cpu_flags() and not onednn_cap
    assert printed_under_cap(INT8_CHECK, onednn_cap) == [str(native)] * 3 + ["False"] + [str(native)] * 2


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ragged_kernel_stores_the_new_tokens_as_torch_rounds_them(cache_dtype: torch.dtype) -> None:
    """Given k and v, the call writes each request's new rows at its last positions (rounded
    as torch's .to() rounds) and touches nothing else; k without v is refused."""
    ops, generator = vattn_ops(), torch.Generator().manual_seed(1)
    lengths, news = [5, 40, 1], [1, 7, 1]
    k_cache, v_cache = (torch.randn(3, 48, 3, 64, generator=generator).to(cache_dtype) for _ in range(2))
    before = k_cache.clone(), v_cache.clone()
    qkv = torch.randn(sum(news), 15, 64, generator=generator)  # strided views, as the model's split gives them
    q, k, v = qkv[:, :9], qkv[:, 9:12], qkv[:, 12:]
    out, starts = torch.empty_like(q), torch.tensor([0, *news[:-1]]).cumsum(0)
    vectors = (torch.tensor([2, 0, 1]), starts, torch.tensor(news), torch.tensor(lengths))
    ops.ragged_attention(out, q, k_cache, v_cache, *vectors, 0.125, k, v)
    for cache, new, old in zip((k_cache, v_cache), (k, v), before, strict=True):
        expected = old.clone()
        for slot, start, count, length in zip([2, 0, 1], starts, news, lengths, strict=True):
            expected[slot, length - count : length] = new[start : start + count].to(cache_dtype)
        assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="give both or neither"):
        ops.ragged_attention(out, q, k_cache, v_cache, *vectors, 0.125, k, None)
    with pytest.raises(RuntimeError, match=r"k and v must be \[tokens, kv_heads, head_dim\]"):
        ops.ragged_attention(out, q, k_cache, v_cache, *vectors, 0.125, k[:, :2], v[:, :2])


def test_plan_refuses_what_step_did_not_guarantee(make_cache: MakeCache) -> None:
    cache = make_cache()
    kernel = make_kernel("sdpa", cache, num_query_heads=4)
    a, b = cache.alloc_reqid(), cache.alloc_reqid()
    cache.step({a: 10, b: 3})
    with pytest.raises(ValueError, match=r"new tokens must be an integer in \[1, 3\]"):
        kernel.plan([a, b], [1, 4])
    with pytest.raises(ValueError, match="new tokens"):
        kernel.plan([a], [0])
    with pytest.raises(ValueError, match="distinct"):
        kernel.plan([a, a], [1, 1])
    with pytest.raises(ValueError, match="one new-token count per reqid"):
        kernel.plan([a, b], [1])
    with pytest.raises(ValueError, match="one new-token count per reqid"):
        kernel.plan([], [])
    cache.free_reqid(b)
    with pytest.raises(ValueError, match="not allocated"):
        kernel.plan([b], [1])


def test_forward_checks_shapes_dtype_and_device(make_cache: MakeCache) -> None:
    cache = make_cache()
    kernel = make_kernel("sdpa", cache, num_query_heads=4)
    reqid = cache.alloc_reqid()
    cache.step({reqid: 5})
    batch = kernel.plan([reqid], [5])
    q, kv = torch.zeros(5, 4, 16), torch.zeros(5, 2, 16)
    with pytest.raises(ValueError, match=r"q must be torch.float32 \[5, 4, 16\]"):
        kernel.forward(0, batch, q[:4], kv, kv)
    with pytest.raises(ValueError, match=r"k must be torch.float32 \[5, 2, 16\]"):
        kernel.forward(0, batch, q, kv.double(), kv)
    with pytest.raises(ValueError, match="layer must be an integer"):
        kernel.forward(9, batch, q, kv, kv)
    assert kernel.forward(0, batch, q, kv, kv).shape == (5, 4, 16)


def test_kernel_names_and_head_counts(make_cache: MakeCache) -> None:
    cache = make_cache()
    with pytest.raises(
        ValueError, match="unknown attention kernel 'nope'; available: sdpa, ragged, torch_flash_attn, flash_attn"
    ):
        make_kernel("nope", cache, 4)
    with pytest.raises(ValueError, match="positive multiple of num_kv_heads"):
        make_kernel("sdpa", cache, 3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
@pytest.mark.parametrize("name", GPU_KERNELS)
def test_gpu_kernels_refuse_a_host_cache_clearly(make_cache: MakeCache, name: str) -> None:
    with pytest.raises(UnavailableError, match=f"the {name} kernel runs on a GPU"):
        make_kernel(name, make_cache(), 4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_backend_refuses_clearly_without_a_gpu() -> None:
    config = KVCacheConfig(num_layers=2, num_kv_heads=2, head_dim=64, max_slots=2, max_context=64, backend="cuda")
    with pytest.raises(UnavailableError, match="the CUDA backend needs"):
        KVCache(config)


@pytest.mark.skipif(not native_available(), reason="the native library is not built")
def test_native_cuda_calls_refuse_clearly_without_libcuda() -> None:
    try:
        NativeCudaCalls(load_native(True), context_handle=0, device=0)
    except UnavailableError as exc:
        assert "libcuda" in str(exc)
    else:
        pytest.skip("libcuda is present here; the refusal cannot be observed")
