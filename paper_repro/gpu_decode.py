"""Fig. 9 on a GPU: decode attention latency on vAttention's virtual KV tensors vs. paged KV caches.

Llama-3-8B attention shapes (32 query heads, 8 KV heads, head dim 128, bfloat16), one
layer, every request holding `--context` cached tokens (16K). One decode step per call:
the query of one new token per request, that token's K and V appended to the cache, and
attention over context + 1 tokens. Variants:

- vattn+flash_attn: `KVCache(backend="cuda", layout="per_layer")` stepped to context + 1,
  kernel "flash_attn" of `vattn.kernels` (`flash_attn_with_kvcache` on the virtual
  `[slots, max_context, 8, 128]` tensors with `cache_batch_idx` and `cache_seqlens`,
  appending the new K/V in place);
- vattn+flashinfer_paged: the same cache, kernel "flashinfer_paged" (an indexed write of
  the new K/V, then FlashInfer's batch decode with one page = one slot);
- paged flash_attn, block 256 (`paged_flash_attn`): plain `[blocks, 256, 8, 128]` K and V
  tensors, a block table of randomly permuted blocks,
  `flash_attn_with_kvcache(..., k=, v=, cache_seqlens=, block_table=)`;
- paged flashinfer, block 16 (`paged_flashinfer`): `[pages, 16, 8, 128]` K and V, randomly
  permuted pages, `append_paged_kv_cache` for the new token, then
  `BatchDecodeWithPagedKVCacheWrapper.run` (planned once); both calls are timed.

vattn's max_context is context + 1 rounded up to whole pages (the headroom), so every
page of every slot is mapped and a slot's stride is exactly max_context tokens.

Lengths stay fixed: each variant is planned once (`kernel.plan()` / `wrapper.plan()`,
outside the timing) and the same decode step is repeated, so every call overwrites the
same token slot (position `context`) and attends over context + 1 tokens; step() and
planning are not part of the time. Per call, CUDA events around the call after an L2
flush: `device_us` has the call queued behind a GPU sleep, so the host's Python and launch
overhead is hidden (kernel time); `eager_us` starts from an idle GPU (what an eager engine
sees). Median of `--iters` after `--warmup`. Each variant's output for its first and last
request is checked against a float32 reference over what its cache holds, and the new
K/V against what was appended; a failed check makes the run exit with status 1.

    python -m paper_repro.gpu_decode [--batches 1,2,4,8,16,32] [--context 16384] [--iters 100]

A variant whose library (flash-attn, flashinfer, cuda-python) is missing is skipped with
the reason recorded; without a CUDA GPU, or with no variant able to run, it prints why and
exits with status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import math
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from benchmarks._common import command_line, machine_facts, save_figure, write_results
from benchmarks._gpu import cannot_run, exit_unless_cuda, gpu_facts, package_version
from paper_repro._harness import results_dir
from vattn.errors import UnavailableError
from vattn.kernels import FLASHINFER_WORKSPACE_BYTES
from vattn.sizes import MiB, parse_size, size_label

VARIANTS = {
    "vattn+flash_attn": "vattn+flash_attn",
    "vattn+flashinfer_paged": "vattn+flashinfer_paged",
    "paged_flash_attn": "paged flash_attn, block 256",
    "paged_flashinfer": "paged flashinfer, block 16",
}
"""Variant name (command line, CSV) -> label (plot, table)."""
REL_TOLERANCE = 0.05
"""Largest |out - reference| / max |reference| a variant may show (bf16 gives ~0.005)."""
MISSING = (UnavailableError, ImportError)
"""What a variant raises when its library (or the device it needs) is not here: it is skipped."""


@dataclass(frozen=True)
class Shape:
    query_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    context: int
    """Tokens cached before the step; attention covers context + 1."""

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def tokens(self) -> int:
        return self.context + 1


@dataclass
class Case:
    """One variant at one batch size, its cache filled and its step planned, ready to time."""

    run: Callable[[], torch.Tensor]
    """One decode step: appends `k_new`/`v_new` and returns the attention of `q`."""
    q: torch.Tensor
    """`[batch, query_heads, head_dim]`"""
    k_new: torch.Tensor
    """`[batch, kv_heads, head_dim]`"""
    v_new: torch.Tensor
    gather: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    """Request i's K and V as the cache holds them, `[context + 1, kv_heads, head_dim]`."""
    kv_bytes: int
    """Device memory the K/V cache holds (both tensors)."""
    close: Callable[[], None] = field(default=lambda: None)


def _inputs(shape: Shape, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn(batch, shape.query_heads, shape.head_dim, device=device, dtype=shape.dtype)
    k = torch.randn(batch, shape.kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    v = torch.randn(batch, shape.kv_heads, shape.head_dim, device=device, dtype=shape.dtype)
    return q, k, v


def vattn_case(kernel_name: str, shape: Shape, batch: int, page_size: int, backend: str = "cuda") -> Case:
    """A CUDA KVCache with `batch` slots stepped to context + 1 and a vattn kernel planned on it.

    max_context is context + 1 rounded up to whole pages, so every slot's pages are all
    mapped and the slot stride is exactly max_context tokens; the budget is that many pages.
    """
    from vattn import KVCache, KVCacheConfig
    from vattn.kernels import make_kernel

    probe = KVCacheConfig(
        num_layers=1,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        max_slots=batch,
        max_context=shape.tokens,
        dtype=shape.dtype,
        page_size=page_size,
    )
    slot_pages = probe.pages_for(shape.tokens)
    max_context = slot_pages * page_size // probe.bytes_per_token
    pages = batch * slot_pages * probe.num_buffers
    config = dataclasses.replace(
        probe,
        max_context=max_context,
        backend=backend,
        memory_budget=pages * page_size,
        layout="per_layer",
        background=False,  # nothing to map ahead: every page is mapped before timing
    )
    cache = KVCache(config)
    try:
        kernel = make_kernel(kernel_name, cache, shape.query_heads)
        reqids = [cache.alloc_reqid() for _ in range(batch)]
        cache.step({r: shape.tokens for r in reqids})
        for r in reqids:
            keys, values = cache.kv(0, r)
            keys.normal_()
            values.normal_()
        planned = kernel.plan(reqids, [1] * batch)
    except BaseException:
        cache.close()
        raise
    q, k, v = _inputs(shape, batch, cache.device)

    def gather(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return cache.kv(0, reqids[i])

    return Case(
        run=lambda: kernel.forward(0, planned, q, k, v),
        q=q,
        k_new=k,
        v_new=v,
        gather=gather,
        kv_bytes=pages * page_size,
        close=cache.close,
    )


@dataclass
class PagedKV:
    """A paged K/V cache of random contents: `[blocks, block, kv_heads, head_dim]` K and V, where
    every request holds `per_request` blocks, enough for context + 1 tokens."""

    per_request: int
    blocks: int
    k_cache: torch.Tensor
    v_cache: torch.Tensor

    @classmethod
    def random(cls, shape: Shape, batch: int, device: torch.device, block: int) -> PagedKV:
        per_request = math.ceil(shape.tokens / block)
        blocks = batch * per_request
        cache_shape = (blocks, block, shape.kv_heads, shape.head_dim)
        k_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
        v_cache = torch.randn(cache_shape, device=device, dtype=shape.dtype)
        return cls(per_request, blocks, k_cache, v_cache)

    def gather(self, rows: torch.Tensor, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `tokens` tokens of K and V held in blocks `rows`, in that order."""
        rows = rows.long()
        return self.k_cache[rows].flatten(0, 1)[:tokens], self.v_cache[rows].flatten(0, 1)[:tokens]

    @property
    def nbytes(self) -> int:
        """Device memory K and V hold."""
        return self.k_cache.nbytes + self.v_cache.nbytes


def paged_flash_attn_case(shape: Shape, batch: int, device: torch.device, block: int = 256) -> Case:
    """flash_attn_with_kvcache over a block table of randomly permuted 256-token blocks."""
    from flash_attn import flash_attn_with_kvcache

    paged = PagedKV.random(shape, batch, device, block)
    block_table = torch.randperm(paged.blocks, device=device).to(torch.int32).view(batch, paged.per_request)
    block_table = block_table.contiguous()
    cache_seqlens = torch.full((batch,), shape.context, dtype=torch.int32, device=device)
    q, k, v = _inputs(shape, batch, device)
    q4, k4, v4 = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # [batch, 1 new token, heads, dim]

    def run() -> torch.Tensor:
        out = flash_attn_with_kvcache(
            q4,
            paged.k_cache,
            paged.v_cache,
            k=k4,
            v=v4,
            cache_seqlens=cache_seqlens,
            block_table=block_table,
            softmax_scale=shape.scale,
            causal=True,
        )
        return out.squeeze(1)

    def gather(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return paged.gather(block_table[i], shape.tokens)

    return Case(run=run, q=q, k_new=k, v_new=v, gather=gather, kv_bytes=paged.nbytes)


def paged_flashinfer_case(shape: Shape, batch: int, device: torch.device, page: int = 16) -> Case:
    """FlashInfer's batch decode over randomly permuted 16-token pages, with the append kernel."""
    import flashinfer

    paged = PagedKV.random(shape, batch, device, page)
    per_request = paged.per_request
    indices = torch.randperm(paged.blocks, device=device).to(torch.int32)
    indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) * per_request
    # The page table already holds the appended token (FlashInfer's convention for appends).
    last_page_len = torch.full((batch,), shape.tokens - (per_request - 1) * page, dtype=torch.int32, device=device)
    batch_indices = torch.arange(batch, dtype=torch.int32, device=device)
    positions = torch.full((batch,), shape.context, dtype=torch.int32, device=device)
    workspace = torch.empty(FLASHINFER_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(
        indptr,
        indices,
        last_page_len,
        shape.query_heads,
        shape.kv_heads,
        shape.head_dim,
        page,
        q_data_type=shape.dtype,
        kv_data_type=shape.dtype,
        sm_scale=shape.scale,
    )
    q, k, v = _inputs(shape, batch, device)
    kv = (paged.k_cache, paged.v_cache)

    def run() -> torch.Tensor:
        flashinfer.append_paged_kv_cache(
            k, v, batch_indices, positions, kv, indices, indptr, last_page_len, kv_layout="NHD"
        )
        return wrapper.run(q, kv)

    def gather(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return paged.gather(indices[i * per_request : (i + 1) * per_request], shape.tokens)

    return Case(run=run, q=q, k_new=k, v_new=v, gather=gather, kv_bytes=paged.nbytes)


def build_case(variant: str, shape: Shape, batch: int, page_size: int, device: torch.device) -> Case:
    if variant == "vattn+flash_attn":
        return vattn_case("flash_attn", shape, batch, page_size)
    if variant == "vattn+flashinfer_paged":
        return vattn_case("flashinfer_paged", shape, batch, page_size)
    if variant == "paged_flash_attn":
        return paged_flash_attn_case(shape, batch, device, 256)
    if variant == "paged_flashinfer":
        return paged_flashinfer_case(shape, batch, device, 16)
    raise ValueError(f"unknown variant {variant!r}; choose from {list(VARIANTS)}")


def reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """float32 attention of one token's `q [Hq, D]` over `keys/values [N, Hkv, D]`; query head h
    reads KV head h // (Hq / Hkv), as both libraries do for grouped-query attention."""
    kv_heads, head_dim = keys.shape[1], keys.shape[2]
    grouped = q.float().view(kv_heads, -1, head_dim)
    scores = torch.einsum("kgd,nkd->kgn", grouped, keys.float()) * scale
    out = torch.einsum("kgn,nkd->kgd", scores.softmax(dim=-1), values.float())
    return out.reshape(-1, head_dim)


def check(case: Case, shape: Shape) -> dict[str, Any]:
    """The step's output for the first and last request against the float32 reference over the
    cache's contents, and the cache's last token against the K/V the step appended."""
    out = case.run()
    if out.is_cuda:
        torch.cuda.synchronize(out.device)
    batch = case.q.shape[0]
    rel_err, append_ok = 0.0, True
    for i in sorted({0, batch - 1}):
        keys, values = case.gather(i)
        append_ok &= torch.equal(keys[-1], case.k_new[i]) and torch.equal(values[-1], case.v_new[i])
        expected = reference(case.q[i], keys, values, shape.scale)
        error = (out[i].float().reshape(expected.shape) - expected).abs().max()
        rel_err = max(rel_err, float(error / expected.abs().max().clamp_min(1e-12)))
    return {"rel_err": rel_err, "append_ok": append_ok, "check_ok": append_ok and rel_err <= REL_TOLERANCE}


class Timer:
    """CUDA-event timing of one call, with an L2 flush before each and, for device time, a GPU sleep."""

    def __init__(self, sleep_us: float, flush_bytes: int) -> None:
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device="cuda") if flush_bytes else None
        self.sleep_cycles = 0
        if sleep_us > 0:
            cycles = 1 << 20
            torch.cuda._sleep(cycles)  # warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            self.sleep_cycles = max(1, int(cycles * (sleep_us / 1e3) / start.elapsed_time(end)))

    def _flush(self) -> None:
        if self.flush is not None:
            self.flush.zero_()

    def measure(self, run: Callable[[], Any], iters: int, warmup: int) -> tuple[list[float], list[float]]:
        """Microseconds per call: (device time, launches hidden; eager time, from an idle GPU)."""
        for _ in range(warmup):
            run()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            self._flush()
            if self.sleep_cycles:
                torch.cuda._sleep(self.sleep_cycles)  # the GPU waits while the host queues the call
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        device = [start.elapsed_time(end) * 1e3 for start, end in events]
        for start, end in events:
            self._flush()
            torch.cuda.synchronize()
            start.record()
            run()
            end.record()
        torch.cuda.synchronize()
        eager = [start.elapsed_time(end) * 1e3 for start, end in events]
        return device, eager


def library_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {
        "flash_attn": package_version("flash-attn", "flash_attn"),
        "flashinfer": package_version("flashinfer-python", "flashinfer"),
        "cuda_bindings": package_version("cuda-bindings", "cuda-python"),
        "torch": torch.__version__,
    }
    for module in ("flash_attn", "flashinfer"):
        if versions[module] is None:  # installed without package metadata (e.g. on PYTHONPATH)
            with contextlib.suppress(ImportError):
                versions[module] = getattr(importlib.import_module(module), "__version__", None)
    return versions


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    """Latency vs batch, one line per variant: device time (left) and eager time (right)."""
    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5), sharey=True)
    batches = sorted({r["batch"] for r in rows})
    for variant, label in VARIANTS.items():
        done = [r for r in rows if r["variant"] == variant and r["status"] == "ok"]
        if not done:
            continue
        style = "-" if variant.startswith("vattn") else "--"
        for ax, key in zip(axes, ("device_us", "eager_us"), strict=True):
            ax.plot([r["batch"] for r in done], [r[key] for r in done], style, marker="o", label=label)
    panels = ("device time (host launch overhead hidden)", "eager call (from an idle GPU)")
    for ax, what in zip(axes, panels, strict=True):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(batches, [str(b) for b in batches])
        ax.set_xlabel("batch (requests, one new token each)")
        ax.set_title(what)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("decode attention latency per step (us, median)")
    save_figure(fig, path, title)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,2,4,8,16,32", help="comma-separated batch sizes")
    parser.add_argument("--context", type=int, default=16384, help="tokens cached per request before the step")
    parser.add_argument("--query-heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=parse_size, default=2 * MiB, help="vattn's CUDA page size (2M granules)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: %(default)s")
    parser.add_argument("--iters", type=int, default=100, help="timed calls per variant and batch (median reported)")
    parser.add_argument("--warmup", type=int, default=10, help="untimed calls first")
    parser.add_argument("--sleep-us", type=float, default=1000, help="GPU sleep queued before each device-time call")
    parser.add_argument("--no-flush-l2", action="store_true", help="keep the L2 cache warm between calls")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results directory")
    parser.add_argument("--name", default="gpu_decode", help="file name stem of the results")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if unknown := [v for v in variants if v not in VARIANTS]:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    exit_unless_cuda(need_bindings=False)  # the paged baselines need no cuda-python

    shape = Shape(args.query_heads, args.kv_heads, args.head_dim, torch.bfloat16, args.context)
    device = torch.device("cuda", torch.cuda.current_device())
    gpu = gpu_facts()
    flush_bytes = 0 if args.no_flush_l2 else max(256 * MiB, 2 * (gpu["l2_cache_bytes"] or 0))
    timer = Timer(args.sleep_us, flush_bytes)
    meta = {"command": command_line(), **machine_facts(), "gpu": gpu, "libraries": library_versions()}

    rows: list[dict[str, Any]] = []
    samples: dict[str, dict[int, dict[str, list[float]]]] = {}
    skipped: dict[str, str] = {}
    failed: list[str] = []
    started = time.perf_counter()
    jobs = [(variant, batch) for variant in variants for batch in batches]
    for variant, batch in tqdm(jobs, desc="decode attention", unit="case"):
        row: dict[str, Any] = {"variant": variant, "label": VARIANTS[variant], "batch": batch, "context": args.context}
        if variant in skipped:
            rows.append({**row, "status": "skipped", "reason": skipped[variant]})
            continue
        case: Case | None = None
        try:
            case = build_case(variant, shape, batch, args.page_size, device)
            kv_cache_bytes = case.kv_bytes
            device_us, eager_us = timer.measure(case.run, args.iters, args.warmup)
            checked = check(case, shape)
        except MISSING as exc:
            skipped[variant] = f"{type(exc).__name__}: {exc}"
            rows.append({**row, "status": "skipped", "reason": skipped[variant]})
            continue
        except Exception as exc:  # recorded, the other variants still run; the exit status says so
            traceback.print_exc()
            failed.append(f"{variant} at batch {batch}: {type(exc).__name__}: {exc}")
            rows.append({**row, "status": "failed", "reason": f"{type(exc).__name__}: {exc}"})
            continue
        finally:
            if case is not None:
                case.close()
            del case
            torch.cuda.empty_cache()
        read_bytes = 2 * batch * shape.tokens * shape.kv_heads * shape.head_dim * shape.dtype.itemsize
        device_med = statistics.median(device_us)
        rows.append(
            {
                **row,
                "status": "ok",
                "device_us": device_med,
                "device_us_min": min(device_us),
                "device_us_max": max(device_us),
                "eager_us": statistics.median(eager_us),
                "eager_us_min": min(eager_us),
                "kv_read_bytes": read_bytes,
                "kv_read_gbps": read_bytes / device_med / 1e3,
                "kv_cache_bytes": kv_cache_bytes,
                **checked,
            }
        )
        samples.setdefault(variant, {})[batch] = {"device_us": device_us, "eager_us": eager_us}
        if not checked["check_ok"]:
            failed.append(
                f"{variant} at batch {batch}: output check failed (rel_err {checked['rel_err']:.3g}, "
                f"appended K/V {'ok' if checked['append_ok'] else 'wrong'})"
            )

    ok_rows = [r for r in rows if r["status"] == "ok"]
    if not ok_rows and not failed:
        reasons = "; ".join(f"{v}: {why}" for v, why in skipped.items())
        cannot_run(f"no variant is available ({reasons})")

    csv_path, json_path, png_path = write_results(
        args.out,
        args.name,
        rows,
        {
            "meta": meta,
            "config": {
                "batches": batches,
                "context": args.context,
                "query_heads": shape.query_heads,
                "kv_heads": shape.kv_heads,
                "head_dim": shape.head_dim,
                "dtype": str(shape.dtype),
                "vattn_page_size": args.page_size,
                "iters": args.iters,
                "warmup": args.warmup,
                "sleep_us": args.sleep_us,
                "l2_flush_bytes": flush_bytes,
                "rel_tolerance": REL_TOLERANCE,
                "method": "plan once, repeat the same decode step (same position overwritten each call); "
                "device_us: call queued behind a GPU sleep after an L2 flush; eager_us: from an idle GPU",
            },
            "skipped": skipped,
            "failed": failed,
            "rows": rows,
            "samples_us": samples,
            "seconds": time.perf_counter() - started,
        },
    )
    title = (
        f"{meta['command']}  |  {gpu['device_name']}, context {args.context}, "
        f"{shape.query_heads}/{shape.kv_heads} heads x {shape.head_dim}, bf16, {meta['date']}"
    )
    plot(rows, png_path, title)

    names = [v for v in variants if v not in skipped]
    for key, what in (("device_us", "device time"), ("eager_us", "eager call")):
        print(f"\ndecode attention, {what}, median us ({gpu['device_name']}, context {args.context})")
        print(f"{'batch':>5} " + " ".join(f"{VARIANTS[name]:>28}" for name in names))
        for batch in batches:
            cells = []
            for name in names:
                found = [r for r in ok_rows if r["variant"] == name and r["batch"] == batch]
                cells.append(f"{found[0][key]:28.1f}" if found else f"{'-':>28}")
            print(f"{batch:>5} " + " ".join(cells))
    for variant, reason in skipped.items():
        print(f"skipped {variant}: {reason}")
    print(f"vattn page size {size_label(args.page_size)}; wrote {csv_path}, {json_path}, {png_path}")
    if failed:
        for line in failed:
            print(f"FAILED {line}", file=sys.stderr)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
