"""Fig. 9, decode: attention latency and decode tokens/s against batch size at a long
context, virtual against paged with blocks of 16 and 128.

- attention alone: one layer's decode attention (one new token per request, its K/V
  stored first) for every request at `--context` tokens, the variants timed in turn round
  after round (a slow spell of the machine falls on all alike). On the CPU, the default
  model's shapes: virtual, vattn's `ragged` kernel on the slots' contiguous rows; paged,
  `paged` (the same native kernel reading rows through the block table), `paged_gather`
  (blocks gathered for torch SDPA) and `paged_blockwise` (blocks attended one at a time in
  torch with an online-softmax merge). On a GPU, Llama-3-8B's shapes in bfloat16 at 16K
  tokens, each kernel family on either cache (`_harness.CUDA_VARIANTS`).
- the model: decode tokens/s of the engine on either cache, every request at about
  `--model-context` tokens (on the CPU the default kernels, on a GPU each kernel family).

    python -m paper_repro decode [--quick]
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

CPU_VARIANTS = (
    Variant("virtual", "ragged"),
    Variant("paged", "paged", 16),
    Variant("paged", "paged", 128),
    Variant("paged", "paged_gather", 16),
    Variant("paged", "paged_blockwise", 16),
)
CPU_MODEL_VARIANTS = (Variant("virtual", "ragged"), Variant("paged", "paged", 16))


def attention_rows(
    variants: Sequence[Variant], shape: PaperModel, batches: list[int], context: int, repeats: int
) -> list[dict[str, Any]]:
    rows = []
    for batch in tqdm(batches, desc="decode attention"):
        keys = {"table": "attention", "model": shape.name, "batch": batch, "context": context}
        timed, failures = attention_seconds(variants, shape, batch, context, 1, repeats)
        rows += [unmeasured(variant, exc, **keys) for variant, exc in failures]
        for variant, seconds in timed.items():
            rows.append(measured(variant, **keys, ms=1000 * seconds, tokens_per_s=batch / (seconds * shape.num_layers)))
    return with_ratio(rows, ("batch",), "ms")


def decode_step_seconds(llm: LLM, batch: int, context: int, steps: int) -> float:
    """Seconds per engine iteration with `batch` requests of `context` tokens all decoding."""
    engine, vocab = llm.engine, llm.tokenizer.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    generator = torch.Generator().manual_seed(batch)
    ids = [
        engine.add_request(torch.randint(100, vocab, (context,), generator=generator).tolist(), params)
        for _ in range(batch)
    ]
    decoding: set[str] = set()
    while len(decoding) < batch:  # until every prompt is in and each request has a token
        decoding |= {delta.request_id for delta in engine.step() if delta.token_ids}
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    for request_id in ids:
        engine.abort(request_id)
    engine.step()
    return seconds


def model_rows(
    variants: Sequence[Variant], batches: list[int], context: int, steps: int, model: str | None
) -> list[dict[str, Any]]:
    def decode_step(llm: LLM, point: dict[str, Any]) -> dict[str, Any]:
        seconds = decode_step_seconds(llm, point["batch"], context, steps)
        return {"ms": 1000 * seconds, "tokens_per_s": point["batch"] / seconds}

    sizes = {"model": model, "max_slots": max(batches), "max_context": context + steps + 8, "kv_budget": 2 << 30}
    points = [{"batch": batch} for batch in batches]
    keys = {"table": "model", "model": model or DEFAULT_MODEL.name, "context": context}
    rows = []
    for variant in tqdm(variants, desc="decode model"):  # each built and measured under its own guard
        rows += engine_rows(variant, sizes, points, decode_step, **keys)
    return with_ratio(rows, ("batch",), "ms")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--context", type=int, help="tokens per request (default 4096 on the CPU, 16384 on a GPU)")
    parser.add_argument("--model-context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32], help="of the attention table")
    parser.add_argument("--model-batches", type=int, nargs="+", default=[1, 8, 32], help="of the model table")
    parser.add_argument("--model", help="the model table's model (default: the default model), e.g. synthetic:paper")
    parser.add_argument("--attention-only", action="store_true", help="no model table")
    args = parser.parse_args(argv)
    batches, model_batches = args.batches, args.model_batches
    if on_gpu():
        variants, model_variants, shape = CUDA_VARIANTS, CUDA_VARIANTS, PAPER_MODELS[1]
    else:
        variants, model_variants, shape = CPU_VARIANTS, CPU_MODEL_VARIANTS, DEFAULT_MODEL
    context = args.context or (16384 if on_gpu() else 4096)
    if args.quick:
        batches, model_batches, context, args.model_context, args.repeats, args.steps = [1, 2], [2], 64, 32, 1, 1
    if args.attention_only:
        model_variants = ()
    rows = attention_rows(variants, shape, batches, context, args.repeats) + model_rows(
        model_variants, model_batches, args.model_context, args.steps, args.model
    )
    csv_path, json_path, png_path = write_results(
        args.out,
        "decode",
        rows,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows},
    )
    columns = [
        ("batch", "batch", 6, ""),
        ("context", "context", 8, ""),
        ("variant", "variant", 22, ""),
        ("ms", "ms", 9, ".2f"),
        ("tok/s", "tokens_per_s", 9, ".1f"),
        ("x virtual", "vs_virtual", 9, ".2f"),
    ]
    ok = [r for r in rows if r["status"] == "ok"]
    print_table([r for r in ok if r["table"] == "attention"], columns, f"decode attention, one layer of {shape.name}")
    print_table([r for r in ok if r["table"] == "model"], columns, f"decode steps, {args.model or 'the default model'}")
    plot(rows, png_path)
    report_unmeasured(rows)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for axis, table, metric, label in (
        (left, "attention", "ms", "attention latency per layer (ms)"),
        (right, "model", "tokens_per_s", "decode tokens/s"),
    ):
        chosen = [r for r in rows if r["status"] == "ok" and r["table"] == table]
        for variant in dict.fromkeys(r["variant"] for r in chosen):
            points = [r for r in chosen if r["variant"] == variant]
            axis.plot([r["batch"] for r in points], [r[metric] for r in points], marker="o", label=variant)
        axis.set_xlabel("batch size")
        axis.set_ylabel(label)
        axis.set_xscale("log", base=2)
        axis.legend(fontsize=7)
    left.set_title("one layer's decode attention")
    right.set_title("the model")
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
