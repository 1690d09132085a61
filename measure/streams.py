"""Streamed completions timed chunk by chunk, and the latency figures serving users compare
(TTFT, TPOT, ITL): what every serving benchmark measures a request with.

The client reads the server-sent events itself, one `json.loads` a chunk, as vLLM's and
SGLang's serving benchmarks do. The openai SDK builds a pydantic model per chunk and sets up
each request: on 2 cores, which the server under test shares, that was 0.67 ms of client CPU a
token against 0.44, and at one request in flight vattn's bf16 server gave 88.6 tok/s to it and
104.2 to this client (four alternating rounds of 10 requests, TPOT 9.84 against 9.45 ms): a cost
that falls on whichever server is faster.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx

from measure.results import percentiles


@dataclass
class Timing:
    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0


def http_client(api_key: str | None = None, timeout: float = 3600) -> httpx.AsyncClient:
    """A client for `one_request`: a fresh connection per request (llama-server closes one after a
    streamed response, and a request sent on it meanwhile fails), bearer auth if a key is given."""
    return httpx.AsyncClient(
        timeout=timeout,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=0),
    )


async def one_request(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompt: str,
    output_tokens: int,
    extra_body: dict[str, Any] | None = None,
) -> Timing:
    """One streamed completion from the server at `url` (POST /v1/completions), timed per chunk;
    `extra_body` defaults to {"ignore_eos": True}. A response other than 200 raises
    httpx.HTTPStatusError; the completion's tokens are its usage's."""
    timing = Timing(time.perf_counter())
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **({"ignore_eos": True} if extra_body is None else extra_body),
    }
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            response.raise_for_status()
        async for line in response.aiter_lines():
            data = line.removeprefix("data:").strip()
            if data == line or data == "[DONE]":  # not a data line (blank, comment), or the end
                continue
            chunk = json.loads(data)
            choices = chunk.get("choices")
            if choices and choices[0].get("text"):
                timing.chunks.append(time.perf_counter())
            if chunk.get("usage"):
                timing.tokens = chunk["usage"]["completion_tokens"]
    return timing


def summarize(timings: Sequence[Timing], elapsed: float) -> dict[str, Any]:
    """Throughput over `elapsed` seconds and TTFT, TPOT and ITL p50/p99 of the timed requests."""
    ttft = percentiles([t.chunks[0] - t.sent for t in timings])
    tpot = percentiles([(t.chunks[-1] - t.chunks[0]) / (t.tokens - 1) for t in timings])
    itl = percentiles([later - earlier for t in timings for earlier, later in pairwise(t.chunks)])
    return {
        "requests": len(timings),
        "seconds": round(elapsed, 2),
        "requests_per_s": round(len(timings) / elapsed, 3),
        "output_tokens_per_s": round(sum(t.tokens for t in timings) / elapsed, 2),
        "ttft_p50_s": round(ttft["p50"], 3),
        "ttft_p99_s": round(ttft["p99"], 3),
        "tpot_p50_ms": round(tpot["p50"] * 1e3, 1),
        "tpot_p99_ms": round(tpot["p99"] * 1e3, 1),
        "itl_p50_ms": round(itl["p50"] * 1e3, 1),
        "itl_p99_ms": round(itl["p99"] * 1e3, 1),
    }
