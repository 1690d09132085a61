"""Checks shared by the CPU and GPU tests: reference attention, a kernel run, page sharing, a
script run under other CPU settings."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from serving.model.weights import INPUTS_PER_SCALE, GroupedWeight
from vattn import KVCache
from vattn.backends import VMMBackend
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, make_paged_kernel

ITERATIONS: list[dict[str, int]] = [
    {"a": 40, "b": 69, "c": 33},  # whole prompts, and c's first prefill chunk
    {"a": 1, "b": 1, "c": 20},  # decodes sharing an iteration with c's second chunk
    {"a": 1, "b": 1, "c": 1},  # a pure decode batch
    {"b": 1, "c": 1},  # a left the batch
]
"""New tokens per request and iteration; lengths cross several 32-token pages."""


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    """Attention in float64 on ordinary contiguous tensors: q [Hq, Lq, D], k/v [L, Hkv, D]."""
    q, k, v = q.double(), k.double().transpose(0, 1), v.double().transpose(0, 1)
    groups = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if causal:  # query i sits at position L - Lq + i
        offset = k.shape[1] - q.shape[1]
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril(offset)
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores.softmax(-1) @ v


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 cache's rows as vattn stores them: per (token, kv head) of `x` [tokens, heads, dim],
    midpoint = the middle of its range, scale = max(its width / 254, 1e-6) and round((x -
    midpoint) / scale) to even, in float32; the pairs `[tokens, heads, 2]` as the cache keeps them."""
    x = x.float()
    lowest, highest = x.amin(-1), x.amax(-1)
    midpoints, scales = (lowest + highest) * 0.5, torch.clamp((highest - lowest) / 254.0, min=1e-6)
    values = torch.round((x - midpoints[..., None]) / scales[..., None]).clamp(-127, 127).to(torch.int8)
    return values, torch.stack((scales, midpoints), -1)


def dequantize_rows(values: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
    """What an int8 cache's rows stand for: value x scale + midpoint (pairs as quantize_rows gives)."""
    return values.to(pairs.dtype) * pairs[..., :1] + pairs[..., 1:]


def check_kernel(
    name: str,
    cache: KVCache | PagedKVCache,
    query_heads: int,
    tolerance: float,
    iterations: list[dict[str, int]] = ITERATIONS,
    seed: int = 0,
    query_dtype: torch.dtype | None = None,
) -> None:
    """Runs `iterations` through kernel `name` on `cache` and checks every layer's output and
    stored K/V against float64 attention over the whole history, which the test keeps. The
    queries and new K/V are in the cache's dtype (float32 for an int8 cache), or `query_dtype`."""
    cfg, device = cache.config, cache.device
    generator = torch.Generator(device=device).manual_seed(seed)
    kernel = (make_paged_kernel if isinstance(cache, PagedKVCache) else make_kernel)(name, cache, query_heads)
    reqids = {request: cache.alloc_reqid() for request in iterations[0]}
    history: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}
    lengths = dict.fromkeys(reqids, 0)

    quantized = cfg.quantized
    model_dtype = query_dtype or (torch.float32 if quantized else cfg.dtype)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.float32).to(model_dtype)

    for new_tokens in iterations:
        names = list(new_tokens)
        for request, new in new_tokens.items():
            lengths[request] += new
        cache.step({reqids[r]: lengths[r] for r in names})
        batch = kernel.plan([reqids[r] for r in names], [new_tokens[r] for r in names])
        total = sum(new_tokens.values())
        for layer in range(cfg.num_layers):
            q = rand(total, query_heads, cfg.head_dim)
            k, v = rand(total, cfg.num_kv_heads, cfg.head_dim), rand(total, cfg.num_kv_heads, cfg.head_dim)
            out = kernel.forward(layer, batch, q, k, v)
            assert out.shape == q.shape and out.dtype == model_dtype
            for i, request in enumerate(names):
                rows = slice(batch.starts[i], batch.starts[i + 1])
                old_k, old_v = history.get((request, layer), (k[:0], v[:0]))
                full_k, full_v = torch.cat([old_k, k[rows]]), torch.cat([old_v, v[rows]])
                history[(request, layer)] = (full_k, full_v)
                stored = cache.kv(layer, reqids[request])
                if quantized:  # the int8 rows and qparams exactly as quantized; attention over their product
                    qparams = cache.kv_qparams(layer, reqids[request])
                    read = []
                    for full, values, pairs in zip((full_k, full_v), stored, qparams, strict=True):
                        expected_values, expected_pairs = quantize_rows(full)
                        assert torch.equal(values, expected_values), f"{request} int8 K/V not stored"
                        assert torch.equal(pairs, expected_pairs), f"{request} K/V qparams not stored"
                        read.append(dequantize_rows(values, pairs))
                    full_k_read, full_v_read = read
                else:
                    assert torch.equal(stored[0], full_k) and torch.equal(stored[1], full_v), f"{request} K/V lost"
                    full_k_read, full_v_read = full_k, full_v
                expected = reference_attention(q[rows].transpose(0, 1), full_k_read, full_v_read, causal=True)
                torch.testing.assert_close(out[rows].transpose(0, 1).double(), expected, rtol=tolerance, atol=tolerance)


def check_page_sharing(backend: VMMBackend) -> None:
    """One physical page mapped at two addresses (as prefix caching will): writes through one
    mapping read back through the other, and unmapping one leaves the other intact."""
    size = backend.page_size
    first, second = backend.reserve(2 * size), backend.reserve(2 * size)
    (page,) = backend.create_pages(1)
    try:
        writer, reader = backend.tensor(first + size, size), backend.tensor(second, size)
        backend.map([first + size, second], [page, page])
        writer.copy_(torch.arange(size, device=writer.device, dtype=torch.int64).remainder(251).to(torch.uint8))
        assert torch.equal(reader, writer)
        backend.unmap([first + size])
        assert int(reader[1000]) == 1000 % 251
        backend.unmap([second])
    finally:
        backend.release_pages([page])
        backend.free_reservation(first, 2 * size)
        backend.free_reservation(second, 2 * size)


def printed_under(settings: dict[str, str], script: str) -> list[str]:
    """What a Python script prints, word by word, run in a process of its own with `settings`
    added to the environment (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: read once per process)."""
    env = os.environ | settings
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    return result.stdout.split()


def four_bit_weight(out: int, inputs: int, with_mins: bool) -> GroupedWeight:
    """Random 4-bit weights in the GGUF layout (Q4_1 with mins, else Q4_0's min = -8 * scale)."""
    generator = torch.Generator().manual_seed(out)
    data = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8, generator=generator)
    scales = torch.rand(out, inputs // INPUTS_PER_SCALE, generator=generator) / 10
    mins = torch.randn(out, inputs // INPUTS_PER_SCALE, generator=generator) / 10 if with_mins else -8 * scales
    return GroupedWeight(4, data, scales, mins)
