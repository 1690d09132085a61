"""What the experiments share: where results go, the models' attention shapes, and one
layer's attention over either cache, set up and timed the same way."""

from __future__ import annotations

import re
import statistics
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from serving import LLM, SamplingParams
from vattn import KVCache, KVCacheConfig, UnavailableError
from vattn.config import DTYPES
from vattn.kernels import make_kernel
from vattn.paged import PagedKVCache, PagedKVCacheConfig, make_paged_kernel

Key = TypeVar("Key")
RESULTS_ROOT = Path(__file__).resolve().parent / "results"


def results_dir() -> Path:
    """`results/<device>/`: the GPU's name when one is in use, else `cpu`."""
    if torch.cuda.is_available():
        return RESULTS_ROOT / re.sub(r"[^a-z0-9]+", "-", torch.cuda.get_device_name().lower()).strip("-")
    return RESULTS_ROOT / "cpu"


@dataclass(frozen=True)
class PaperModel:
    name: str
    num_layers: int
    num_query_heads: int
    num_kv_heads: int
    head_dim: int


DEFAULT_MODEL = PaperModel("SmolLM2-135M", 30, 9, 3, 64)
PAPER_MODELS = (
    PaperModel("Yi-6B", 32, 32, 4, 128),
    PaperModel("Llama-3-8B", 32, 32, 8, 128),
    PaperModel("Yi-34B", 60, 56, 8, 128),
)


@dataclass(frozen=True)
class Variant:
    """One way to hold the KV: `virtual` with a kernel of vattn.kernels, or `paged` with a
    block size and a kernel of vattn.paged. A paged variant is compared with the virtual one
    of its `family` (the same attention library on both sides)."""

    cache: str
    kernel: str
    block_size: int = 16
    family: str = "cpu"

    @property
    def label(self) -> str:
        return f"virtual/{self.kernel}" if self.cache == "virtual" else f"paged{self.block_size}/{self.kernel}"


CUDA_VARIANTS = (
    Variant("virtual", "torch_flash_attn", family="torch_flash_attn"),
    Variant("paged", "paged_torch_flash_attn", 256, family="torch_flash_attn"),
    Variant("virtual", "flash_attn", family="flash_attn"),
    Variant("paged", "paged_flash_attn", 256, family="flash_attn"),
    Variant("virtual", "flashinfer_paged", family="flashinfer"),
    Variant("paged", "paged_flashinfer", 16, family="flashinfer"),
    Variant("virtual", "sdpa", family="sdpa"),
    Variant("paged", "paged_gather", 16, family="sdpa"),
)
"""On a GPU, each kernel family on either cache: FlashAttention 2 as torch ships it (the paper's
comparison kernel for kernel, nothing to install) and as flash-attn does, whose paged paths need
blocks of 256; FlashInfer; torch's SDPA, which reads a paged cache only through a gather of its
blocks."""
UNAVAILABLE = (UnavailableError, ImportError)
"""What a variant raises when its library or device is not here: it is skipped, with the reason."""


def on_gpu() -> bool:
    return torch.cuda.is_available()


def wait_for_gpu() -> None:
    """Waits for the GPU's queued work, when there is a GPU: where a kernel's fault is raised."""
    if on_gpu():
        torch.cuda.synchronize()


def model_dtype() -> str:
    """The experiments' precision, the model's and the attention's: bfloat16 on a GPU (as
    the paper), float32 on the CPU."""
    return "bfloat16" if on_gpu() else "float32"


def make_llm(variant: Variant, model: str | None = None, **sizes: Any) -> LLM:
    """`model`'s engine (the default model's if None) on the variant's cache and kernel, on the
    GPU if there is one, warmed up: one short request through prefill and decode first, so no
    row times a first call's costs (on the H100, the first decode steps of an engine took
    155 ms against 5 ms after, and the first prefill 234 ms for 1K tokens against 35 for 2K)."""
    llm = LLM(
        model,
        dtype=model_dtype(),
        kv_cache=variant.cache,
        kernel=variant.kernel,
        block_size=variant.block_size,
        backend="cuda" if on_gpu() else "host",
        prefix_caching=False,  # the paper's comparisons (and repeated rounds) compute every prompt
        **sizes,
    )
    try:
        warm_up = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        llm.generate([list(range(100, 132))], warm_up, use_tqdm=False)
    except BaseException:
        llm.close()
        raise
    return llm


def with_ratio(rows: list[dict[str, Any]], keys: tuple[str, ...], metric: str) -> list[dict[str, Any]]:
    """Adds `vs_virtual` to measured rows: `metric` over the virtual row's of the same family
    and `keys`."""
    virtual = {
        (r["family"], *(r[k] for k in keys)): r[metric]
        for r in rows
        if r["status"] == "ok" and r["variant"].startswith("virtual")
    }
    return [
        r | {"vs_virtual": r[metric] / virtual[(r["family"], *(r[k] for k in keys))]}
        if r["status"] == "ok" and (r["family"], *(r[k] for k in keys)) in virtual
        else r
        for r in rows
    ]


def measured(variant: Variant, **figures: Any) -> dict[str, Any]:
    return {"variant": variant.label, "family": variant.family, "status": "ok", **figures}


def unmeasured(variant: Variant, exc: Exception, **keys: Any) -> dict[str, Any]:
    """The row of a variant that could not run: `skipped` when its library or device is not
    here, `failed` (traceback printed) when it broke; the other variants still run."""
    status = "skipped" if isinstance(exc, UNAVAILABLE) else "failed"
    if status == "failed":
        traceback.print_exception(exc)  # also after its except block (attention_seconds' failures)
    return {"variant": variant.label, "family": variant.family, "status": status, **keys} | {
        "reason": f"{type(exc).__name__}: {exc}"
    }


def report_unmeasured(rows: list[dict[str, Any]]) -> None:
    """Prints each skipped or failed variant once; exits with status 1 if any failed."""
    unmeasured = {(r["variant"], r["status"], r["reason"]) for r in rows if r["status"] != "ok"}
    for variant, status, reason in sorted(unmeasured):
        print(f"{status} {variant}: {reason}")
    if any(status == "failed" for _, status, _ in unmeasured):
        raise SystemExit(1)


def engine_rows(
    variant: Variant,
    sizes: Mapping[str, Any],
    points: Sequence[dict[str, Any]],
    measure: Callable[[LLM, dict[str, Any]], dict[str, Any]],
    **keys: Any,
) -> list[dict[str, Any]]:
    """One variant's rows of an engine experiment, one per point (e.g. `{"batch": 8}`): its
    engine built (`make_llm(variant, **sizes)`), each point's figures measured, the engine
    closed, all guarded. Whatever one of them raises ends this variant only: its points not
    yet measured get `unmeasured` rows (`skipped` when its library or device is not here, else
    `failed` with the reason), and the caller goes on with the other variants and writes every
    row. An engine that fails to close after its points were measured keeps their rows and
    adds one `failed` row without a point."""
    try:
        llm = make_llm(variant, **sizes)
    except Exception as exc:
        return [unmeasured(variant, exc, **keys, **point) for point in points]
    rows: list[dict[str, Any]] = []
    try:
        for point in points:
            rows.append(measured(variant, **keys, **point, **measure(llm, point)))
    except Exception as exc:
        rows += [unmeasured(variant, exc, **keys, **point) for point in points[len(rows) :]]
    try:
        llm.close()
    except Exception as exc:
        row = unmeasured(variant, exc, **keys)
        rows.append(row | {"status": "failed", "reason": f"closing the engine: {row['reason']}"})
    return rows


def attention_call(
    variant: Variant, shape: PaperModel, batch: int, context: int, new_tokens: int
) -> Callable[[], torch.Tensor]:
    """One layer's attention for `batch` requests at `context` tokens whose last `new_tokens`
    are this iteration's: caches stepped and the batch planned outside the returned call. On
    the GPU when there is one (the virtual cache on the CUDA backend), else on the host.

    The paged cache's requests grow interleaved, a block each in turn, so their blocks are
    scattered as in a server that has run a while (at batch 1 they stay in order)."""
    device, dtype = "cuda" if on_gpu() else "cpu", DTYPES[model_dtype()]
    if variant.cache == "virtual":
        cache: KVCache | PagedKVCache = KVCache(
            KVCacheConfig(
                1,
                shape.num_kv_heads,
                shape.head_dim,
                batch,
                context,
                dtype=dtype,
                backend="cuda" if device == "cuda" else "host",
                background=False,
            )
        )
        reqids = [cache.alloc_reqid() for _ in range(batch)]
        cache.step(dict.fromkeys(reqids, context))
        kernel = make_kernel(variant.kernel, cache, shape.num_query_heads)
    else:
        cache = PagedKVCache(
            PagedKVCacheConfig(
                1,
                shape.num_kv_heads,
                shape.head_dim,
                batch,
                context,
                dtype=dtype,
                block_size=variant.block_size,
                device=device,
            )
        )
        reqids = [cache.alloc_reqid() for _ in range(batch)]
        for length in range(variant.block_size, context + variant.block_size, variant.block_size):
            cache.step(dict.fromkeys(reqids, min(length, context)))
        kernel = make_paged_kernel(variant.kernel, cache, shape.num_query_heads)
    planned = kernel.plan(reqids, [new_tokens] * batch)
    generator = torch.Generator().manual_seed(0)

    def rand(heads: int) -> torch.Tensor:
        return torch.randn(batch * new_tokens, heads, shape.head_dim, generator=generator).to(device, dtype)

    q, k, v = rand(shape.num_query_heads), rand(shape.num_kv_heads), rand(shape.num_kv_heads)
    return lambda: kernel.forward(0, planned, q, k, v)  # type: ignore[arg-type]


def attention_seconds(
    variants: Sequence[Variant], shape: PaperModel, batch: int, context: int, new_tokens: int, repeats: int
) -> tuple[dict[Variant, float], list[tuple[Variant, Exception]]]:
    """Each variant's `attention_call` built, run once and timed in alternating rounds: the
    median seconds of those that run, and (variant, exception) for those that did not."""
    calls: dict[Variant, Callable[[], torch.Tensor]] = {}
    failures: list[tuple[Variant, Exception]] = []
    for variant in variants:
        try:
            call = attention_call(variant, shape, batch, context, new_tokens)
            call()
            wait_for_gpu()  # a kernel's asynchronous fault surfaces here, charged to its variant
            calls[variant] = call
        except Exception as exc:
            failures.append((variant, exc))
    broken: dict[Variant, Exception] = {}

    def guarded(variant: Variant, call: Callable[[], torch.Tensor]) -> Callable[[], object]:
        """A call that fails while timed stops there and is reported, and the others go on."""

        def run() -> object:
            if variant in broken:
                return None
            try:
                result = call()
                wait_for_gpu()
                return result
            except Exception as exc:
                broken[variant] = exc
                return None

        return run

    seconds = median_seconds({variant: guarded(variant, call) for variant, call in calls.items()}, repeats)
    failures += list(broken.items())
    return {variant: s for variant, s in seconds.items() if variant not in broken}, failures


def median_seconds(calls: Mapping[Key, Callable[[], object]], repeats: int, warmup: int = 2) -> dict[Key, float]:
    """Each call's median time over `repeats` rounds; a round times every call once, in turn,
    so a slow spell of the machine falls on all of them alike. A call is timed until it
    returns, so one that queues GPU work must wait for it (`attention_seconds`' calls do, each
    inside its own guard: a GPU fault is that variant's, and the others go on)."""

    def timed(call: Callable[[], object]) -> float:
        start = time.perf_counter()
        call()
        return time.perf_counter() - start

    for call in calls.values():
        for _ in range(warmup):
            timed(call)
    times: dict[Key, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            times[name].append(timed(call))
    return {name: statistics.median(samples) for name, samples in times.items()}
