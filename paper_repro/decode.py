"""Fig. 9, decode: attention latency and decode tokens/s against batch size at a long
context, virtual against paged with blocks of 16 and 128.

- attention alone: one layer's decode attention (one new token per request, its K/V
  stored first) for every request at `--context` tokens. Virtual: vattn's `ragged` kernel
  on the slots' contiguous rows. Paged: `paged`, the same native kernel reading rows
  through the block table; `paged_gather`, blocks gathered for torch SDPA; and
  `paged_blockwise`, blocks attended one at a time in torch with an online-softmax merge.
- the model: decode tokens/s of the engine with `--kv-cache virtual|paged` (default
  kernels), every request at about `--model-context` tokens.

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

from benchmarks._common import command_line, machine_facts, print_table, save_figure, write_results
from paper_repro._harness import DEFAULT_MODEL, Variant, attention_call, median_seconds, results_dir
from paper_repro.prefill import _with_ratio
from serving import LLM, SamplingParams

VARIANTS = (
    Variant("virtual", "ragged"),
    Variant("paged", "paged", 16),
    Variant("paged", "paged", 128),
    Variant("paged", "paged_gather", 16),
    Variant("paged", "paged_blockwise", 16),
)


def attention_rows(batches: list[int], context: int, repeats: int) -> list[dict[str, Any]]:
    rows = []
    for batch in tqdm(batches, desc="decode attention"):
        for variant in VARIANTS:
            seconds = median_seconds(attention_call(variant, DEFAULT_MODEL, batch, context, 1, torch.float32), repeats)
            rows.append(
                {
                    "table": "attention",
                    "batch": batch,
                    "context": context,
                    "variant": variant.label,
                    "ms": 1000 * seconds,
                    "tokens_per_s": batch / (seconds * DEFAULT_MODEL.num_layers),
                }
            )
    return _with_ratio(rows, ("batch",), "ms")


def model_rows(batches: list[int], context: int, steps: int) -> list[dict[str, Any]]:
    rows = []
    for kv_cache in tqdm(("virtual", "paged"), desc="decode model"):
        llm = LLM(kv_cache=kv_cache, max_slots=max(batches), max_context=context + steps + 8, kv_budget=2 << 30)
        engine, vocab = llm.engine, llm.tokenizer.vocab_size
        for batch in batches:
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
            rows.append(
                {
                    "table": "model",
                    "batch": batch,
                    "context": context,
                    "variant": kv_cache,
                    "ms": 1000 * seconds,
                    "tokens_per_s": batch / seconds,
                }
            )
        llm.close()
    return _with_ratio(rows, ("batch",), "ms")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=results_dir(), help="results folder")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--model-context", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args(argv)
    batches, model_batches = [1, 2, 4, 8, 16, 32], [1, 8, 32]
    if args.quick:
        batches, model_batches, args.context, args.model_context, args.repeats, args.steps = [1, 2], [2], 64, 32, 1, 1
    rows = attention_rows(batches, args.context, args.repeats) + model_rows(
        model_batches, args.model_context, args.steps
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
    print_table([r for r in rows if r["table"] == "attention"], columns, "decode attention, one layer")
    print_table([r for r in rows if r["table"] == "model"], columns, "decode steps, the default model")
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Any) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for axis, table, metric, label in (
        (left, "attention", "ms", "attention latency per layer (ms)"),
        (right, "model", "tokens_per_s", "decode tokens/s"),
    ):
        chosen = [r for r in rows if r["table"] == table]
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
