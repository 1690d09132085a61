"""The ragged attention kernel alone, per SIMD body: AVX-512, AVX2 and scalar (the last puts
nothing across keys: one dot product, one reduction and one exp per key and head).

Each body runs in its own process (ATEN_CPU_CAPABILITY caps the body as it caps torch's own
kernels), on the default model's heads (9 query heads over 3 KV heads of 64), float32 queries
over float32 and float16 caches, at decode shapes (one new token per request) and prefill
chunks; the bodies alternate for `--rounds` rounds and the median time per call is reported
with its GFLOP/s (4 * rows * heads * head_dim * keys) and the KV bytes it read per second.
Shapes whose KV exceeds the last-level cache are bound by memory, not by the kernel.

    python -m benchmarks.attention_kernel [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib
from tqdm import tqdm

from measure.results import RESULTS_DIR, command_line, machine_facts, print_table, save_figure, write_results

matplotlib.use("Agg")
import matplotlib.pyplot as plt

BODIES = {"avx512": "avx512", "avx2": "avx2", "scalar": "default"}  # body: ATEN_CPU_CAPABILITY
SHAPES = [  # (requests, keys per request, new tokens per request)
    (1, 512, 1),
    (16, 1024, 1),
    (64, 1024, 1),
    (16, 4096, 1),
    (4, 256, 16),
    (8, 512, 32),
]
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64

# Run in a child process: times every shape and cache dtype, prints JSON.
MEASURE = """
import json, sys, time, torch
from vattn.ops import vattn_ops
ops, generator = vattn_ops(), torch.Generator().manual_seed(0)
torch.set_num_threads(int(sys.argv[1]))
heads, kv_heads, dim = {heads}, {kv_heads}, {dim}
results = []
for dtype in (torch.float32, torch.float16):
    for requests, keys, new in {shapes}:
        k, v = (torch.randn(requests, keys, kv_heads, dim, generator=generator).to(dtype) for _ in range(2))
        q = torch.randn(requests * new, heads, dim, generator=generator)
        out = torch.empty_like(q)
        vectors = (torch.arange(requests), torch.arange(requests) * new, torch.full((requests,), new),
                   torch.full((requests,), keys))
        call = lambda: ops.ragged_attention(out, q, k, v, *vectors, dim ** -0.5)
        call()
        start = time.perf_counter()
        call()
        repeats = max(3, int(0.2 / max(time.perf_counter() - start, 1e-5)))  # about 0.2 s per shape
        start = time.perf_counter()
        for _ in range(repeats):
            call()
        seconds = (time.perf_counter() - start) / repeats
        results.append({{"cache": str(dtype).split(".")[1], "requests": requests, "keys": keys, "new": new,
                         "seconds": seconds, "kv_bytes": 2 * k.numel() * k.element_size()}})
print(json.dumps({{"simd": ops.attention_simd(dim), "results": results}}))
"""


def run_body(capability: str, threads: int) -> dict[str, Any]:
    script = MEASURE.format(heads=HEADS, kv_heads=KV_HEADS, dim=HEAD_DIM, shapes=SHAPES)
    env = {k: v for k, v in os.environ.items() if k != "ATEN_CPU_CAPABILITY"} | {"ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run([sys.executable, "-c", script, str(threads)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ATEN_CPU_CAPABILITY={capability}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    return parser.parse_args(argv)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Median seconds per (body, cache, shape) over the rounds; a body this CPU lacks is skipped
    (its process reports the narrower body it fell back to)."""
    samples: dict[tuple[str, str, int, int, int], list[float]] = {}
    kv_bytes: dict[tuple[str, str, int, int, int], int] = {}
    for _ in tqdm(range(args.rounds), desc="rounds"):
        for body, capability in BODIES.items():
            found = run_body(capability, args.threads)
            if found["simd"] != body:
                continue
            for r in found["results"]:
                key = (body, r["cache"], r["requests"], r["keys"], r["new"])
                samples.setdefault(key, []).append(r["seconds"])
                kv_bytes[key] = r["kv_bytes"]
    rows = []
    for key, seconds in samples.items():
        body, cache, requests, keys, new = key
        median = statistics.median(seconds)
        flops = 4 * requests * new * HEADS * HEAD_DIM * keys
        rows.append(
            {"body": body, "cache": cache, "requests": requests, "keys": keys, "new_tokens": new}
            | {"us_per_call": median * 1e6, "gflops": flops / median / 1e9, "kv_gb_s": kv_bytes[key] / median / 1e9}
        )
    for row in rows:
        scalar = next(
            (
                r
                for r in rows
                if r["body"] == "scalar" and all(r[k] == row[k] for k in ("cache", "requests", "keys", "new_tokens"))
            ),
            None,
        )
        if scalar:
            row["speedup_vs_scalar"] = scalar["us_per_call"] / row["us_per_call"]
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(8, 3.8))
    shapes = [f"{r}x{k}{'' if n == 1 else f' +{n}'}" for r, k, n in SHAPES]
    bodies = [b for b in BODIES if any(r["body"] == b for r in rows)]
    width = 0.8 / max(1, len(bodies))
    for i, body in enumerate(bodies):
        speeds = []
        for requests, keys, new in SHAPES:
            row = next(
                r
                for r in rows
                if r["body"] == body
                and r["cache"] == "float32"
                and (r["requests"], r["keys"], r["new_tokens"]) == (requests, keys, new)
            )
            speeds.append(row["gflops"])
        ax.bar([x + i * width for x in range(len(SHAPES))], speeds, width, label=body)
    ax.set_xticks([x + width * (len(bodies) - 1) / 2 for x in range(len(SHAPES))], shapes, fontsize=8)
    ax.set_ylabel("GFLOP/s (float32 cache)")
    ax.set_xlabel("requests x keys (+ new tokens per request for prefill chunks)")
    ax.legend()
    save_figure(fig, path, "ragged attention kernel by SIMD body")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    rows = measure(args)
    payload = {"command": command_line(), "machine": machine_facts(), "rounds": args.rounds, "rows": rows}
    payload["shape"] = {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "threads": args.threads}
    csv_path, json_path, png_path = write_results(args.out, "attention_kernel", rows, payload)
    print_table(
        rows,
        [
            ("body", "body", 7, ""),
            ("cache", "cache", 8, ""),
            ("requests", "requests", 9, ""),
            ("keys", "keys", 6, ""),
            ("new", "new_tokens", 4, ""),
            ("us/call", "us_per_call", 9, ".1f"),
            ("GFLOP/s", "gflops", 8, ".1f"),
            ("KV GB/s", "kv_gb_s", 8, ".1f"),
            ("vs scalar", "speedup_vs_scalar", 10, ".2f"),
        ],
        f"ragged attention, {HEADS} heads over {KV_HEADS} KV heads of {HEAD_DIM}, {args.threads} threads",
    )
    plot(rows, png_path)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
