"""Tensor parallelism on this machine: two ranks against one, on the test model.

The model is `measure.workloads.small_llama` (random weights, 4 query and 2 KV heads, 2
layers, hidden 128: the default model's 3 KV heads split over no size > 1). `--prompts`
prompts of 200 random tokens, `--output-tokens` greedy tokens each (ignore_eos), all at once.
For TP=1 and TP=2 (two processes on loopback, gloo, each rank with one of the two cores'
threads): whether the tokens are equal, wall time, engine iterations and the mean time of
one. On two cores this shows the cost of the collectives (two all-reduces per layer and a
broadcast of the iteration per step), not a speed-up: a model this small has almost nothing
to split.

    python -m benchmarks.tensor_parallel
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, save_figure, write_results
from measure.workloads import small_llama
from serving import LLM, SamplingParams


def run(model: Path, size: int, prompts: list[list[int]], output_tokens: int) -> tuple[dict[str, Any], list[list[int]]]:
    llm = LLM(model=str(model), tensor_parallel_size=size, max_slots=16, max_context=512, kv_budget=128 << 20)
    params = SamplingParams(max_tokens=output_tokens, temperature=0, ignore_eos=True)
    try:
        llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
        llm.engine.kv.reset_prefix_cache()  # every rank computes every prompt
        before = llm.engine.stats().iterations
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - started
        iterations = llm.engine.stats().iterations - before
    finally:
        llm.close()
    tokens = [output.token_ids for output in outputs]
    row = {
        "table": "tensor parallel",
        "tensor_parallel_size": size,
        "seconds": round(seconds, 3),
        "iterations": iterations,
        "ms_per_iteration": round(seconds / iterations * 1e3, 2),
        "output_tokens_per_s": round(sum(map(len, tokens)) / seconds, 1),
    }
    return row, tokens


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40_000, (200,), generator=generator).tolist() for _ in range(args.prompts)]
    rows, tokens = [], {}
    with tempfile.TemporaryDirectory() as folder:
        model = small_llama(Path(folder))
        for size in tqdm((1, 2), desc="tensor_parallel_size"):
            row, tokens[size] = run(model, size, prompts, args.output_tokens)
            rows.append({**row, "tokens_equal_to_tp1": tokens[size] == tokens[1]})
    payload = {"command": command_line(), "machine": machine_facts(), "args": vars(args), "rows": rows}
    csv_path, json_path, png_path = write_results(args.out, "tensor_parallel", rows, payload)
    for row in rows:
        print(row)
    fig, axis = plt.subplots(figsize=(5, 4))
    axis.bar([f"TP={r['tensor_parallel_size']}" for r in rows], [r["ms_per_iteration"] for r in rows])
    axis.set_ylabel("ms per engine iteration (16 requests)")
    save_figure(fig, png_path, command_line())
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
