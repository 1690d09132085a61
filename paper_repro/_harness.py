"""What the experiments share: where results go, the models' attention shapes, and one
layer's attention over either cache, set up and timed the same way."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from vattn import KVCache, KVCacheConfig
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel

RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """`results/<device>/`: the GPU's name when one is in use, else `cpu`."""
    if torch.cuda.is_available():
        return RESULTS_ROOT / re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return RESULTS_ROOT / "cpu"


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int


DEFAULT_MODEL = ModelShape("SmolLM2-135M", 30, 9, 3, 64)
PAPER_MODELS = (
    ModelShape("Yi-6B", 32, 32, 4, 128),
    ModelShape("Llama-3-8B", 32, 32, 8, 128),
    ModelShape("Yi-34B", 60, 56, 8, 128),
)


@dataclass(frozen=True)
class Variant:
    """One way to hold the KV: `virtual` with a kernel of vattn.kernels, or `paged` with a
    block size and a kernel of vattn.paged."""

    cache: str
    kernel: str
    block_size: int = 16

    @property
    def label(self) -> str:
        return f"virtual/{self.kernel}" if self.cache == "virtual" else f"paged{self.block_size}/{self.kernel}"


def attention_call(
    variant: Variant, shape: ModelShape, batch: int, context: int, new_tokens: int, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """One layer's attention for `batch` requests at `context` tokens whose last `new_tokens`
    are this iteration's: caches stepped and the batch planned outside the returned call.

    The paged cache's requests grow interleaved, a block each in turn, so their blocks are
    scattered as in a server that has run a while (at batch 1 they stay in order)."""
    generator = torch.Generator().manual_seed(0)
    if variant.cache == "virtual":
        cache: KVCache | PagedKVCache = KVCache(
            KVCacheConfig(1, shape.num_kv_heads, shape.head_dim, batch, context, dtype=dtype, background=False)
        )
        reqids = [cache.alloc_reqid() for _ in range(batch)]
        cache.step(dict.fromkeys(reqids, context))
        kernel = make_kernel(variant.kernel, cache, shape.num_query_heads)
    else:
        cache = PagedKVCache(
            PagedKVCacheConfig(
                1, shape.num_kv_heads, shape.head_dim, batch, context, dtype=dtype, block_size=variant.block_size
            )
        )
        reqids = [cache.alloc_reqid() for _ in range(batch)]
        for length in range(variant.block_size, context + variant.block_size, variant.block_size):
            cache.step(dict.fromkeys(reqids, min(length, context)))
        kernel = make_paged_kernel(variant.kernel, cache, shape.num_query_heads)
    planned = kernel.plan(reqids, [new_tokens] * batch)
    tokens = batch * new_tokens

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(tokens, heads, shape.head_dim, generator=generator).to(dtype)

    q, k, v = rand(shape.num_query_heads), rand(shape.num_kv_heads), rand(shape.num_kv_heads)
    return lambda: kernel.forward(0, planned, q, k, v)  # type: ignore[arg-type]


def median_seconds(call: Callable[[], object], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)
