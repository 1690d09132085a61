"""What an int8 KV cache buys and costs against the model's own KV precision (float32, or
bfloat16 with `--dtype bfloat16`), on the default model, in one run.

- capacity: bytes per token (K and V of every layer) and the most 1,000-token requests that fit
  a 256 MiB KV budget, found by stepping requests to 1,000 tokens on a KVCache of the engine's
  own geometry (its page size and layout) until `OutOfPagesError`.
- decode: the engine's decode step (wall ms, median of `--steps`) with 16 and 64 requests at
  1K- and 4K-token contexts (`--shapes`), random-token prompts prefilled first, the KV
  precisions side by side for each shape, `--rounds` times (on 2 MiB pages: see DECODE_PAGE).
- greedy: 48 chat prompts (8 requests about 6 topics) answered greedily, 64 tokens each, with
  each KV precision: how many answers equal the reference's and their mean common prefix.

Perplexity over the same text as every preset: `python -m benchmarks.quality --configs fp32,int8kv`.

    python -m benchmarks.kv_precision [--kv-dtypes float32,int8] [--steps 8]
    python -m benchmarks.kv_precision --dtype bfloat16 --kv-dtypes bfloat16,int8 --name kv_precision_bf16 \\
        --shapes 16x1024,64x1024,16x4096 --rounds 3
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import random_token_prompts
from serving import LLM, SamplingParams
from vattn import KVCache, OutOfPagesError
from vattn.sizes import MiB

BUDGET, REQUEST_TOKENS = 256 * MiB, 1000
SHAPES = "16x1024,64x1024,16x4096,64x4096"
"""(requests x context tokens) of the decode steps."""
ASKS = [
    "Explain {} in two sentences.",
    "Write a short poem about {}.",
    "Give me three facts about {}.",
    "What is the history of {}?",
    "How would you teach a child about {}?",
    "List the pros and cons of {}.",
    "Describe {} to someone who has never heard of it.",
    "Write a one-paragraph story involving {}.",
]
TOPICS = ["the sea", "photosynthesis", "prime numbers", "the French Revolution", "a lighthouse", "bicycles"]
CHAT_PROMPTS = [ask.format(topic) for topic in TOPICS for ask in ASKS]


def engine(dtype: str, kv_dtype: str, **options: Any) -> LLM:
    """The default model in `dtype` over a `kv_dtype` KV cache (its own: "auto")."""
    return LLM(dtype=dtype, kv_cache_dtype="auto" if kv_dtype == dtype else kv_dtype, **options)


def capacity(dtype: str, kv_dtype: str) -> dict[str, Any]:
    """Bytes per token, and how many REQUEST_TOKENS-token requests a BUDGET cache holds at once."""
    llm = engine(dtype, kv_dtype, max_slots=2)
    config = llm.engine.executor.kv.cache.config
    llm.close()
    config = replace(
        config, max_slots=256, max_context=REQUEST_TOKENS, memory_budget=BUDGET, eager_pages=0, background=False
    )
    held, lengths = 0, {}
    with KVCache(config) as cache:
        try:
            while True:
                lengths[cache.alloc_reqid()] = REQUEST_TOKENS
                cache.step(lengths)
                held += 1
        except OutOfPagesError:
            pass
    per_token = config.bytes_per_token * config.num_buffers
    return {"kv": kv_dtype, "bytes_per_token": per_token, "requests_in_256_mib": held}


PREFILL_CHUNK = 1024
"""Prompt tokens an iteration while the decode shapes fill."""
DECODE_PAGE = 2 * MiB
"""The decode steps' page size: 64 requests of 4K tokens hold 12 GB of float32 KV, more 64 KiB
mappings than Linux's default vm.max_map_count allows (the kernels read the same contiguous
rows whatever the page size)."""


def kv_bytes(dtype: str, kv_dtype: str, requests: int, tokens: int) -> int:
    """A KV budget that holds `requests` requests of `tokens` tokens at once (whole pages each)."""
    llm = engine(dtype, kv_dtype, max_slots=2, page_size=DECODE_PAGE)
    config = llm.engine.executor.kv.cache.config
    llm.close()
    return requests * config.pages_for(tokens) * config.page_group_bytes + config.page_group_bytes


def decode_step(dtype: str, kv_dtype: str, batch: int, context: int, steps: int) -> float:
    """Median decode step, ms, at `batch` requests of `context` tokens: their prompts prefilled,
    then `steps` timed steps."""
    # The first prompts decode while the later ones are prefilled (1,024 tokens an iteration):
    # every request must still be running when the timed steps start.
    prefill_steps = -(-batch * context // PREFILL_CHUNK) + batch
    max_tokens = prefill_steps + steps + 4
    longest = context + max_tokens + 8
    llm = engine(
        dtype,
        kv_dtype,
        max_slots=batch,
        max_context=longest,
        max_batched_tokens=PREFILL_CHUNK,
        kv_budget=kv_bytes(dtype, kv_dtype, batch, longest),
        page_size=DECODE_PAGE,
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    prompts = random_token_prompts(batch, context, context, llm.tokenizer.vocab_size, seed=batch + context)
    ids = llm.engine.add_requests(prompts, [params] * batch)
    with tqdm(total=batch, desc=f"{kv_dtype} prefill {batch} x {context}", unit="req", leave=False) as bar:
        decoding: set[str] = set()
        while len(decoding) < batch:
            new = {d.request_id for d in llm.engine.step() if d.token_ids} - decoding
            decoding |= new
            bar.update(len(new))
    if (running := llm.engine.stats().running) != batch:
        raise SystemExit(f"{running} of {batch} requests running at {batch} x {context}: the step would not be theirs")
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        llm.engine.step()
        times.append(time.perf_counter() - start)
    for request_id in ids:
        llm.engine.abort(request_id)
    llm.close()
    return 1000 * statistics.median(times)


def decode_steps(dtype: str, kv_dtypes: list[str], shapes: list[tuple[int, int]], steps: int, rounds: int) -> list:
    """Each shape's decode step with each KV precision in turn, `rounds` times: the median step
    and the step's ratio to the first precision's, round by round (median and range). This
    machine's speed drifts over minutes, so each shape's precisions run side by side."""
    samples: dict[tuple[str, int, int], list[float]] = {}
    for _ in tqdm(range(rounds), desc="rounds"):
        for batch, context in shapes:
            for kv_dtype in kv_dtypes:
                samples.setdefault((kv_dtype, batch, context), []).append(
                    decode_step(dtype, kv_dtype, batch, context, steps)
                )
    rows = []
    for (kv_dtype, batch, context), times in samples.items():
        ratios = [t / r for t, r in zip(times, samples[(kv_dtypes[0], batch, context)], strict=True)]
        rows.append(
            {
                "table": "decode",
                "kv": kv_dtype,
                "requests": batch,
                "context": context,
                "step_ms": statistics.median(times),
            }
            | {
                "rounds_ms": times,
                f"vs_{dtype}": statistics.median(ratios),
                "vs_min": min(ratios),
                "vs_max": max(ratios),
            }
        )
    return rows


def greedy_answers(dtype: str, kv_dtype: str, tokens: int) -> list[list[int]]:
    llm = engine(dtype, kv_dtype)
    params = SamplingParams(max_tokens=tokens, temperature=0)
    prompts = [llm.chat_prompt([{"role": "user", "content": prompt}]) for prompt in CHAT_PROMPTS]
    answers = [output.token_ids for output in llm.generate(prompts, params, use_tqdm=False)]
    llm.close()
    return answers


def agreement(answers: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    prefixes = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), min(len(x), len(y)))
        for x, y in zip(answers, reference, strict=True)
    ]
    return {
        "answers_equal": sum(x == y for x, y in zip(answers, reference, strict=True)),
        "mean_common_prefix": statistics.mean(prefixes),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="the model's dtype")
    parser.add_argument("--kv-dtypes", default="float32,int8", help="the model's dtype first: the reference")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per shape")
    parser.add_argument("--shapes", default=SHAPES, help="requests x context of the decode steps")
    parser.add_argument("--rounds", type=int, default=1, help="decode steps' rounds, the precisions side by side")
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="kv_precision", help="results file stem")
    args = parser.parse_args(argv)
    kv_dtypes = args.kv_dtypes.split(",")
    if kv_dtypes[0] != args.dtype:
        parser.error(f"the first KV dtype is the reference, the model's own: {args.dtype}")
    rows: list[dict[str, Any]] = []
    reference: list[list[int]] = []
    for kv_dtype in tqdm(kv_dtypes, desc="KV precisions"):
        answers = greedy_answers(args.dtype, kv_dtype, args.answer_tokens)
        reference = reference or answers
        rows.append({"table": "capacity", **capacity(args.dtype, kv_dtype), **agreement(answers, reference)})
    shapes = [(int(b), int(c)) for b, c in (shape.split("x") for shape in args.shapes.split(","))]
    rows += decode_steps(args.dtype, kv_dtypes, shapes, args.steps, args.rounds)
    csv_path, json_path, png_path = write_results(
        args.out,
        args.name,
        rows,
        {
            "command": command_line(),
            "machine": machine_facts(),
            "args": vars(args),
            "prompts": CHAT_PROMPTS,
            "rows": rows,
        },
    )
    print_table(
        [r for r in rows if r["table"] == "capacity"],
        [
            ("KV", "kv", 8, ""),
            ("bytes/token", "bytes_per_token", 12, ""),
            ("1K-token requests in 256 MiB", "requests_in_256_mib", 29, ""),
            (f"answers equal (of {len(CHAT_PROMPTS)})", "answers_equal", 21, ""),
            ("common prefix", "mean_common_prefix", 14, ".1f"),
        ],
        "capacity and greedy answers",
    )
    print_table(
        [r for r in rows if r["table"] == "decode"],
        [
            ("KV", "kv", 8, ""),
            ("requests", "requests", 9, ""),
            ("context", "context", 8, ""),
            ("step ms", "step_ms", 9, ".1f"),
            (f"vs {args.dtype}", f"vs_{args.dtype}", 11, ".2f"),
            ("min", "vs_min", 6, ".2f"),
            ("max", "vs_max", 6, ".2f"),
        ],
        f"decode step, a {args.dtype} model",
    )
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    decode = [r for r in rows if r["table"] == "decode"]
    kinds = list(dict.fromkeys(r["kv"] for r in decode))
    shapes = list(dict.fromkeys((r["requests"], r["context"]) for r in decode))
    labels = [f"{b} x {c // 1024}K" for b, c in shapes]
    fig, axis = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / len(kinds)
    for i, kind in enumerate(kinds):
        values = [
            next(r["step_ms"] for r in decode if r["kv"] == kind and (r["requests"], r["context"]) == s) for s in shapes
        ]
        axis.bar([x + i * width for x in range(len(shapes))], values, width, label=f"{kind} KV")
    axis.set_xticks([x + width * (len(kinds) - 1) / 2 for x in range(len(shapes))], labels)
    axis.set_ylabel("decode step, ms")
    axis.set_title("the default model's decode step by KV precision (requests x context)", fontsize=9)
    axis.legend(fontsize=8)
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
