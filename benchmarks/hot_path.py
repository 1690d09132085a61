"""The allocator's hot path before and after a change, both measured in one run.

Two source trees of `vattn` are compared: the baseline (`git archive REF vattn` in a
temporary directory, the built native library copied in) and the working tree (or
`--current-ref`, extracted alike). Each measurement runs in a fresh interpreter whose
PYTHONPATH starts with the tree under test (it checks `vattn.__file__`); the trees
alternate for `--rounds` rounds and each operation's median (and min) µs per call are
compared: on a shared 2-core VM only ratios taken in one run mean anything, and a run of
a ref against itself (`--current-ref` = `--baseline`) shows how far they stray from 1.
The cache: host backend, native calls, 4 layers x 2 KV heads x 64, float32, 16 slots x
4,096 tokens, background mapping, 64 KiB pages (128 tokens per page, so decoding crosses
page boundaries; at 2 MiB a slot would hold one page); one torch thread.

Operations, through public APIs only: `alloc_free` (alloc_reqid + free_reqid, recycling
a slot whose pages stay mapped); `step` (8 requests decoding one token per call; the
requests are freed, their pages released and new ones started near max_context);
`kv` (one layer's views of a 300-token request, dropped at once); `kv_keep` (the same,
keeping the previous views alive); `sdpa` (per decode iteration, plan + forward through
every layer of the sdpa kernel, the step before it untimed).

    python -m benchmarks.hot_path [--baseline 8431c79] [--current-ref REF] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

from measure.results import (
    REPO_ROOT,
    RESULTS_DIR,
    command_line,
    machine_facts,
    print_table,
    save_figure,
    write_results,
)
from vattn import KVCache, KVCacheConfig
from vattn.kernels import make_kernel
from vattn.sizes import KiB, parse_size, size_label

SHAPE: dict[str, Any] = {
    "num_layers": 4,
    "num_kv_heads": 2,
    "head_dim": 64,
    "dtype": "float32",
    "max_slots": 16,
    "max_context": 4096,
    "backend": "host",
    "native": True,
    "background": True,
}
QUERY_HEADS = 8
CALLS = {"alloc_free": 5000, "step": 8000, "kv": 20000, "kv_keep": 20000, "sdpa": 400}
"""Timed calls per operation and round (scaled by --scale): a tenth of them warm up, then
BLOCKS blocks share them and the fastest block counts (other processes only slow one down)."""
BLOCKS = 10
TREES = ("before", "after")


def block_calls(op: str, scale: float) -> int:
    return max(1, round(CALLS[op] * scale / BLOCKS))


def decode(cache: KVCache, starts: Sequence[int], iterations: int) -> Iterator[dict[int, int]]:
    """Lengths of `iterations` decode iterations of len(starts) requests, one token longer each
    time; near max_context the requests are freed, their pages released and new ones prefilled."""
    lengths: dict[int, int] = {}
    for _ in range(iterations):
        if not lengths or max(lengths.values()) >= cache.config.max_context:
            for reqid in lengths:
                cache.free_reqid(reqid)
            cache.release_idle()
            lengths = {cache.alloc_reqid(): n for n in starts}
            cache.step(lengths)
            cache.wait_for_background()
        lengths = {reqid: n + 1 for reqid, n in lengths.items()}
        yield lengths
    for reqid in lengths:
        cache.free_reqid(reqid)


def time_alloc_free(cache: KVCache, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        cache.free_reqid(cache.alloc_reqid())
    return time.perf_counter() - started


def time_step(cache: KVCache, calls: int) -> float:
    elapsed = 0.0
    for lengths in decode(cache, [64 + 40 * i for i in range(8)], calls):
        started = time.perf_counter()
        cache.step(lengths)
        elapsed += time.perf_counter() - started
    return elapsed


def time_kv(cache: KVCache, calls: int, keep: bool) -> float:
    reqid = cache.alloc_reqid()
    cache.step({reqid: 300})
    views = cache.kv(0, reqid)
    started = time.perf_counter()
    if keep:
        for _ in range(calls):
            views = cache.kv(0, reqid)
    else:
        for _ in range(calls):
            cache.kv(0, reqid)
    elapsed = time.perf_counter() - started
    del views
    cache.free_reqid(reqid)
    return elapsed


def time_sdpa(cache: KVCache, calls: int) -> float:
    cfg = cache.config
    kernel = make_kernel("sdpa", cache, num_query_heads=QUERY_HEADS)
    q = torch.randn(8, QUERY_HEADS, cfg.head_dim)
    k, v = torch.randn(2, 8, cfg.num_kv_heads, cfg.head_dim)
    elapsed = 0.0
    for lengths in decode(cache, [256 + 32 * i for i in range(8)], calls):
        cache.step(lengths)
        started = time.perf_counter()
        batch = kernel.plan(list(lengths), [1] * len(lengths))
        for layer in range(cfg.num_layers):
            kernel.forward(layer, batch, q, k, v)
        del batch
        elapsed += time.perf_counter() - started
    return elapsed


OPS: dict[str, Callable[[KVCache, int], float]] = {
    "alloc_free": time_alloc_free,
    "step": time_step,
    "kv": lambda cache, calls: time_kv(cache, calls, keep=False),
    "kv_keep": lambda cache, calls: time_kv(cache, calls, keep=True),
    "sdpa": time_sdpa,
}


def measure(args: argparse.Namespace) -> None:
    """The child: checks which vattn it runs, times every operation, writes its best µs per call."""
    import vattn

    tree = Path(args.tree).resolve()
    if not Path(vattn.__file__).resolve().is_relative_to(tree):
        raise SystemExit(f"hot_path: imported {vattn.__file__}, not the tree under test {tree}")
    torch.set_num_threads(1)
    result: dict[str, float] = {}
    with KVCache(KVCacheConfig(**SHAPE, page_size=args.page_size)) as cache:
        for op, timer in OPS.items():
            calls = block_calls(op, args.scale)
            try:
                timer(cache, max(1, calls * BLOCKS // 10))
                result[op] = min(timer(cache, calls) for _ in range(BLOCKS)) / calls * 1e6
            except (Exception, KeyboardInterrupt) as exc:
                traceback.print_exc()
                raise SystemExit(f"hot_path: {op} failed in {tree}: {exc!r}") from exc
    Path(args.json_out).write_text(json.dumps(result))


def git(*args: str) -> bytes:
    done = subprocess.run(["git", "-C", str(REPO_ROOT), *args], capture_output=True)
    if done.returncode:
        raise SystemExit(f"git {' '.join(args)} failed: {done.stderr.decode().strip()}")
    return done.stdout


def extract(ref: str, into: Path) -> Path:
    """`vattn/` at `ref` under `into`, with the working tree's built native library copied in."""
    into.mkdir()
    subprocess.run(["tar", "-x", "-C", str(into)], input=git("archive", ref, "vattn"), check=True)
    native = REPO_ROOT / "vattn" / "libvattn_native.so"
    (into / "vattn" / native.name).write_bytes(native.read_bytes())
    return into


def run_child(tree: Path, args: argparse.Namespace, json_out: Path) -> dict[str, float]:
    """One measurement of `tree` in a fresh interpreter (-P: no script or working directory on sys.path)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(REPO_ROOT)])}
    command = [sys.executable, "-P", "-m", "benchmarks.hot_path", "--measure", "--tree", str(tree)]
    command += ["--json-out", str(json_out), "--page-size", str(args.page_size), "--scale", str(args.scale)]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"measuring {tree} failed (exit {done.returncode}):\n{done.stderr[-4000:]}")
    return json.loads(json_out.read_text())


def plot(rows: list[dict[str, Any]], labels: dict[str, str], path: Path, title: str) -> None:
    """Median µs per call of each operation, before vs after, on a log axis; ratios above."""
    fig, ax = plt.subplots(figsize=(9, 4.5))
    x = np.arange(len(rows))
    for offset, tree, color in ((-0.2, "before", "tab:gray"), (0.2, "after", "tab:blue")):
        medians = [row[f"{tree}_median_us"] for row in rows]
        ax.bar(x + offset, medians, width=0.4, color=color, label=f"{tree}: {labels[tree]}")
    for i, row in enumerate(rows):
        top = max(row["before_median_us"], row["after_median_us"])
        ax.annotate(f"x{row['ratio']:.2f}", (x[i], top * 1.15), ha="center", fontsize=8)
    ax.set_xticks(x, [row["op"] for row in rows])
    ax.set_yscale("log")
    ax.set_ylabel("median µs per call (log)")
    ax.set_title("allocator hot path: after / before, medians over rounds")
    ax.legend(fontsize=8)
    save_figure(fig, path, title)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default="8431c79", help="git ref of the 'before' tree")
    parser.add_argument("--current-ref", default=None, help="git ref of the 'after' tree (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=5, help="measurements of each tree, alternating")
    parser.add_argument("--page-size", type=parse_size, default=64 * KiB, help="e.g. 64K, 2M (default 64K)")
    parser.add_argument("--scale", type=float, default=1.0, help="multiplies the timed calls of every operation")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results directory")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure:
        measure(args)
        return

    refs = {"before": args.baseline, "after": args.current_ref}
    labels = {tree: ref or "working tree" for tree, ref in refs.items()}
    commits = {
        tree: git("rev-parse", "--verify", f"{ref or 'HEAD'}^{{commit}}").decode().strip()
        + ("" if ref else " + working tree")
        for tree, ref in refs.items()
    }
    samples: dict[str, dict[str, list[float]]] = {tree: {op: [] for op in OPS} for tree in TREES}
    with tempfile.TemporaryDirectory(prefix="hot_path_") as tmp:
        roots = {tree: extract(ref, Path(tmp) / tree) if ref else REPO_ROOT for tree, ref in refs.items()}
        for _ in tqdm(range(args.rounds), desc="rounds (before, after)", unit="round"):
            for tree in TREES:
                result = run_child(roots[tree], args, Path(tmp) / f"{tree}.json")
                for op in OPS:
                    samples[tree][op].append(result[op])

    rows = []
    for op in OPS:
        row: dict[str, Any] = {"op": op, "rounds": args.rounds}
        for tree in TREES:
            row[f"{tree}_median_us"] = statistics.median(samples[tree][op])
            row[f"{tree}_min_us"] = min(samples[tree][op])
        row["ratio"] = row["after_median_us"] / row["before_median_us"]
        row["ratio_min"] = row["after_min_us"] / row["before_min_us"]
        rows.append(row)
    meta = {"command": command_line(), **machine_facts()}
    config = {**SHAPE, "page_size": args.page_size, "query_heads": QUERY_HEADS, "torch_threads": 1}
    calls = {op: BLOCKS * block_calls(op, args.scale) for op in OPS}
    payload = {"meta": meta, "trees": commits, "config": config, "calls": calls, "summary": rows, "samples": samples}
    csv_path, json_path, png_path = write_results(args.out, "hot_path", rows, payload)
    title = f"{meta['command']}  |  {meta['cpu_model']}, {meta['nproc']} cores, {meta['date']}"
    plot(rows, labels, png_path, title)

    columns = [("op", "op", 10, "")]
    for tree in TREES:
        columns += [(f"{tree} p50 µs", f"{tree}_median_us", 14, ".2f"), (f"{tree} min", f"{tree}_min_us", 11, ".2f")]
    heading = f"before: {commits['before']}, after: {commits['after']}; {size_label(args.page_size)} pages"
    ratios = [("after/before", "ratio", 12, ".3f"), ("of mins", "ratio_min", 8, ".3f")]
    print_table(rows, columns + ratios, heading)
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
