"""The engine's CPU speed against HF in one run: a long prompt, decode steps, int8 quality.

- prefill: a `--prompt-tokens` prompt (default 2000) plus `--new-tokens` greedy tokens
  through `LLM.generate` against HF `generate` on the same ids, alternating, best of
  `--rounds`; the target is vattn >= 1.2x faster.
- decode: wall time of one decode step with 1, 16 and 64 requests at a `--context`-token
  context, and the share of it spent outside torch operators (Python: scheduling,
  sampling, detokenizing, the model loop), read from torch's profiler; target < 10%.
- quality: each configuration's greedy tokens against fp32's on fixed chat prompts
  (prompts identical in full, and the mean share of tokens before the first difference).

Every engine configuration (`--configs fp32,int8`) runs in this one process.

    python -m benchmarks.model_speed [--configs fp32,int8] [--rounds 2]
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
from transformers import AutoModelForCausalLM

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import CONFIGS, engine_options, long_prompt, random_token_prompts
from serving import LLM, SamplingParams
from serving.default_model import ensure_default_model
from vattn.sizes import KiB

QUALITY_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a KV cache is in one paragraph.",
    "List three prime numbers greater than 100.",
    "How do I reverse a list in Python?",
    "Summarize the plot of Romeo and Juliet.",
    "What causes the seasons on Earth?",
    "Give me a recipe for pancakes.",
]


def time_hf(model: Any, ids: list[int], new_tokens: int) -> tuple[float, list[int]]:
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    return time.perf_counter() - start, out[0, len(ids) :].tolist()


def time_vattn(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    start = time.perf_counter()
    result = llm.generate([ids], params, use_tqdm=False)[0]
    return time.perf_counter() - start, result.ttft or 0.0, result.token_ids


def decode_step(llm: LLM, batch: int, context: int, steps: int, vocab: int) -> dict[str, float]:
    """Seconds per decode step with `batch` requests at about `context` tokens, and the share of
    the step outside torch operators (profiled over `steps` steps)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=3 * steps + 8, temperature=0, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in random_token_prompts(batch, context, context, vocab, seed=1)]
    while engine.stats().waiting or any(not engine._requests[i].output_ids for i in ids):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = (time.perf_counter() - start) / steps
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        profiled = time.perf_counter() - start
    in_ops = sum(e.cpu_time_total for e in profile.events() if e.cpu_parent is None) / 1e6
    for request_id in ids:
        engine.abort(request_id)
    return {"step_ms": 1000 * wall, "outside_ops_share": max(0.0, 1 - in_ops / profiled)}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="fp32,int8", help=f"comma list of {', '.join(CONFIGS)}")
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--quality-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.configs = args.configs.split(",")
    args.batches = [int(b) for b in args.batches.split(",")]
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    configs, batches = args.configs, args.batches
    model_dir = ensure_default_model()
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    engines = {
        name: LLM(
            max_slots=max(batches),
            max_context=max(args.prompt_tokens + args.new_tokens, 2 * args.context),
            page_size=256 * KiB,  # several engines share the process's map-count budget
            prefix_caching=False,  # repeated prompts measure compute, not the cache
            **engine_options(name),
        )
        for name in configs
    }
    ids = long_prompt(next(iter(engines.values())), args.prompt_tokens)
    rows = prefill_rows(hf, engines, ids, args.new_tokens, args.rounds)
    for name, llm in tqdm(engines.items(), desc="decode steps"):
        for batch in batches:
            rows.append(
                {"table": "decode", "config": name, "batch": batch}
                | decode_step(llm, batch, args.context, args.steps, hf.config.vocab_size)
            )
    rows += quality_rows(engines, args.quality_tokens)
    for llm in engines.values():
        llm.close()

    csv_path, json_path, png_path = write_results(
        args.out,
        "model_speed",
        rows,
        {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows},
    )
    print_tables(rows, args)
    plot(rows, configs, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


def prefill_rows(
    hf: torch.nn.Module, engines: dict[str, LLM], ids: list[int], new_tokens: int, rounds: int
) -> list[dict[str, Any]]:
    """A long prompt and `new_tokens` through HF generate and each engine, best of alternating rounds."""
    rows: list[dict[str, Any]] = []
    hf_runs: list[tuple[float, list[int]]] = []
    best: dict[str, tuple[float, float, list[int]]] = {}
    for _ in tqdm(range(rounds), desc="prefill rounds"):  # alternating, best of each
        hf_runs.append(time_hf(hf, ids, new_tokens))
        for name, llm in engines.items():
            run = time_vattn(llm, ids, new_tokens)
            best[name] = min(best.get(name, run), run)
    hf_best = min(hf_runs)
    for name, (seconds, ttft, tokens) in best.items():
        rows.append(
            {
                "table": "prefill",
                "config": name,
                "seconds": seconds,
                "ttft_s": ttft,
                "hf_generate_s": hf_best[0],
                "speedup_vs_hf": hf_best[0] / seconds,
                "same_tokens_as_hf": tokens == hf_best[1],
            }
        )
    return rows


def quality_rows(engines: dict[str, LLM], tokens: int) -> list[dict[str, Any]]:
    """Each engine's greedy chat answers against fp32's: identical ones and the agreeing share."""
    rows: list[dict[str, Any]] = []
    params = SamplingParams(max_tokens=tokens, temperature=0)
    answers = {
        name: [
            out.token_ids
            for out in llm.generate(
                [llm.chat_prompt([{"role": "user", "content": p}]) for p in QUALITY_PROMPTS], params, use_tqdm=False
            )
        ]
        for name, llm in tqdm(engines.items(), desc="quality")
    }
    reference = answers.get("fp32")
    for name, outputs in answers.items():
        if reference is None:
            break
        agreement = [_prefix_share(a, b) for a, b in zip(outputs, reference, strict=True)]
        rows.append(
            {
                "table": "quality",
                "config": name,
                "identical_answers": sum(a == b for a, b in zip(outputs, reference, strict=True)),
                "prompts": len(QUALITY_PROMPTS),
                "mean_agreeing_prefix": sum(agreement) / len(agreement),
            }
        )
    return rows


def print_tables(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print_table(
        [r for r in rows if r["table"] == "prefill"],
        [
            ("config", "config", 6, ""),
            ("vattn s", "seconds", 8, ".2f"),
            ("TTFT s", "ttft_s", 7, ".2f"),
            ("HF s", "hf_generate_s", 7, ".2f"),
            ("speedup", "speedup_vs_hf", 8, ".2f"),
            ("same", "same_tokens_as_hf", 6, ""),
        ],
        f"{args.prompt_tokens}-token prompt + {args.new_tokens} tokens vs HF generate",
    )
    print_table(
        [r for r in rows if r["table"] == "decode"],
        [
            ("config", "config", 6, ""),
            ("batch", "batch", 6, ""),
            ("step ms", "step_ms", 8, ".1f"),
            ("outside ops", "outside_ops_share", 12, ".1%"),
        ],
        f"decode step at {args.context}-token contexts",
    )
    print_table(
        [r for r in rows if r["table"] == "quality"],
        [
            ("config", "config", 6, ""),
            ("identical", "identical_answers", 10, ""),
            ("of", "prompts", 4, ""),
            ("agreeing prefix", "mean_agreeing_prefix", 16, ".1%"),
        ],
        "greedy answers against fp32",
    )


def _prefix_share(tokens: list[int], reference: list[int]) -> float:
    same = next(
        (i for i, (a, b) in enumerate(zip(tokens, reference, strict=False)) if a != b), min(len(tokens), len(reference))
    )
    return same / max(1, len(reference))


def plot(rows: list[dict[str, Any]], configs: list[str], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    prefill = [r for r in rows if r["table"] == "prefill"]
    names = ["HF generate", *(r["config"] for r in prefill)]
    left.bar(
        names, [prefill[0]["hf_generate_s"], *(r["seconds"] for r in prefill)], color=["grey", *["C0"] * len(prefill)]
    )
    left.set_ylabel("seconds (prompt + new tokens)")
    left.set_title("long prompt, batch 1")
    for name in configs:
        decode = [r for r in rows if r["table"] == "decode" and r["config"] == name]
        right.plot(
            [r["batch"] for r in decode], [r["batch"] / r["step_ms"] * 1000 for r in decode], marker="o", label=name
        )
    right.set_xlabel("requests decoding")
    right.set_ylabel("output tokens/s")
    right.set_title("decode steps")
    right.legend()
    save_figure(fig, path, command_line())


if __name__ == "__main__":
    main()
