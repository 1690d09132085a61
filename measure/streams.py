"""Streamed completions timed chunk by chunk, and the latency figures serving users compare
(TTFT, TPOT, ITL): what every serving benchmark measures a request with."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import openai

from measure.results import percentiles


@dataclass
class Timing:
    sent: float
    chunks: list[float] = field(default_factory=list)
    tokens: int = 0


async def one_request(
    client: openai.AsyncOpenAI,
    model: str,
    prompt: str,
    output_tokens: int,
    extra_body: dict[str, Any] | None = None,
) -> Timing:
    """One streamed completion, timed per chunk; `extra_body` defaults to {"ignore_eos": True}."""
    timing = Timing(time.perf_counter())
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=output_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True} if extra_body is None else extra_body,
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            timing.chunks.append(time.perf_counter())
        if chunk.usage is not None:
            timing.tokens = chunk.usage.completion_tokens
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
