"""Projections of a few rows, as decode steps of 1-128 requests run them: vattn::tiled_linear on
its tiled copy of each weight against what DenseLinear runs without the tiles (`untiled`:
oneDNN's matmul on its packed copy; a bf16 weight where oneDNN's bf16 is slower than its float32,
the weight widened to float32 for each call), float32 and bf16.

The default model's four projections of a layer (QKV 960x576, output 576x576, gate/up 3072x576,
down 576x1536) for 30 layers, each with its own weights, so that the weights stream from memory
as in a decode step; one pass runs the four for every layer. The two paths alternate for
`--rounds` rounds in one process; reported per dtype and row count: each path's best pass per
round (median of the rounds, ms and weight GB/s) and the ratio of the untiled path's time to the tiles'
round by round, its median and range.

    python -m benchmarks.few_rows [--rows 1,4,8,16,24,32,48,64,96,128] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib
import torch
from tqdm import tqdm

from measure.results import (
    RESULTS_DIR,
    command_line,
    machine_facts,
    print_table,
    ratio_range,
    save_figure,
    write_results,
)
from serving.model.linear import DenseLinear, tiled_rows, tiles_run

matplotlib.use("Agg")
import matplotlib.pyplot as plt

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) of one layer's projections
LAYERS = 30


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,24,32,48,64,96,128")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    args.rows = [int(r) for r in args.rows.split(",")]
    return args


def best_pass(run: Callable[[], None], repeats: int = 3) -> float:
    run()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def measure_dtype(dtype: torch.dtype, args: argparse.Namespace) -> list[dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    layers = [
        [DenseLinear((torch.randn(out, inputs, generator=generator) * 0.05).to(dtype), None) for out, inputs in SHAPES]
        for _ in range(LAYERS)
    ]
    weight_bytes = LAYERS * sum(out * inputs for out, inputs in SHAPES) * torch.finfo(dtype).bits // 8
    rows = []
    for count in tqdm(args.rows, desc=str(dtype).split(".")[1]):
        xs = [torch.randn(count, inputs, generator=generator).to(dtype) for _, inputs in SHAPES]

        def onednn(xs: list[torch.Tensor] = xs) -> None:
            for layer in layers:
                for linear, x in zip(layer, xs, strict=True):
                    linear.untiled(x)

        def tiled(xs: list[torch.Tensor] = xs) -> None:
            for layer in layers:
                for linear, x in zip(layer, xs, strict=True):
                    torch.ops.vattn.tiled_linear(x, linear.tiles, None, linear.widens)

        times: dict[str, list[float]] = {"onednn": [], "tiles": []}
        for _ in range(args.rounds):
            times["onednn"].append(best_pass(onednn))
            times["tiles"].append(best_pass(tiled))
        ratio = ratio_range([1 / t for t in times["tiles"]], [1 / t for t in times["onednn"]])
        row: dict[str, Any] = {"dtype": str(dtype).split(".")[1], "rows": count, "used": count <= tiled_rows(dtype)}
        for path, seconds in times.items():
            median = statistics.median(seconds)
            row |= {f"{path}_ms": median * 1e3, f"{path}_weight_gb_s": weight_bytes / median / 1e9}
        rows.append(row | {"ratio": ratio["median"], "ratio_min": ratio["min"], "ratio_max": ratio["max"]})
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for dtype in sorted({r["dtype"] for r in rows}):
        mine = [r for r in rows if r["dtype"] == dtype]
        ax.errorbar(
            [r["rows"] for r in mine],
            [r["ratio"] for r in mine],
            yerr=[[r["ratio"] - r["ratio_min"] for r in mine], [r["ratio_max"] - r["ratio"] for r in mine]],
            marker="o",
            capsize=3,
            label=dtype,
        )
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xlabel("rows (requests in a decode step)")
    ax.set_ylabel("tiles' speed / oneDNN's")
    ax.legend()
    save_figure(fig, path, "few-row projections: vattn::tiled_linear against oneDNN")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    probe = torch.zeros(16, 2)
    dtypes = [dtype for dtype in (torch.float32, torch.bfloat16) if tiles_run(probe.to(dtype))]
    if not dtypes:
        raise SystemExit("vattn::tiled_linear does not run on this CPU (it needs AVX-512; bf16: AVX512_BF16)")
    rows = [row for dtype in dtypes for row in measure_dtype(dtype, args)]
    payload = {"command": command_line(), "machine": machine_facts(), "rounds": args.rounds, "rows": rows}
    payload["workload"] = {
        "shapes": SHAPES,
        "layers": LAYERS,
        "threads": args.threads,
        "tiled_rows": {str(dtype).split(".")[1]: tiled_rows(dtype) for dtype in dtypes},
        "bf16_widened": torch.bfloat16 in dtypes and DenseLinear(probe.bfloat16(), None).widens,
    }
    csv_path, json_path, png_path = write_results(args.out, "few_rows", rows, payload)
    print_table(
        rows,
        [
            ("dtype", "dtype", 9, ""),
            ("rows", "rows", 5, ""),
            ("oneDNN ms", "onednn_ms", 10, ".2f"),
            ("tiles ms", "tiles_ms", 9, ".2f"),
            ("GB/s", "tiles_weight_gb_s", 6, ".0f"),
            ("ratio", "ratio", 6, ".2f"),
            ("min", "ratio_min", 5, ".2f"),
            ("max", "ratio_max", 5, ".2f"),
        ],
        f"{LAYERS} layers' projections, {args.threads} threads; ratio: oneDNN's time / the tiles'",
    )
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
