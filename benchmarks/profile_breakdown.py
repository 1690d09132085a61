"""Where the engine's time goes, by torch operator, for the two paths short of issue 14's targets.

- decode: `--steps` decode steps of `--config` (default int8) with `--batch` requests at
  about `--context` tokens (serving at 16 requests in flight is where vattn is 1.35x vLLM,
  short of 1.5x).
- prefill: one `--prompt-tokens` prompt through the fp32 engine (time to its first token)
  against one HF forward of the same ids, in the same process.

Each table lists the operators with the most self CPU time and their share of the profiled
total.

    python -m benchmarks.profile_breakdown [--batch 16] [--config int8] [--top 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from transformers import AutoModelForCausalLM

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import CONFIGS, engine_options, long_prompt, random_token_prompts
from serving import LLM, SamplingParams
from serving.default_model import ensure_default_model


def top_operators(call: Callable[[], object], top: int) -> tuple[float, list[dict[str, Any]]]:
    """Wall seconds of `call` under torch's profiler and its `top` operators by self CPU time."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        call()
        seconds = time.perf_counter() - start
    events = sorted(profile.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    return seconds, [
        {"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1000, "share": e.self_cpu_time_total / total}
        for e in events[:top]
    ]


def decode_rows(config: str, batch: int, context: int, steps: int, top: int) -> list[dict[str, Any]]:
    llm = LLM(max_slots=batch, max_context=context + 3 * steps + 8, prefix_caching=False, **engine_options(config))
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * steps + 4, temperature=0, ignore_eos=True)
    for prompt in random_token_prompts(batch, context, context, llm.tokenizer.vocab_size, seed=1):
        engine.add_request(prompt, params)
    decoding: set[str] = set()
    while len(decoding) < batch:  # every prompt in, every request decoding
        decoding |= {delta.request_id for delta in engine.step() if delta.token_ids}
    for _ in range(steps):  # warm
        engine.step()

    def run() -> None:
        for _ in range(steps):
            engine.step()

    seconds, ops = top_operators(run, top)
    llm.close()
    step_ms = 1000 * seconds / steps
    return [{"table": "decode", "config": config, "batch": batch, "step_ms": step_ms} | op for op in ops]


def prefill_rows(prompt_tokens: int, top: int) -> list[dict[str, Any]]:
    llm = LLM(dtype="float32", max_slots=2, max_context=prompt_tokens + 8, prefix_caching=False)
    ids = long_prompt(llm, prompt_tokens)
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([ids], params, use_tqdm=False)  # warm
    vattn_seconds, vattn_ops = top_operators(lambda: llm.generate([ids], params, use_tqdm=False), top)
    llm.close()
    hf = AutoModelForCausalLM.from_pretrained(ensure_default_model(), dtype=torch.float32).eval()
    tokens = torch.tensor([ids])
    with torch.inference_mode():
        hf(tokens)  # warm
        hf_seconds, hf_ops = top_operators(lambda: hf(tokens), top)
    return [{"table": "prefill", "config": "vattn fp32", "seconds": vattn_seconds} | op for op in vattn_ops] + [
        {"table": "prefill", "config": "HF forward", "seconds": hf_seconds} | op for op in hf_ops
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="int8", choices=list(CONFIGS))
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    rows = decode_rows(args.config, args.batch, args.context, args.steps, args.top)
    rows += prefill_rows(args.prompt_tokens, args.top)
    csv_path, json_path, png_path = write_results(
        args.out,
        "profile_breakdown",
        rows,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows},
    )
    columns = [
        ("op", "op", 52, ""),
        ("calls", "calls", 6, ""),
        ("self ms", "self_ms", 9, ".1f"),
        ("share", "share", 7, ".1%"),
    ]
    decode = [r for r in rows if r["table"] == "decode"]
    print_table(decode, columns, f"decode step, {args.config}, {args.batch} requests: {decode[0]['step_ms']:.1f} ms")
    for config in ("vattn fp32", "HF forward"):
        chosen = [r for r in rows if r["config"] == config]
        print_table(chosen, columns, f"{args.prompt_tokens}-token prefill, {config}: {chosen[0]['seconds']:.2f} s")
    plot(rows, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, axes = plt.subplots(1, len(configs), figsize=(5 * len(configs), 4))
    for axis, config in zip(axes, configs, strict=True):
        chosen = [r for r in rows if r["config"] == config]
        axis.barh([r["op"].removeprefix("aten::")[:32] for r in chosen][::-1], [r["share"] for r in chosen][::-1])
        axis.set_xlabel("share of self CPU time")
        axis.set_title(f"{chosen[0]['table']}: {config}", fontsize=9)
        axis.tick_params(axis="y", labelsize=7)
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
