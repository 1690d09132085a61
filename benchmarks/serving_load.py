"""Load generator for the HTTP server: Poisson arrivals at several request rates.

Sends seeded prompts to `/v1/completions` with `stream: true` (read as server-sent events, measure.streams)
and times every chunk. Reported per rate: request throughput, output tokens/s, and per
request time to first token (TTFT), time per output token after the first (TPOT) and
inter-token latency (ITL, the gaps between chunks), p50/p99.

Without --url it starts `vattn serve` as a subprocess on a free loopback port first.

    python -m benchmarks.serving_load [--rates 0.5,1,2,inf] [--requests 48] [--output-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import Sequence
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import matplotlib
from tqdm import tqdm

from measure.results import (
    RESULTS_DIR,
    CpuShare,
    command_line,
    machine_facts,
    print_table,
    save_figure,
    write_results,
)
from measure.servers import local_server
from measure.streams import Timing, http_client, one_request, summarize
from measure.workloads import random_word_prompts

matplotlib.use("Agg")
import matplotlib.pyplot as plt


async def run_rate(url: str, model: str, prompts: list[str], rate: float, args: argparse.Namespace) -> dict[str, Any]:
    """Sends every prompt, arrivals a Poisson process at `rate` per second (inf: all at once)."""
    rng = random.Random(args.seed)
    client = http_client(args.api_key)
    bar = tqdm(total=len(prompts), desc=f"rate {rate}/s", unit="req")

    async def arrive(delay: float, prompt: str) -> Timing:
        await asyncio.sleep(delay)
        timing = await one_request(client, url, model, prompt, args.output_tokens)
        bar.update()
        return timing

    delays, clock = [], 0.0
    for _ in prompts:
        delays.append(clock)
        clock += 0.0 if math.isinf(rate) else rng.expovariate(rate)
    cpu = CpuShare()
    started = time.perf_counter()
    timings = await asyncio.gather(*(arrive(d, p) for d, p in zip(delays, prompts, strict=True)))
    elapsed = time.perf_counter() - started
    bar.close()
    await client.aclose()
    assert all(t.tokens == args.output_tokens for t in timings), "a request came back short"
    return {"request_rate": rate, **summarize(timings, elapsed), "other_cpu_share": round(cpu.stop()["other_share"], 3)}


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    labels = [str(row["request_rate"]) for row in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    axes[0].bar(labels, [row["output_tokens_per_s"] for row in rows], color="tab:green")
    axes[0].set_ylabel("output tokens/s")
    for ax, key, label in ((axes[1], "ttft", "TTFT (s)"), (axes[2], "itl", "inter-token latency (ms)")):
        unit = "s" if key == "ttft" else "ms"
        ax.plot(labels, [row[f"{key}_p50_{unit}"] for row in rows], "o-", label="p50")
        ax.plot(labels, [row[f"{key}_p99_{unit}"] for row in rows], "s--", label="p99")
        ax.set_ylabel(label)
        ax.legend()
    for ax in axes:
        ax.set_xlabel("request rate (req/s)")
    save_figure(fig, path, title)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server; default: start `vattn serve` here")
    parser.add_argument("--serve-args", default="--max-slots 32 --max-context 1024", help="for the started server")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--api-key")
    parser.add_argument("--rates", default="0.5,1,2,inf", help="requests per second; inf sends all at once")
    parser.add_argument("--requests", type=int, default=48, help="requests per rate")
    parser.add_argument("--shortest", type=int, default=16, help="shortest prompt, words")
    parser.add_argument("--longest", type=int, default=256, help="longest prompt, words")
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="serving_load")
    args = parser.parse_args(argv)

    prompts = random_word_prompts(args.requests, args.shortest, args.longest, args.seed)
    rows = []
    with local_server(args.serve_args) if args.url is None else nullcontext(args.url) as url:
        for rate in (float(r) for r in args.rates.split(",")):
            rows.append(asyncio.run(run_rate(url, args.model, prompts, rate, args)))
            payload = {"command": command_line(), "machine": machine_facts(), "settings": vars(args), "rows": rows}
            _, _, png = write_results(args.out, args.name, rows, payload)
            plot(rows, png, f"{args.requests} requests/rate, {args.output_tokens} output tokens, streaming")
    print_table(
        rows,
        [
            ("rate/s", "request_rate", 7, ""),
            ("req/s", "requests_per_s", 7, ".2f"),
            ("tok/s", "output_tokens_per_s", 8, ".1f"),
            ("TTFT p50", "ttft_p50_s", 9, ".2f"),
            ("TTFT p99", "ttft_p99_s", 9, ".2f"),
            ("TPOT p50", "tpot_p50_ms", 9, ".0f"),
            ("TPOT p99", "tpot_p99_ms", 9, ".0f"),
            ("ITL p50", "itl_p50_ms", 8, ".0f"),
            ("ITL p99", "itl_p99_ms", 8, ".0f"),
        ],
        "serving load (TTFT s, TPOT/ITL ms)",
    )


if __name__ == "__main__":
    main()
