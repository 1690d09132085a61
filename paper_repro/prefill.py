"""Fig. 8 / Table 6, prefill: prompt tokens/s and time to first token against context
length at batch 1, virtual against paged, per kernel.

- attention alone: one layer's causal attention over the whole prompt. On the CPU the
  virtual cache runs torch SDPA (its flash kernel) on the slot's contiguous view; the paged
  cache must first gather its blocks (16 or 128 tokens) into one tensor, the only way to
  reach an unmodified kernel. The default model's shapes up to 8K tokens and the paper's
  three models' shapes at the largest context that fits the time here. On a GPU, each
  kernel family on either cache (`_harness.CUDA_VARIANTS`), bfloat16, the paper's models
  at 4K-64K tokens.
- the model: time to first token of `LLM.generate` on either cache (chunked prefill of 256
  tokens; on the CPU the default kernels, on a GPU each kernel family), best of `--rounds`.

    python -m paper_repro prefill [--quick]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from measure.results import command_line, machine_facts, print_table, save_figure, write_results
from paper_repro._harness import (
    CUDA_VARIANTS,
    DEFAULT_MODEL,
    PAPER_MODELS,
    PaperModel,
    Variant,
    attention_seconds,
    engine_rows,
    measured,
    on_gpu,
    report_unmeasured,
    results_dir,
    unmeasured,
    with_ratio,
)
from serving import LLM, SamplingParams

CPU_VARIANTS = (Variant("virtual", "sdpa"), Variant("paged", "paged_gather", 16), Variant("paged", "paged_gather", 128))
CPU_MODEL_VARIANTS = (Variant("virtual", "ragged"), Variant("paged", "paged", 16))


def attention_rows(
    variants: Sequence[Variant], shapes: list[tuple[PaperModel, int]], repeats: int
) -> list[dict[str, Any]]:
    rows = []
    for shape, context in tqdm(shapes, desc="prefill attention"):
        keys = {"table": "attention", "model": shape.name, "context": context}
        timed, failures = attention_seconds(variants, shape, 1, context, context, repeats)
        rows += [unmeasured(variant, exc, **keys) for variant, exc in failures]
        for variant, seconds in timed.items():
            rows.append(measured(variant, **keys, ms=1000 * seconds, tokens_per_s=context / seconds))
    return with_ratio(rows, ("model", "context"), "ms")


def model_rows(
    variants: Sequence[Variant], contexts: list[int], rounds: int, model: str | None
) -> list[dict[str, Any]]:
    def first_token(llm: LLM, point: dict[str, Any]) -> dict[str, Any]:
        context = point["context"]
        generator = torch.Generator().manual_seed(context)
        ids = torch.randint(100, llm.tokenizer.vocab_size, (context,), generator=generator).tolist()
        best = float("inf")
        for _ in range(rounds):
            start = time.perf_counter()
            llm.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        return {"ms": 1000 * best, "tokens_per_s": context / best}

    sizes = {"model": model, "max_slots": 2, "max_context": max(contexts) + 8, "kv_budget": 512 << 20}
    points = [{"context": context} for context in contexts]
    rows = []
    for variant in tqdm(variants, desc="prefill model"):  # each built and measured under its own guard
        rows += engine_rows(variant, sizes, points, first_token, table="model", model=model or DEFAULT_MODEL.name)
    return with_ratio(rows, ("model", "context"), "ms")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--model", help="the model table's model (default: the default model), e.g. synthetic:paper")
    parser.add_argument("--attention-only", action="store_true", help="no model table")
    parser.add_argument("--gpu-contexts", type=int, nargs="+", default=[4096, 16384, 65536], help="on a GPU")
    args = parser.parse_args(argv)
    if on_gpu():
        variants, model_variants = CUDA_VARIANTS, CUDA_VARIANTS
        shapes = [(m, n) for m in PAPER_MODELS for n in args.gpu_contexts]
        contexts = [1024, 2048, 4096, 8000]
    else:
        variants, model_variants = CPU_VARIANTS, CPU_MODEL_VARIANTS
        shapes = [(DEFAULT_MODEL, n) for n in (1024, 2048, 4096, 8192)] + [(m, 2048) for m in PAPER_MODELS]
        contexts = [1024, 2048, 4096]
    if args.quick:
        shapes, contexts, args.repeats, args.rounds = [(DEFAULT_MODEL, 256)], [128], 1, 1
    if args.attention_only:
        model_variants = ()
    rows = attention_rows(variants, shapes, args.repeats) + model_rows(
        model_variants, contexts, args.rounds, args.model
    )
    csv_path, json_path, png_path = write_results(
        args.out,
        "prefill",
        rows,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows},
    )
    columns = [
        ("model", "model", 12, ""),
        ("context", "context", 8, ""),
        ("variant", "variant", 22, ""),
        ("ms", "ms", 9, ".1f"),
        ("tok/s", "tokens_per_s", 9, ".0f"),
        ("x virtual", "vs_virtual", 9, ".2f"),
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    print_table([r for r in ok if r["table"] == "attention"], columns, "prefill attention, one layer, batch 1")
    model = args.model or DEFAULT_MODEL.name
    print_table([r for r in ok if r["table"] == "model"], columns, f"time to first token, {model}")
    plot(rows, png_path, model)
    report_unmeasured(rows)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Any, model_name: str) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    shown = PAPER_MODELS[1].name if on_gpu() else DEFAULT_MODEL.name  # the attention panel's model
    for axis, table in ((left, "attention"), (right, "model")):
        model = shown if table == "attention" else model_name
        chosen = [r for r in rows if r["status"] == "ok" and r["table"] == table and r["model"] == model]
        for variant in dict.fromkeys(r["variant"] for r in chosen):
            points = [r for r in chosen if r["variant"] == variant]
            axis.plot([r["context"] for r in points], [r["tokens_per_s"] for r in points], marker="o", label=variant)
        axis.set_xlabel("prompt tokens")
        axis.set_ylabel("prompt tokens/s")
        axis.legend(fontsize=7)
    left.set_title(f"one layer's attention, {shown}")
    right.set_title("the model: prompt / time to first token")
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
