"""Admission under a tight KV budget: many requests through a budget that holds a few.

`--requests` prompts of about `--prompt-tokens` tokens (seeded random ids), `--output-tokens`
greedy tokens each (EOS ignored), all submitted at once, on three engines:

- `tight`: a KV budget that holds `--fits` of these requests whole, slots for all of them,
  the default admission (each request's prompt plus `reserve_tokens` of output reserved);
- `tight, no reserve`: the same with `reserve_tokens=0` (room for the prompt only), to show
  what the reserve buys;
- `ample, N at a time`: `--fits` slots and a budget with room to spare: the same work with
  no memory pressure at all, the baseline.

Reported per engine: wall time (best of `--rounds` alternating rounds), its ratio to the
baseline, preemptions and output tokens/s. The prefix cache is off: every round computes.

    python -m benchmarks.memory_pressure [--requests 40] [--fits 4] [--rounds 2]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import random_token_prompts
from serving import LLM, SamplingParams
from vattn.sizes import MiB


def engines(prompts: list[list[int]], args: argparse.Namespace) -> dict[str, LLM]:
    context = max(map(len, prompts)) + args.output_tokens
    common = {"max_context": context, "max_batched_tokens": args.batched_tokens, "prefix_caching": False}
    baseline = LLM(max_slots=args.fits, **common)  # the default budget is far more than 4 slots use
    budget = args.fits * baseline.engine.kv.slot_bytes(context)  # whole pages per slot, as the cache maps them
    return {
        f"ample, {args.fits} at a time": baseline,
        "tight": LLM(max_slots=len(prompts), kv_budget=budget, **common),
        "tight, no reserve": LLM(max_slots=len(prompts), kv_budget=budget, reserve_tokens=0, **common),
    }


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    """Seconds for all prompts, and the preemptions they caused."""
    before = llm.engine.stats().preemptions
    started = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - started
    assert all(len(o.token_ids) == params.max_tokens for o in outputs)
    return elapsed, llm.engine.stats().preemptions - before


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=245)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--fits", type=int, default=4, help="requests the tight budget holds whole")
    parser.add_argument("--batched-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()

    spread = max(1, args.prompt_tokens * 6 // 100)  # lengths within +-6%
    prompts = random_token_prompts(args.requests, args.prompt_tokens - spread, args.prompt_tokens + spread, 40_000, 0)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    llms = engines(prompts, args)
    budget = llms["tight"].engine.config.kv_budget
    for llm in llms.values():
        llm.generate(prompts[:2], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in llms}
    with tqdm(total=args.rounds * len(llms), desc="runs") as bar:
        for _ in range(args.rounds):  # alternating rounds: a slow spell of the machine hits every engine
            for name, llm in llms.items():
                results[name].append(run(llm, prompts, params))
                bar.update()
    for llm in llms.values():
        llm.close()
    rows = tabulate(results, args.requests * args.output_tokens)
    payload = {
        "command": command_line(),
        "machine": machine_facts(),
        "workload": {**{k: v for k, v in vars(args).items() if k != "out"}, "tight_kv_budget_mib": budget / MiB},
        "rows": rows,
    }
    csv_path, json_path, png_path = write_results(args.out, "memory_pressure", rows, payload)
    print_table(
        rows,
        [
            ("engine", "engine", 20, ""),
            ("seconds", "seconds", 8, ".1f"),
            ("x ample", "ratio_to_ample", 8, ".2f"),
            ("tok/s", "output_tokens_per_s", 7, ".1f"),
        ],
        f"{args.requests} requests of ~{args.prompt_tokens}+{args.output_tokens} tokens, "
        f"KV budget {budget / MiB:.1f} MiB (holds {args.fits})",
    )
    for row in rows:
        print(f"{row['engine']}: preemptions per round {row['preemptions_per_round']}")
    plot(rows, png_path, f"{args.requests} requests through a KV budget that holds {args.fits}")
    print(f"wrote {csv_path}, {json_path}, {png_path}")


def tabulate(results: dict[str, list[tuple[float, int]]], output_tokens: int) -> list[dict[str, Any]]:
    """One row per engine: its best round, against the first engine's (ample memory)."""
    baseline = min(t for t, _ in next(iter(results.values())))
    rows: list[dict[str, Any]] = []
    for name, runs in results.items():
        best = min(t for t, _ in runs)
        rows.append(
            {
                "engine": name,
                "seconds": best,
                "seconds_all_rounds": [round(t, 2) for t, _ in runs],
                "ratio_to_ample": best / baseline,
                "preemptions_per_round": [p for _, p in runs],
                "output_tokens_per_s": output_tokens / best,
            }
        )
    return rows


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["engine"] for r in rows], [r["seconds"] for r in rows], color="tab:blue")
    for i, row in enumerate(rows):
        label = f" {row['ratio_to_ample']:.2f}x, {max(row['preemptions_per_round'])} preemptions"
        ax.text(row["seconds"], i, label, va="center")
    ax.set_xlabel("seconds for all requests (best round)")
    ax.set_xlim(0, max(r["seconds"] for r in rows) * 1.6)
    save_figure(fig, path, title)


if __name__ == "__main__":
    main()
