"""Does a large structured-output request stall the other streams?

A fresh `vattn serve` (so the first grammar of the process is measured, with whatever it
compiles or builds on first use) runs `--streams` greedy streams of `--output-tokens`
tokens. In the `schema` phase, once every stream has its first token, one request arrives
with a JSON schema of `--properties` required integer properties; the `plain` phase runs
the same streams alone. Reported per phase: the streams' gaps between chunks (p50, max)
and, for the schema request, its status and seconds.

    python -m benchmarks.grammar_stall [--properties 3000] [--streams 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from measure.results import (
    RESULTS_DIR,
    command_line,
    machine_facts,
    percentiles,
    print_table,
    save_figure,
    write_results,
)
from measure.servers import local_server

MODEL = "SmolLM2-135M-Instruct"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]


async def stream_gaps(client: httpx.AsyncClient, prompt: str, tokens: int, started: asyncio.Event) -> list[float]:
    """Seconds between a stream's chunks."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True}
    times = []
    async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                times.append(time.perf_counter())
                started.set()
    return [b - a for a, b in pairwise(times)]


async def schema_request(client: httpx.AsyncClient, properties: int, started: asyncio.Event) -> dict[str, Any]:
    await started.wait()
    await asyncio.sleep(0.2)  # every stream is decoding by now
    names = [f"field_{i}" for i in range(properties)]
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names}, "required": names}
    body = {"model": MODEL, "prompt": "{", "max_tokens": 8, "temperature": 0, "guided_json": schema}
    sent = time.perf_counter()
    response = await client.post("/v1/completions", json=body)
    return {"status": response.status_code, "seconds": time.perf_counter() - sent, "bytes": len(json.dumps(schema))}


async def phase(url: str, args: argparse.Namespace, with_schema: bool) -> dict[str, Any]:
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        streams = [stream_gaps(client, p, args.output_tokens, started) for p in PROMPTS[: args.streams]]
        extra = [schema_request(client, args.properties, started)] if with_schema else []
        results = await asyncio.gather(*streams, *extra)
    gaps = [gap for gaps in results[: args.streams] for gap in gaps]
    summary = percentiles(gaps)
    row: dict[str, Any] = {
        "phase": "schema" if with_schema else "plain",
        "gap_p50_s": summary["p50"],
        "gap_max_s": max(gaps),
    }
    if with_schema:
        row.update({f"schema_{k}": v for k, v in results[-1].items()})
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--properties", type=int, default=3000)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=64)
    parser.add_argument("--serve-args", default="--max-slots 8 --max-context 512")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args()
    with local_server(args.serve_args) as url:
        rows = [asyncio.run(phase(url, args, with_schema=True)), asyncio.run(phase(url, args, with_schema=False))]
    payload = {"command": command_line(), "machine": machine_facts(), "workload": vars(args) | {"out": None}}
    csv_path, json_path, png_path = write_results(args.out, "grammar_stall", rows, {**payload, "rows": rows})
    print_table(
        rows,
        [("phase", "phase", 8, ""), ("gap p50 s", "gap_p50_s", 10, ".3f"), ("gap max s", "gap_max_s", 10, ".3f")],
        f"{args.streams} streams; a {args.properties}-property JSON schema request arrives mid-way",
    )
    schema = rows[0]
    print(f"schema request: HTTP {schema['schema_status']} in {schema['schema_seconds']:.2f} s")
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.bar([r["phase"] for r in rows], [r["gap_max_s"] for r in rows], color="tab:red", label="max gap")
    ax.bar([r["phase"] for r in rows], [r["gap_p50_s"] for r in rows], color="tab:blue", label="p50 gap")
    ax.set_ylabel("seconds between a stream's chunks")
    ax.legend()
    save_figure(fig, png_path, f"Streams while a {args.properties}-property schema request arrives")
    print(f"wrote {csv_path}, {json_path}, {png_path}")


if __name__ == "__main__":
    main()
