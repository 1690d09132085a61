"""A GGUF's 4-bit projections as stored, at 1-2048 rows (decode steps to prompt chunks), on AVX2:
vattn::paired_linear (activations in int16), vattn::widened_linear (each tile widened to float32
once, multiplied in float32) and the float32 model's projection on the dequantized weights as
DenseLinear runs it (vattn::tiled_linear up to TILED_ROWS rows, oneDNN's packed matmul past
them), with GroupedLinear's choice between the first two (INT16_ROWS).

The default model's four projections of a layer for 30 layers (benchmarks.few_rows' shapes),
each with its own Q4_1 weights (random nibbles, float16 scales and mins as a GGUF stores them),
so that the weights stream from memory as in a decode step. The paths alternate for `--rounds`
rounds in one process; reported per row count: each path's best pass per round (median of the
rounds, ms) and the speed of each against float32's, round by round: median and range.

    python -m benchmarks.stored_rows [--rows 1,4,8,16,20,24,32,64,128,512,2048] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
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
from serving.model.linear import INT16_ROWS, DenseLinear, GroupedLinear, paired_kernels
from serving.model.weights import INPUTS_PER_SCALE, GroupedWeight, PairedWeight

matplotlib.use("Agg")
import matplotlib.pyplot as plt

PATHS = ("int16", "widened", "chosen", "float32")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,20,24,32,64,128,512,2048")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "avx2")
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    return args


def q4_1(out: int, inputs: int, generator: torch.Generator) -> GroupedWeight:
    groups = inputs // INPUTS_PER_SCALE
    data = torch.randint(0, 256, (out, inputs // 2), dtype=torch.uint8, generator=generator)
    scales = (torch.rand(out, groups, generator=generator) * 0.01).half().float()
    mins = (torch.randn(out, groups, generator=generator) * 0.05).half().float()
    return GroupedWeight(4, data, scales, mins)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in tqdm(range(LAYERS), desc="weights"):
        stored = [q4_1(out, inputs, generator) for out, inputs in SHAPES]
        layers.append([(GroupedLinear(w, None), DenseLinear(w.dequantize(), None)) for w in stored])
    ops = torch.ops.vattn
    rows = []
    for count in tqdm(args.rows, desc="rows"):
        xs = [torch.randn(count, inputs, generator=generator) for _, inputs in SHAPES]

        def run(path: str, xs: list[torch.Tensor] = xs) -> None:
            for layer in layers:
                for (grouped, dense), x in zip(layer, xs, strict=True):
                    w = grouped.weight
                    assert isinstance(w, PairedWeight)
                    if path == "int16":
                        ops.paired_linear(x, w.data, w.scales, w.mins, None, w.bits, False, 16)
                    elif path == "widened":
                        ops.widened_linear(x, w.data, w.scales, w.mins, None, w.bits)
                    else:
                        (grouped if path == "chosen" else dense)(x)

        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for _ in range(args.rounds):
            for path in PATHS:
                times[path].append(best_pass(lambda path=path: run(path)))
        row: dict[str, Any] = {"rows": count, "chosen": "int16" if count <= INT16_ROWS else "widened"}
        for path in PATHS:
            row[f"{path}_ms"] = statistics.median(times[path]) * 1e3
        for path in PATHS[:-1]:
            ratio = ratio_range([1 / t for t in times[path]], [1 / t for t in times["float32"]])
            row |= {f"{path}_vs_float32": ratio["median"], f"{path}_min": ratio["min"], f"{path}_max": ratio["max"]}
        rows.append(row)
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    counts = [r["rows"] for r in rows]
    for name in PATHS[:-1]:
        ax.errorbar(
            counts,
            [r[f"{name}_vs_float32"] for r in rows],
            yerr=[
                [r[f"{name}_vs_float32"] - r[f"{name}_min"] for r in rows],
                [r[f"{name}_max"] - r[f"{name}_vs_float32"] for r in rows],
            ],
            marker="o",
            capsize=3,
            label=name,
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows")
    ax.set_ylabel("speed / float32 model's")
    ax.legend()
    save_figure(fig, path, "Q4_1 projections as stored against the float32 model's")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if paired_kernels() != "int16_avx2":
        raise SystemExit(f"this compares the AVX2 bodies; here paired_linear runs {paired_kernels()}")
    rows = measure(args)
    payload = {"command": command_line(), "machine": machine_facts(), "rounds": args.rounds, "rows": rows}
    payload["workload"] = {"shapes": SHAPES, "layers": LAYERS, "threads": args.threads, "int16_rows": INT16_ROWS}
    csv_path, json_path, png_path = write_results(args.out, "stored_rows", rows, payload)
    columns = [("rows", "rows", 5, ""), ("chosen", "chosen", 8, "")]
    columns += [(f"{path} ms", f"{path}_ms", 11, ".1f") for path in PATHS]
    columns += [(f"{path}/fp32", f"{path}_vs_float32", 12, ".2f") for path in PATHS[:-1]]
    print_table(rows, columns, f"{LAYERS} layers' Q4_1 projections, {args.threads} threads; x/fp32: speed ratio")
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
