"""Fig. 11, the three optimizations that hide physical-memory allocation: prefill time of
a stream of requests with all of them on, each one switched off alone, and all off, per
host page size.

- overlap: a background thread maps the next pages while the model computes
  (`KVCacheConfig.background`). Eager allocation is that thread's work too, so with
  overlap off it is off as well.
- deferred reclamation: a finished request's slot keeps its pages for the next request
  that gets the reqid. Off: `release_idle()` right after each `free_reqid`, which unmaps
  every idle slot's pages back into the pool (where they stay faulted in: the next map
  takes recycled pages, not fresh ones).
- eager allocation: one page group pre-mapped behind the reqid handed out next
  (`KVCacheConfig.eager_pages` 1; off: 0).

Measured at the allocator level on the real host backend (memfd pages mapped into the
reserved address space), the default model's shapes (30 layers, 3 KV heads of 64, fp32),
4 slots, no memory budget (the pool never falls to the reclaim watermark). The same
seeded stream of prompt lengths runs in every configuration, one request at a time: the
next request gets its reqid at the end of the previous one's last decode iteration,
before that one is freed (so `release_idle` cannot take the next reqid's eager pages).
Each request: prefill = `step({reqid: prompt})` then the prompt's compute; then
`--decode-steps` decode iterations (`step` to one token more, then that token's compute).

The compute is real attention, not the whole model: every layer runs vattn's `sdpa`
kernel (the prompt's K/V stored into the cache's pages, then causal torch SDPA of 9
query heads over them; one token's store and attention in decode), with the same random
Q/K/V in every layer. Its time grows faster than the prompt (attention is quadratic), it
writes every page the step mapped, and the model's projections and MLP (several times
more) are left out, so mapping is a larger share here than in a whole prefill. Reported: prefill time (step +
compute) p50/p99, the time inside the prefill's `step()` (mapping on the critical path),
and where the prefill's page needs were met (`MappingCounters`: by the background thread,
by a kept slot, or mapped in `step()` itself); the CSV also has the whole stream's
counters, decode steps included. First `--warmup` requests are not counted.

    python -m paper_repro optimizations [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from measure.results import (
    CpuShare,
    command_line,
    machine_facts,
    percentiles,
    prewarm_memory,
    print_table,
    save_figure,
    write_results,
)
from paper_repro._harness import DEFAULT_MODEL, results_dir
from vattn import KVCache, KVCacheConfig
from vattn.attention import AttentionKernel
from vattn.kernels import make_kernel
from vattn.sizes import KiB, MiB
from vattn.stats import CacheStats, MappingCounters

PAGE_SIZES = (64 * KiB, 256 * KiB, 2 * MiB)
SLOTS = 4
"""Two requests meet at a hand-over; the rest keeps the pool far above the reclaim watermark."""
NEEDS = ("page_needs", "needs_met_by_background", "needs_met_by_reuse", "needs_mapped_in_step")


@dataclass(frozen=True)
class Setting:
    """Which of the three optimizations are on."""

    label: str
    overlap: bool
    deferred: bool
    eager: bool


SETTINGS = (
    Setting("all on", True, True, True),
    Setting("no overlap", False, True, True),
    Setting("no deferred reclaim", True, False, True),
    Setting("no eager", True, True, False),
    Setting("all off", False, False, False),
)


def attend(kernel: AttentionKernel, reqid: int, new: int, qkv: tuple[torch.Tensor, ...]) -> None:
    """Every layer's attention for the last `new` tokens of the request: K/V stored, SDPA run."""
    q, k, v = (t[:new] for t in qkv)
    batch = kernel.plan([reqid], [new])  # pins the slot until it goes, at return
    for layer in range(DEFAULT_MODEL.num_layers):
        kernel.forward(layer, batch, q, k, v)


def needs(counters: MappingCounters) -> dict[str, int]:
    return {name: getattr(counters, name) for name in NEEDS}


def page_label(page_size: int) -> str:
    return f"{page_size // MiB} MiB" if page_size >= MiB else f"{page_size // KiB} KiB"


def run_stream(setting: Setting, page_size: int, prompts: list[int], decode_steps: int, warmup: int) -> dict[str, Any]:
    """Runs the stream on a fresh cache; returns the row of the requests after `warmup`."""
    shape = DEFAULT_MODEL
    cache = KVCache(
        KVCacheConfig(
            shape.num_layers,
            shape.num_kv_heads,
            shape.head_dim,
            max_slots=SLOTS,
            max_context=max(prompts) + decode_steps,
            dtype="float32",
            page_size=page_size,
            background=setting.overlap,
            eager_pages=int(setting.eager),
        )
    )
    kernel = make_kernel("sdpa", cache, shape.num_query_heads)
    generator = torch.Generator().manual_seed(0)
    qkv = tuple(
        torch.randn(max(prompts), heads, shape.head_dim, generator=generator)
        for heads in (shape.num_query_heads, shape.num_kv_heads, shape.num_kv_heads)
    )
    records: list[dict[str, Any]] = []
    start, share = cache.stats(), CpuShare()
    reqid = cache.alloc_reqid()
    for i, prompt in enumerate(prompts):
        if i == warmup:
            start, share = cache.stats(), CpuShare()
        before = needs(cache.stats().counters)
        t0 = time.perf_counter()
        cache.step({reqid: prompt})
        t1 = time.perf_counter()
        attend(kernel, reqid, prompt, qkv)
        t2 = time.perf_counter()
        after = needs(cache.stats().counters)  # need counts change only in step(): the prefill's own
        decode = []
        for length in range(prompt + 1, prompt + decode_steps + 1):
            t3 = time.perf_counter()
            cache.step({reqid: length})
            decode.append(time.perf_counter() - t3)
            attend(kernel, reqid, 1, qkv)
        records.append(
            {"prefill": t2 - t0, "step": t1 - t0, "compute": t2 - t1, "decode": decode}
            | {name: after[name] - before[name] for name in NEEDS}
        )
        following = cache.alloc_reqid() if i + 1 < len(prompts) else -1  # admitted before this one leaves
        cache.free_reqid(reqid)
        if not setting.deferred:
            cache.release_idle()
        reqid = following
    cpu, end = share.stop(), cache.stats()
    del kernel
    cache.close()
    measured = {"page_size": page_size, "page": page_label(page_size), "setting": setting.label}
    return (
        measured
        | stream_row(setting, records[warmup:], prompts[warmup:], start, end)
        | {"other_cpu_share": cpu["other_share"]}
    )


def stream_row(
    setting: Setting, records: list[dict[str, Any]], prompts: list[int], start: CacheStats, end: CacheStats
) -> dict[str, Any]:
    """The measured requests' times (percentiles) and the cache's counters between `start` and `end`."""
    times = {
        f"{name}_{key}_ms": 1000 * value
        for name in ("prefill", "step", "compute")
        for key, value in percentiles([r[name] for r in records]).items()
        if key in ("p50", "p99", "mean")
    }
    decode = [seconds for r in records for seconds in r["decode"]] or [0.0]
    counters, begin = end.counters, start.counters
    return {
        "overlap": setting.overlap,
        "deferred": setting.deferred,
        "eager": setting.eager,
        "requests": len(records),
        "prompt_mean": sum(prompts) / len(records),
        **times,
        "decode_step_mean_ms": 1000 * sum(decode) / len(decode),
        "decode_step_max_ms": 1000 * max(decode),
        **{f"prefill_{name}": sum(r[name] for r in records) for name in NEEDS},
        **{name: getattr(counters, name) - getattr(begin, name) for name in NEEDS},
        "map_pages": counters.map.pages - begin.map.pages,
        "map_s": counters.map.seconds - begin.map.seconds,
        "populate_s": counters.populate.seconds - begin.populate.seconds,
        "unmap_pages": counters.unmap.pages - begin.unmap.pages,
        "fresh_pages_taken": end.fresh_pages_taken - start.fresh_pages_taken,
        "recycled_pages_taken": end.recycled_pages_taken - start.recycled_pages_taken,
        "background_errors": end.background_errors,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--requests", type=int, default=16, help="measured requests per configuration")
    parser.add_argument("--warmup", type=int, default=2, help="requests run first and not counted")
    parser.add_argument("--min-prompt", type=int, default=256)
    parser.add_argument("--max-prompt", type=int, default=2048)
    parser.add_argument("--decode-steps", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prewarm", type=int, default=512 * MiB, help="bytes touched first (see prewarm_memory)")
    args = parser.parse_args(argv)
    page_sizes = PAGE_SIZES[:1] if args.quick else PAGE_SIZES
    if args.quick:
        args.requests, args.warmup, args.min_prompt, args.max_prompt, args.decode_steps = 5, 1, 64, 256, 2
        args.prewarm = 64 * MiB
    generator = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(args.min_prompt, args.max_prompt + 1, (args.warmup + args.requests,), generator=generator)
    prewarm = prewarm_memory(args.prewarm)
    runs = [(p, s) for p in page_sizes for s in SETTINGS]
    rows = [
        run_stream(setting, page_size, prompts.tolist(), args.decode_steps, args.warmup)
        for page_size, setting in tqdm(runs, desc="optimizations")
    ]
    baseline = {r["page_size"]: r["prefill_p50_ms"] for r in rows if r["setting"] == SETTINGS[0].label}
    rows = [r | {"vs_all_on": r["prefill_p50_ms"] / baseline[r["page_size"]]} for r in rows]
    csv_path, json_path, png_path = write_results(
        args.out,
        "optimizations",
        rows,
        {
            "command": command_line(),
            "machine": machine_facts(),
            "args": vars(args),
            "prewarm": prewarm,
            "prompts": prompts.tolist(),
            "rows": rows,
        },
    )
    print_table(
        rows,
        [
            ("page", "page", 8, ""),
            ("setting", "setting", 20, ""),
            ("p50 ms", "prefill_p50_ms", 8, ".1f"),
            ("p99 ms", "prefill_p99_ms", 8, ".1f"),
            ("x all on", "vs_all_on", 8, ".3f"),
            ("step p50", "step_p50_ms", 8, ".2f"),
            ("step p99", "step_p99_ms", 8, ".2f"),
            ("by bg", "prefill_needs_met_by_background", 6, ""),
            ("reused", "prefill_needs_met_by_reuse", 6, ""),
            ("in step", "prefill_needs_mapped_in_step", 7, ""),
            ("dec step", "decode_step_mean_ms", 8, ".3f"),
        ],
        f"prefill (step + attention of every layer), {args.requests} requests of "
        f"{args.min_prompt}..{args.max_prompt} tokens; page needs of the prefills (page groups); "
        "decode step: mean ms inside step()",
    )
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    pages = list(dict.fromkeys(r["page_size"] for r in rows))
    width = 0.8 / len(SETTINGS)
    for axis, metric, label, title in (
        (left, "prefill_p50_ms", "prefill p50 (ms)", "step + every layer's attention"),
        (right, "step_p50_ms", "inside step() p50 (ms)", "the prefill's mapping on the critical path"),
    ):
        for i, setting in enumerate(SETTINGS):
            values = [
                next(r[metric] for r in rows if r["page_size"] == p and r["setting"] == setting.label) for p in pages
            ]
            axis.bar([j + i * width for j in range(len(pages))], values, width, label=setting.label)
        axis.set_xticks([j + 0.4 - width / 2 for j in range(len(pages))], [page_label(p) for p in pages])
        axis.set_xlabel("page size")
        axis.set_ylabel(label)
        axis.set_title(title, fontsize=9)
        axis.legend(fontsize=7)
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
