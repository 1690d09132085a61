"""Projections of many rows, as prompt chunks run them: a bf16 weight on oneDNN's bf16 matmul
(its packed copy) against the same weight widened to float32 for each call and multiplied in
float32 (DenseLinear's path where `bf16_matmul_fast` is false), with float32 weights on oneDNN's
packed matmul beside them.

The default model's four projections of a layer for 30 layers, as benchmarks.few_rows runs them,
the three paths alternating for `--rounds` rounds in one process; reported per row count: each
path's best pass per round (median of the rounds, ms and GFLOP/s) and, round by round, the
widened path's speed against bf16's matmul and float32's against bf16's (median and range).

    python -m benchmarks.prompt_rows [--rows 128,256,512,1024] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
import torch.nn.functional as F
from tqdm import tqdm

from benchmarks.few_rows import LAYERS, SHAPES, best_pass
from measure.results import (
    RESULTS_DIR,
    command_line,
    machine_facts,
    print_table,
    ratio_range,
    save_figure,
    write_results,
)
from serving.model.cpu_features import bf16_matmul_fast

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PATHS = ("bf16_onednn", "bf16_widened", "float32_onednn")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="128,256,512,1024")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    return args


def packed(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64)


def passes(rows: int, weights: list[list[torch.Tensor]]) -> dict[str, Callable[[], None]]:
    """One pass of every layer's projections on each path, over fresh inputs of `rows` rows."""
    generator = torch.Generator().manual_seed(rows)
    xs = [torch.randn(rows, inputs, generator=generator) for _, inputs in SHAPES]
    xs_bf16 = [x.bfloat16() for x in xs]
    bf16 = [[packed(w) for w in layer] for layer in weights]
    fp32 = [[packed(w.float()) for w in layer] for layer in weights]

    def onednn(layers: list[list[torch.Tensor]], inputs: list[torch.Tensor]) -> Callable[[], None]:
        def run() -> None:
            for layer in layers:
                for w, x in zip(layer, inputs, strict=True):
                    torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

        return run

    def widened() -> None:
        for layer in weights:
            for w, x in zip(layer, xs_bf16, strict=True):
                F.linear(x.float(), w.float()).bfloat16()

    return {"bf16_onednn": onednn(bf16, xs_bf16), "bf16_widened": widened, "float32_onednn": onednn(fp32, xs)}


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    weights = [
        [(torch.randn(out, inputs, generator=generator) * 0.05).bfloat16() for out, inputs in SHAPES]
        for _ in range(LAYERS)
    ]
    flops_per_row = 2 * LAYERS * sum(out * inputs for out, inputs in SHAPES)
    rows = []
    for count in tqdm(args.rows, desc="rows"):
        runs = passes(count, weights)
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                times[path].append(best_pass(runs[path], repeats=2))
        row: dict[str, Any] = {"rows": count}
        for path, seconds in times.items():
            median = statistics.median(seconds)
            row |= {f"{path}_ms": median * 1e3, f"{path}_gflop_s": flops_per_row * count / median / 1e9}
        speed = {path: [1 / t for t in seconds] for path, seconds in times.items()}
        for name, path in (("widened", "bf16_widened"), ("float32", "float32_onednn")):
            ratio = ratio_range(speed[path], speed["bf16_onednn"])
            row |= {f"{name}_vs_bf16": ratio["median"], f"{name}_min": ratio["min"], f"{name}_max": ratio["max"]}
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name in ("widened", "float32"):
        ax.errorbar(
            [r["rows"] for r in rows],
            [r[f"{name}_vs_bf16"] for r in rows],
            yerr=[
                [r[f"{name}_vs_bf16"] - r[f"{name}_min"] for r in rows],
                [r[f"{name}_max"] - r[f"{name}_vs_bf16"] for r in rows],
            ],
            marker="o",
            capsize=3,
            label={"widened": "bf16 weight widened to float32", "float32": "float32 weight on oneDNN"},
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows (prompt tokens in a call)")
    ax.set_ylabel("speed / oneDNN's bf16 matmul")
    ax.legend()
    save_figure(fig, path, "prompt-row projections against oneDNN's bf16 matmul")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        raise SystemExit("oneDNN has no bf16 matmul on this CPU (it needs AVX512_BF16 or AMX)")
    rows = measure(args)
    payload = {"command": command_line(), "machine": machine_facts(), "rounds": args.rounds, "rows": rows}
    payload["workload"] = {"shapes": SHAPES, "layers": LAYERS, "threads": args.threads}
    payload["bf16_matmul_fast"] = bf16_matmul_fast()
    csv_path, json_path, png_path = write_results(args.out, "prompt_rows", rows, payload)
    print_table(
        rows,
        [
            ("rows", "rows", 5, ""),
            ("bf16 ms", "bf16_onednn_ms", 9, ".1f"),
            ("widened ms", "bf16_widened_ms", 11, ".1f"),
            ("fp32 ms", "float32_onednn_ms", 9, ".1f"),
            ("widened/bf16", "widened_vs_bf16", 13, ".2f"),
            ("min", "widened_min", 5, ".2f"),
            ("max", "widened_max", 5, ".2f"),
            ("fp32/bf16", "float32_vs_bf16", 10, ".2f"),
            ("min", "float32_min", 5, ".2f"),
            ("max", "float32_max", 5, ".2f"),
        ],
        f"{LAYERS} layers' projections, {args.threads} threads; speed against oneDNN's bf16 matmul",
    )
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
