"""Where one level of `benchmarks.serving_compare` spends the engine's time, in-process.

The level's prompts of its first round (the same seeded 32-512-word prompts, the same slice) run through
`LLMEngine` with `--concurrency` requests in flight and a new one added whenever one
finishes, 64 greedy tokens each, as the HTTP client drives the server. Each engine
iteration is timed and classed as decode-only or as one that also computes prompt tokens.
The linear layers' arithmetic rate in those prompt iterations is compared with torch's own
float32 linear layer's rate on large products on this machine, measured in the same run: at fp32 that rate is
the roof that no scheduling can lift.

    python -m benchmarks.level_profile [--configs fp32,q8] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import contextlib
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm
from transformers import AutoConfig

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import CONFIGS, engine_options, random_word_prompts
from serving import LLM, SamplingParams
from serving.default_model import ensure_default_model
from serving.model.linear import DenseLinear

LEVELS = (1, 16, 48)
"""serving_compare's default levels: its prompts are drawn for all of them, in this order."""


def linear_flops_per_token() -> tuple[int, int]:
    """Multiply-adds x 2 of the decoder layers' linear layers per token, and of the LM head per sampled row."""
    config = AutoConfig.from_pretrained(ensure_default_model())
    hidden, inter, layers = config.hidden_size, config.intermediate_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    per_layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return 2 * layers * per_layer, 2 * hidden * config.vocab_size


def matmul_gflops(rows: int, inner: int, cols: int, repeats: int = 20) -> float:
    """The engine's float32 linear layer (oneDNN with a packed weight) on [rows x inner] with a
    [cols x inner] weight, GFLOP/s, best of `repeats`."""
    linear, x = DenseLinear(torch.randn(cols, inner), None), torch.randn(rows, inner)
    best = float("inf")
    for _ in range(repeats + 2):
        start = time.perf_counter()
        linear(x)
        best = min(best, time.perf_counter() - start)
    return 2 * rows * inner * cols / best / 1e9


def replay(
    config: str, warmup: str, prompts: list[str], concurrency: int, output_tokens: int, profiler: Any = None
) -> list[dict[str, Any]]:
    """Each iteration of the level: tokens computed, requests running, seconds (under
    `profiler`, a torch profiler, when one is given)."""
    llm = LLM(**engine_options(config))
    engine = llm.engine
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    engine.add_request(warmup, params)
    while engine.has_unfinished():
        engine.step()
    pending, in_flight, steps = list(prompts), 0, []
    label = f"{config} c={concurrency}" + (" profiled" if profiler else "")
    with profiler or contextlib.nullcontext(), tqdm(total=len(prompts), desc=label, unit="req") as bar:
        while pending or engine.has_unfinished():
            while pending and in_flight < concurrency:
                engine.add_request(pending.pop(0), params)
                in_flight += 1
            running = engine.stats().running
            start = time.perf_counter()
            deltas = engine.step()
            seconds = time.perf_counter() - start
            done = sum(delta.finished for delta in deltas)
            in_flight -= done
            bar.update(done)
            steps.append({"tokens": engine.stats().last_iteration_tokens, "running": running, "seconds": seconds})
    llm.close()
    return steps


def top_operators(
    config: str, warmup: str, prompts: list[str], concurrency: int, output_tokens: int, top: int
) -> list[dict[str, Any]]:
    """The level again under torch's profiler: its `top` operators by self CPU time and their shares."""
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    replay(config, warmup, prompts, concurrency, output_tokens, profiler)
    events = sorted(profiler.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return [
        {"config": config, "op": e.key, "self_s": e.self_cpu_time_total / 1e6, "share": e.self_cpu_time_total / total}
        for e in events[:top]
    ]


def summarize(config: str, steps: list[dict[str, Any]], flops: tuple[int, int], generated: int) -> dict[str, Any]:
    """The level's iterations split into those that compute prompt tokens and decode-only ones;
    the linear layers' GFLOP/s in the former (the LM head counted for every running request)."""
    per_token, per_row = flops
    prompt_steps = [s for s in steps if s["tokens"] > s["running"]]
    decode_steps = [s for s in steps if s["tokens"] <= s["running"]]
    total = sum(s["seconds"] for s in steps)
    prompt_seconds = sum(s["seconds"] for s in prompt_steps)
    prompt_flops = sum(s["tokens"] * per_token + s["running"] * per_row for s in prompt_steps)
    return {
        "config": config,
        "steps": len(steps),
        "engine_s": total,
        "out_tok_s": generated / total,
        "prompt_steps": len(prompt_steps),
        "prompt_share": prompt_seconds / total,
        "prompt_step_ms": 1000 * prompt_seconds / max(len(prompt_steps), 1),
        "prompt_step_tokens": sum(s["tokens"] for s in prompt_steps) / max(len(prompt_steps), 1),
        "decode_steps": len(decode_steps),
        "decode_step_ms": 1000 * (total - prompt_seconds) / max(len(decode_steps), 1),
        "prompt_linear_gflops": prompt_flops / prompt_seconds / 1e9 if prompt_seconds else None,
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="fp32,q8", help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--concurrency", type=int, default=16, choices=LEVELS, help="the level replayed")
    parser.add_argument("--requests", type=int, default=48, help="requests per level, as serving_compare's")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=4, help="operators listed from a second, profiled replay (0: none)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    if unknown := [c for c in configs if c not in CONFIGS]:
        parser.error(f"unknown configuration(s) {', '.join(unknown)}; choose from {', '.join(CONFIGS)}")
    prompts = random_word_prompts(args.requests * len(LEVELS) + 1, 32, 512, args.seed)  # serving_compare's draw
    level = LEVELS.index(args.concurrency)
    mine = prompts[level * args.requests : (level + 1) * args.requests]
    flops = linear_flops_per_token()
    roofs = {"prompt_shaped": matmul_gflops(272, 576, 3072), "large": matmul_gflops(2048, 2048, 2048)}
    rows, operators = [], []
    for config in configs:
        level = (config, prompts[-1], mine, args.concurrency, args.output_tokens)
        rows.append(summarize(config, replay(*level), flops, len(mine) * args.output_tokens))
        if args.top:
            operators += top_operators(*level, args.top)
    csv_path, json_path, png_path = write_results(
        args.out,
        "level_profile",
        rows,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "fp32_matmul_gflops": roofs}
        | {"rows": rows, "operators": operators},
    )
    columns = [
        ("config", "config", 8, ""),
        ("out tok/s", "out_tok_s", 10, ".1f"),
        ("steps", "steps", 6, ""),
        ("prompt steps", "prompt_steps", 13, ""),
        ("their share", "prompt_share", 12, ".0%"),
        ("ms each", "prompt_step_ms", 8, ".1f"),
        ("tokens each", "prompt_step_tokens", 12, ".0f"),
        ("GFLOP/s", "prompt_linear_gflops", 8, ".0f"),
        ("decode steps", "decode_steps", 13, ""),
        ("ms each", "decode_step_ms", 8, ".1f"),
    ]
    print_table(rows, columns, f"serving_compare's c={args.concurrency} level on the engine, {args.requests} requests")
    print(
        f"the engine's float32 linear layer: {roofs['prompt_shaped']:.0f} GFLOP/s at [272 x 576] x [3072 x 576]^T, "
        f"{roofs['large']:.0f} at 2048^3"
    )
    columns = [
        ("config", "config", 8, ""),
        ("op", "op", 32, ""),
        ("self s", "self_s", 8, ".2f"),
        ("share", "share", 7, ".0%"),
    ]
    print_table(operators, columns, "the top operators of a second, profiled replay")
    plot(rows, png_path, args.concurrency)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Path, concurrency: int) -> None:
    fig, axis = plt.subplots(figsize=(6, 3.5))
    names = [r["config"] for r in rows]
    prompt = [r["engine_s"] * r["prompt_share"] for r in rows]
    decode = [r["engine_s"] * (1 - r["prompt_share"]) for r in rows]
    axis.barh(names, prompt, label="iterations with prompt tokens")
    axis.barh(names, decode, left=prompt, label="decode-only iterations")
    axis.set_xlabel("engine seconds")
    axis.set_title(f"serving_compare's c={concurrency} level, in-process", fontsize=9)
    axis.legend(fontsize=7)
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
