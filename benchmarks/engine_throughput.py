"""Offline generation throughput: the vattn engine vs HF `generate` (static batches) vs HF `generate_batch`.

The same seeded prompts (random token ids, 32-512 tokens), the same model and dtype, and
exactly `--output-tokens` greedy tokens per request for every system, all requests
arriving at once, in one run. Reported per system: output tokens/s, and per request
time to first token (TTFT) and time per output token (TPOT, after the first), p50/p99.

    python -m benchmarks.engine_throughput [--requests 64] [--output-tokens 128] [--hf-batch 32]
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
from tqdm import tqdm
from transformers import AutoModelForCausalLM, GenerationConfig, LogitsProcessor, LogitsProcessorList

from measure.results import RESULTS_DIR, command_line, machine_facts, percentiles, save_figure, write_results
from measure.workloads import random_token_prompts
from serving import LLM, SamplingParams
from serving.default_model import ensure_default_model
from vattn.sizes import MiB

Timings = dict[str, list[float]]


def run_vattn(prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, Timings]:
    llm = LLM(
        dtype=args.dtype,
        max_slots=len(prompts),
        max_context=max(map(len, prompts)) + args.output_tokens,
        max_batched_tokens=args.batched_tokens,
        kv_budget=args.kv_budget_mib * MiB,
        prefix_caching=False,  # the warm-up's prompts come again: no cache hits
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    elapsed = time.perf_counter() - started
    preemptions = llm.engine.stats().preemptions
    llm.close()
    assert all(len(o.token_ids) == args.output_tokens for o in outputs)
    ttft = [o.ttft for o in outputs if o.ttft is not None]
    tpot = [(o.latency - o.ttft) / (len(o.token_ids) - 1) for o in outputs if o.latency and o.ttft]
    return elapsed, {"ttft": ttft, "tpot": tpot, "preemptions": [preemptions]}


class StepClock(LogitsProcessor):
    """Records when each generation step's logits arrive (the first one ends the prefill)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, Timings]:
    """HF generate on left-padded batches of --hf-batch requests, one batch after another."""
    ttft, tpot = [], []
    config = GenerationConfig(
        max_new_tokens=args.output_tokens, min_new_tokens=args.output_tokens, do_sample=False, pad_token_id=0
    )
    started = time.perf_counter()
    for first in tqdm(range(0, len(prompts), args.hf_batch), desc="HF static batches"):
        batch = prompts[first : first + args.hf_batch]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        clock = StepClock()
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, generation_config=config, logits_processor=LogitsProcessorList([clock])
            )
        done = time.perf_counter()
        assert out.shape[1] - width == args.output_tokens
        ttft += [clock.times[0] - started] * len(batch)
        tpot += [(done - clock.times[0]) / (args.output_tokens - 1)] * len(batch)
    return time.perf_counter() - started, {"ttft": ttft, "tpot": tpot}


def run_hf_generate_batch(model: Any, prompts: list[list[int]], args: argparse.Namespace) -> tuple[float, Timings]:
    """HF's own continuous batching (`generate_batch`)."""
    config = GenerationConfig(
        max_new_tokens=args.output_tokens, min_new_tokens=args.output_tokens, do_sample=False, eos_token_id=-1
    )
    started = time.perf_counter()
    # no inference_mode here: generate_batch runs its loop in a thread of its own
    results = model.generate_batch(prompts, generation_config=config, record_timestamps=True, progress_bar=True)
    elapsed = time.perf_counter() - started
    outputs = list(results.values())
    assert all(len(o.generated_tokens) == args.output_tokens for o in outputs), "generate_batch stopped early"
    ttft = [o.timestamps[0] - started for o in outputs if o.timestamps]
    tpot = [(o.timestamps[-1] - o.timestamps[0]) / (len(o.timestamps) - 1) for o in outputs if o.timestamps]
    return elapsed, {"ttft": ttft, "tpot": tpot}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    names = [row["system"] for row in rows]
    for ax, key, label in (
        (axes[0], "output_tokens_per_s", "output tokens/s"),
        (axes[1], "ttft_p50_s", "TTFT p50 (s)"),
        (axes[2], "tpot_p50_ms", "time per output token p50 (ms)"),
    ):
        ax.bar(names, [row[key] for row in rows], color=["tab:green", "tab:blue", "tab:orange"][: len(rows)])
        ax.set_ylabel(label)
        ax.tick_params(axis="x", rotation=15)
    save_figure(fig, path, title)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--shortest", type=int, default=32, help="shortest prompt, tokens")
    parser.add_argument("--longest", type=int, default=512, help="longest prompt, tokens")
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--hf-batch", type=int, default=32, help="HF static batch size")
    parser.add_argument("--batched-tokens", type=int, default=512, help="vattn tokens per iteration")
    parser.add_argument("--kv-budget-mib", type=int, default=2048, help="vattn KV cache budget")
    parser.add_argument("--systems", default="vattn,hf_static,hf_generate_batch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="engine_throughput")
    args = parser.parse_args(argv)

    model_dir = ensure_default_model()
    dtype = getattr(torch, args.dtype)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    prompts = random_token_prompts(args.requests, args.shortest, args.longest, model.config.vocab_size, args.seed)
    runners: dict[str, Callable[[], tuple[float, Timings]]] = {
        "vattn": lambda: run_vattn(prompts, args),
        "hf_static": lambda: run_hf_static(model, prompts, args),
        "hf_generate_batch": lambda: run_hf_generate_batch(model, prompts, args),
    }
    rows = []
    for system in args.systems.split(","):
        elapsed, timings = runners[system]()
        ttft, tpot = percentiles(timings["ttft"]), percentiles(timings["tpot"])
        rows.append(
            {
                "system": system,
                "requests": len(prompts),
                "output_tokens": len(prompts) * args.output_tokens,
                "seconds": round(elapsed, 3),
                "output_tokens_per_s": round(len(prompts) * args.output_tokens / elapsed, 2),
                "ttft_p50_s": round(ttft["p50"], 3),
                "ttft_p99_s": round(ttft["p99"], 3),
                "tpot_p50_ms": round(tpot["p50"] * 1e3, 2),
                "tpot_p99_ms": round(tpot["p99"] * 1e3, 2),
                "preemptions": timings.get("preemptions", [0])[0],
            }
        )
        print(rows[-1], flush=True)
        save(rows, prompts, args)


def save(rows: list[dict[str, Any]], prompts: list[list[int]], args: argparse.Namespace) -> None:
    """Writes what has been measured so far (after every system, so a cut-short run keeps it)."""
    by_name = {row["system"]: row["output_tokens_per_s"] for row in rows}
    ratios = {
        f"vattn_over_{other}": round(by_name["vattn"] / by_name[other], 2)
        for other in ("hf_static", "hf_generate_batch")
        if "vattn" in by_name and other in by_name
    }
    payload = {
        "command": command_line(),
        "machine": machine_facts(),
        "settings": {k: str(v) for k, v in vars(args).items()},
        "prompt_tokens": sum(map(len, prompts)),
        "rows": rows,
        "ratios": ratios,
    }
    _, _, png = write_results(args.out, args.name, rows, payload)
    plot(rows, png, f"{args.requests} requests, {args.output_tokens} tokens, {args.dtype}")
    print("ratios:", ratios, flush=True)


if __name__ == "__main__":
    main()
