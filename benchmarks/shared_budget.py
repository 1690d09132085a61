"""Two models, one KV budget: shared elastically (one PageBudget) against split statically in half.

kvcached's experiment on the CPU. Two engines, each the default model (two copies stand in for two
models: what is measured is who holds the memory, and the same weights keep the compute the same
in both modes), are stepped in turn by one thread, as one server's engines share its cores. Load
alternates between them in bursts: every `--phase-s` seconds the next model gets `--burst`
requests at once and the other idles. The budget holds one whole burst (`--budget-requests`
requests of the longest prompt plus its output), so with half of it a burst queues for memory,
while shared, a busy model maps the pages the idle one gave back. Reported per mode: requests/s,
time to first token p50/p99 and the pages each model held over time (plotted). The modes
alternate round by round, each on freshly built engines.

    python -m benchmarks.shared_budget [--rounds 3] [--bursts 6] [--burst 8]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results
from measure.workloads import random_word_prompts
from serving import SamplingParams
from serving.config import EngineConfig
from serving.engine import LLMEngine
from vattn import PageBudget
from vattn.sizes import MiB

MODES = ("shared", "static")


def engines_for(mode: str, args: argparse.Namespace, budget: int) -> list[LLMEngine]:
    """Two engines: on one PageBudget of `budget` bytes, or each with half of it."""
    shared = PageBudget(budget) if mode == "shared" else None
    config = EngineConfig(
        dtype=args.dtype,
        max_slots=args.burst,
        max_context=args.max_context,
        kv_budget=budget if shared else budget // 2,
    )
    return [LLMEngine(config, shared) for _ in range(2)]


def run(mode: str, args: argparse.Namespace, budget: int, prompts: list[list[str]]) -> dict[str, Any]:
    """One run of the bursts; returns per-request times and the pages timeline."""
    engines = engines_for(mode, args, budget)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    submitted: dict[tuple[int, str], float] = {}
    first_token: dict[tuple[int, str], float] = {}
    finished: dict[tuple[int, str], float] = {}
    timeline: list[dict[str, float]] = []
    start = time.perf_counter()
    burst = 0
    try:
        while burst < args.bursts or any(engine.has_unfinished() for engine in engines):
            now = time.perf_counter() - start
            if burst < args.bursts and now >= burst * args.phase_s:
                model = burst % 2
                for prompt in prompts[burst]:
                    submitted[(model, engines[model].add_request(prompt, params))] = now
                burst += 1
            stepped = False
            for model, engine in enumerate(engines):
                if not engine.has_unfinished():
                    continue
                stepped = True
                for delta in engine.step():
                    key, at = (model, delta.request_id), time.perf_counter() - start
                    if delta.token_ids and key not in first_token:
                        first_token[key] = at
                    if delta.finish_reason is not None:
                        finished[key] = at
            timeline.append(
                {"t": time.perf_counter() - start}
                | {f"pages_{m}": (s := e.kv.stats()).pages_created * s.page_size for m, e in enumerate(engines)}
            )
            if not stepped:
                time.sleep(0.01)  # idle until the next burst
    finally:
        for engine in engines:
            engine.close()
    ttft = sorted(first_token[key] - submitted[key] for key in submitted)
    return {
        "mode": mode,
        "requests": len(submitted),
        "seconds": max(finished.values()),
        "requests_per_s": len(submitted) / max(finished.values()),
        "ttft_p50_s": statistics.median(ttft),
        "ttft_p99_s": ttft[min(len(ttft) - 1, round(0.99 * (len(ttft) - 1)))],
        "timeline": timeline,
    }


def plot(runs: list[dict[str, Any]], budget: int, path: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.5), sharey=True)
    for axis, mode in zip(axes, MODES, strict=True):
        run_ = next(r for r in runs if r["mode"] == mode)  # the first round's
        t = [point["t"] for point in run_["timeline"]]
        for model in (0, 1):
            axis.plot(t, [point[f"pages_{model}"] / MiB for point in run_["timeline"]], label=f"model {model}")
        limit, label = (budget, "budget") if mode == "shared" else (budget / 2, "each half")
        axis.axhline(limit / MiB, color="grey", linestyle="--", linewidth=0.8, label=label)
        axis.set_title(f"{mode}: TTFT p99 {run_['ttft_p99_s']:.2f} s, {run_['requests_per_s']:.2f} req/s", fontsize=9)
        axis.set_xlabel("seconds")
        axis.legend(fontsize=7)
    axes[0].set_ylabel("KV pages held (MiB)")
    save_figure(fig, path, "two models, bursts in turn: one shared KV budget against a static split")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--bursts", type=int, default=6, help="bursts per run, alternating between the models")
    parser.add_argument("--burst", type=int, default=8, help="requests per burst")
    parser.add_argument("--phase-s", type=float, default=6.0, help="seconds between bursts")
    parser.add_argument("--budget-requests", type=int, default=8, help="the budget, in longest requests")
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--max-context", type=int, default=512)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    prompts = [random_word_prompts(args.burst, 150, 250, seed=burst) for burst in range(args.bursts)]
    probe = LLMEngine(EngineConfig(dtype=args.dtype, max_slots=1, max_context=args.max_context))
    try:
        longest = max(len(probe.tokenizer(p).input_ids) for burst in prompts for p in burst) + args.output_tokens
        budget = args.budget_requests * probe.kv.slot_bytes(longest)
    finally:
        probe.close()
    runs = []
    for round_ in tqdm(range(args.rounds), desc="rounds"):
        for mode in MODES if round_ % 2 == 0 else MODES[::-1]:
            runs.append(run(mode, args, budget, prompts) | {"round": round_})
    rows = []
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        rows.append(
            {"mode": mode, "budget_mib": budget / MiB, "rounds": len(mine)}
            | {
                f"{metric}_{stat}": fn([r[metric] for r in mine])
                for metric in ("requests_per_s", "ttft_p50_s", "ttft_p99_s")
                for stat, fn in (("median", statistics.median), ("min", min), ("max", max))
            }
        )
    payload = {
        "command": command_line(),
        "machine": machine_facts(),
        "args": vars(args),
        "budget_bytes": budget,
        "longest_request_tokens": longest,
        "rows": rows,
        "runs": [{k: v for k, v in r.items() if k != "timeline"} for r in runs],
        "timelines": {f"{r['mode']}_{r['round']}": r["timeline"] for r in runs},
    }
    csv_path, json_path, png_path = write_results(args.out, "shared_budget", rows, payload)
    columns = [
        ("mode", "mode", 8, ""),
        ("req/s", "requests_per_s_median", 7, ".2f"),
        ("TTFT p50 s", "ttft_p50_s_median", 11, ".2f"),
        ("TTFT p99 s", "ttft_p99_s_median", 11, ".2f"),
        ("p99 min", "ttft_p99_s_min", 8, ".2f"),
        ("p99 max", "ttft_p99_s_max", 8, ".2f"),
    ]
    print_table(rows, columns, f"two models in bursts, {budget / MiB:.0f} MiB of KV, median of {args.rounds} rounds")
    plot(runs, budget, png_path)
    print(f"\nwrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
