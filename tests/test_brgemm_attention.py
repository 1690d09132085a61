"""Prompt chunks of the ragged kernel on oneDNN's brgemm (native/brgemm_attention.cpp): bf16 on
AMX, float32 on any AVX-512 CPU, against float64 attention."""

from __future__ import annotations

import pytest
import torch
from float64_checks import AGAINST_FLOAT64, WIDEST, printed_under_cap

from serving.model.cpu_features import cpu_flags
from vattn.ops import vattn_ops

pytestmark = pytest.mark.usefixtures("several_threads")  # the operators split work between threads


# Prompt chunks of bf16 queries over a bf16 cache, which take oneDNN's brgemm (AMX) from
# kBrgemmMinTokens (32) new tokens: chunks of 32-200 tokens (several items of 64 tokens, the
# last one short) at the start of their context and after cached keys (lengths ending mid-block
# of 64 keys), beside decodes and short chunks in the same call, slots out of order, 1-7 query
# heads a kv head, and over an int8 cache; `attention_brgemm` says whether it ran.
BRGEMM_CHECK = (
    AGAINST_FLOAT64.replace("slots = torch.arange(len(lengths))", "slots = torch.arange(len(lengths)).flip(0)").replace(
        "x[b, :length]", "x[len(lengths) - 1 - b, :length]"
    )
    + """
for dim, heads in [(64, 9), (64, 3), (64, 12), (128, 21), (96, 6)]:
    k, v = (torch.randn(7, 450, 3, dim, generator=generator).bfloat16() for _ in range(2))
    lengths, news = [32, 200, 1, 431, 97, 31, 130], [32, 200, 1, 65, 33, 31, 64]
    q = torch.randn(sum(news), heads, dim, generator=generator).bfloat16()
    check(q, k, v, lengths, news, 1e-2)
    print(ops.attention_brgemm(torch.bfloat16, dim), end=" ")
raw = [torch.randn(7, 450, 3, 64, generator=generator) for _ in range(2)]  # an int8 cache, bf16 queries
k8, v8, scales = int8_cache(raw)
check(torch.randn(sum(news), 9, 64, generator=generator).bfloat16(), k8, v8, lengths, news, 2e-2, scales)
"""
)


@pytest.mark.parametrize("onednn_cap", ["", "AVX512_CORE_BF16"])
def test_ragged_kernel_prompt_chunks_on_brgemm_match_float64(onednn_cap: str) -> None:
    """Where oneDNN packs bf16 for brgemm (AMX) prompt chunks run on it, the rest of the call on
    the dot-product bodies; ONEDNN_MAX_CPU_ISA below AMX keeps every request on those. Both
    match float64 attention."""
    if onednn_cap and "amx_bf16" not in cpu_flags():
        pytest.skip("without AMX the cap changes no path: the uncapped case runs these")
    brgemm = WIDEST == "avx512" and "amx_bf16" in cpu_flags() and not onednn_cap
    assert printed_under_cap(BRGEMM_CHECK, onednn_cap) == [str(brgemm)] * 5


# float32 prompt chunks over a float32 cache, which take oneDNN's f32 brgemm on any AVX-512 CPU
# from 32 new tokens: the same chunks and decodes, head dims that are multiples of 16 (48 too) and
# one that is not (40: the dot-product body), 1-7 query heads a kv head.
FLOAT_BRGEMM_CHECK = (
    AGAINST_FLOAT64
    + """
for dim, heads in [(64, 9), (64, 3), (64, 12), (128, 21), (48, 6), (40, 9)]:
    k, v = (torch.randn(7, 450, 3, dim, generator=generator) for _ in range(2))
    lengths, news = [32, 200, 1, 431, 97, 31, 130], [32, 200, 1, 65, 33, 31, 64]
    check(torch.randn(sum(news), heads, dim, generator=generator), k, v, lengths, news, 1e-5)
    print(ops.attention_brgemm(torch.float32, dim), end=" ")
"""
)


@pytest.mark.parametrize("onednn_cap", ["", "AVX2"])
def test_ragged_kernel_float_prompt_chunks_on_brgemm_match_float64(onednn_cap: str) -> None:
    """On an AVX-512 CPU float32 prompt chunks run on oneDNN's brgemm, the rest of the call on the
    dot-product bodies; ONEDNN_MAX_CPU_ISA below AVX512_CORE keeps every request on those. Both
    match float64 attention."""
    if onednn_cap and WIDEST != "avx512":
        pytest.skip("without AVX-512 the cap changes no path: the uncapped case runs these")
    brgemm = WIDEST == "avx512" and not onednn_cap
    assert printed_under_cap(FLOAT_BRGEMM_CHECK, onednn_cap) == [str(brgemm)] * 5 + ["False"]


def test_brgemm_prompt_chunks_attend_over_their_own_rows_not_the_int8_copies() -> None:
    """On brgemm a bf16 prompt chunk over an int8 cache reads its own new K/V as the call gives
    them, and only the earlier tokens' as quantized. Rows with one large element (steps of ~0.25)
    make that reference and the all-quantized one differ far beyond bf16's rounding."""
    ops, generator = vattn_ops(), torch.Generator().manual_seed(2)
    if not ops.attention_brgemm(torch.bfloat16, 64):
        pytest.skip("prompt chunks take brgemm only where oneDNN packs bf16 for it (AMX)")
    earlier, new, heads = 40, 64, 9
    fresh = [torch.randn(earlier + new, 3, 64, generator=generator) for _ in range(2)]
    for x in fresh:
        x[..., 0] = 60.0
    fresh = [x.bfloat16() for x in fresh]
    caches = [torch.zeros(1, 128, 3, 64, dtype=torch.int8) for _ in range(2)]
    pairs = [torch.zeros(1, 128, 3, 2) for _ in range(2)]
    q = torch.randn(earlier + new, heads, 64, generator=generator).bfloat16()
    out = torch.empty_like(q)
    for first, count in [(0, earlier), (earlier, new)]:  # the earlier tokens' call stores them
        rows = slice(first, first + count)
        ops.ragged_attention(
            out[rows],
            q[rows],
            *caches,
            torch.tensor([0]),
            torch.tensor([0]),
            torch.tensor([count]),
            torch.tensor([first + count]),
            0.125,
            fresh[0][rows],
            fresh[1][rows],
            *pairs,
        )
    stored = [
        c[0, : earlier + new].double() * p[0, : earlier + new, :, :1] + p[0, : earlier + new, :, 1:]
        for c, p in zip(caches, pairs, strict=True)
    ]

    def attention(keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
        keys, values = (x.double().repeat_interleave(3, 1).transpose(0, 1) for x in (keys, values))
        scores = q[earlier:].double().transpose(0, 1) @ keys.transpose(1, 2) * 0.125
        seen = torch.arange(earlier + new) <= torch.arange(earlier, earlier + new)[:, None]
        return (scores.masked_fill(~seen, float("-inf")).softmax(-1) @ values).transpose(0, 1)

    own = attention(*(torch.cat([s[:earlier], f[earlier:].double()]) for s, f in zip(stored, fresh, strict=True)))
    torch.testing.assert_close(out[earlier:].double(), own, rtol=2e-2, atol=2e-2)
    assert (attention(*stored) - own).abs().max() > 0.05  # what reading the quantized copies would miss by
