"""Table 8, fragmentation and capacity: tokens per page, worst-case waste per request, and
the largest batch of `--context`-token requests a fixed KV budget holds, virtual (per page
size) against paged (per block size).

For the default model every figure is measured on the real caches (host pages mapped by
vattn's KVCache, blocks handed out by the paged cache): a request is stepped one token
past a page (or block) boundary and the cache's own stats give the waste; requests are
admitted and stepped until the budget refuses one. For the paper's three models (fp16,
their attention shapes) the same figures come from the layout arithmetic the caches use,
which the default model's rows check (`computed_max_batch` beside the measured one).

    python -m paper_repro fragmentation [--quick]
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from measure.results import command_line, machine_facts, print_table, save_figure, write_results
from paper_repro._harness import DEFAULT_MODEL, PAPER_MODELS, PaperModel, results_dir
from vattn import KVCache, KVCacheConfig, OutOfPagesError, OutOfSlotsError
from vattn.paged import PagedKVCache, PagedKVCacheConfig
from vattn.sizes import GiB, KiB, MiB

PAGE_SIZES = (64 * KiB, 128 * KiB, 256 * KiB, 2 * MiB)
BLOCK_SIZES = (16, 128)


def per_layer_token_bytes(shape: PaperModel, element: int) -> int:
    return shape.num_kv_heads * shape.head_dim * element


def computed(shape: PaperModel, element: int, kind: str, unit: int, context: int, budget: int) -> dict[str, Any]:
    """Tokens per page, worst-case waste and max batch from the layout arithmetic."""
    token = per_layer_token_bytes(shape, element)
    tensors = 2 * shape.num_layers
    if kind == "virtual":  # one page per K and V tensor of every layer at a time
        tokens_per_page = unit / token
        per_request = math.ceil(context * token / unit) * unit * tensors
        waste = tensors * (unit - token)
    else:  # a block holds `unit` tokens of every layer's K and V
        tokens_per_page = unit
        per_request = math.ceil(context / unit) * unit * token * tensors
        waste = (unit - 1) * token * tensors
    return {"tokens_per_page": tokens_per_page, "worst_waste_bytes": waste, "computed_max_batch": budget // per_request}


def measured(kind: str, unit: int, context: int, budget: int, slots: int) -> dict[str, Any]:
    """The same figures from the real caches for the default model (fp32)."""
    shape = DEFAULT_MODEL
    common = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
    tokens_per_page = unit // per_layer_token_bytes(shape, 4) if kind == "virtual" else unit
    context_room = max(context, tokens_per_page + 1)  # the probe goes one token past a page
    if kind == "virtual":
        cache: KVCache | PagedKVCache = KVCache(
            KVCacheConfig(
                **common,
                max_slots=slots,
                max_context=context_room,
                dtype="float32",
                page_size=unit,
                memory_budget=budget,
                background=False,
                eager_pages=0,
            )
        )
    else:
        cache = PagedKVCache(
            PagedKVCacheConfig(
                **common,
                max_slots=slots,
                max_context=context_room,
                dtype="float32",
                block_size=unit,
                memory_budget=budget,
            )
        )
    probe = cache.alloc_reqid()
    cache.step({probe: tokens_per_page + 1})  # one token into a second page: the worst case
    waste = cache.stats().waste_bytes
    cache.free_reqid(probe)
    if isinstance(cache, KVCache):
        cache.release_idle()
    admitted = 0
    try:
        while True:
            reqid = cache.alloc_reqid()
            cache.step({reqid: context})
            admitted += 1
    except (OutOfPagesError, OutOfSlotsError):
        pass
    cache.close()
    return {"measured_worst_waste_bytes": waste, "measured_max_batch": admitted}


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--context", type=int, default=1000, help="tokens per request for the max batch")
    parser.add_argument("--budget", type=int, default=512 * MiB, help="KV bytes for the default model")
    parser.add_argument("--paper-budget", type=int, default=40 * GiB, help="KV bytes for the paper's models")
    args = parser.parse_args(argv)
    page_sizes = PAGE_SIZES[:1] if args.quick else PAGE_SIZES
    if args.quick:
        args.budget, args.context = 32 * MiB, 256
    units = [("virtual", p) for p in page_sizes] + [("paged", b) for b in BLOCK_SIZES]
    rows: list[dict[str, Any]] = []
    for kind, unit in tqdm(units, desc="fragmentation"):
        row = {"model": DEFAULT_MODEL.name, "dtype": "float32", "cache": kind, "unit": unit}
        row |= computed(DEFAULT_MODEL, 4, kind, unit, args.context, args.budget)
        rows.append(row | measured(kind, unit, args.context, args.budget, slots=4096))
    for shape in PAPER_MODELS:
        for kind, unit in units:
            row = {"model": shape.name, "dtype": "float16", "cache": kind, "unit": unit}
            rows.append(row | computed(shape, 2, kind, unit, args.context, args.paper_budget))
    csv_path, json_path, png_path = write_results(
        args.out,
        "fragmentation",
        rows,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows},
    )
    print_table(
        rows,
        [
            ("model", "model", 12, ""),
            ("cache", "cache", 8, ""),
            ("page/block", "unit", 10, ""),
            ("tok/page", "tokens_per_page", 9, ".1f"),
            ("waste B", "worst_waste_bytes", 10, ""),
            ("measured", "measured_worst_waste_bytes", 10, ""),
            ("max batch", "computed_max_batch", 10, ""),
            ("measured", "measured_max_batch", 9, ""),
        ],
        f"{args.context}-token requests; budgets: default model {args.budget >> 20} MiB, paper models "
        f"{args.paper_budget >> 30} GiB",
    )
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    fig, axis = plt.subplots(figsize=(8, 4))
    models = list(dict.fromkeys(r["model"] for r in rows))
    labels = list(dict.fromkeys(f"{r['cache']} {r['unit']}" for r in rows))
    width = 0.8 / len(labels)
    for i, label in enumerate(labels):
        values = [
            next(r["worst_waste_bytes"] for r in rows if r["model"] == m and f"{r['cache']} {r['unit']}" == label) / MiB
            for m in models
        ]
        axis.bar([j + i * width for j in range(len(models))], values, width, label=label)
    axis.set_xticks([j + 0.4 - width / 2 for j in range(len(models))], models)
    axis.set_ylabel("worst-case waste per request (MiB)")
    axis.set_yscale("log")
    axis.legend(fontsize=7, ncol=2)
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
