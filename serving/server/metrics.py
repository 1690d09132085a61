"""Prometheus metrics of the server: requests, tokens, latencies, and the allocator's own figures.

Latencies and token totals are recorded by the engine thread as deltas go out. Gauges and
the allocator's counters come from a snapshot the engine thread takes after each
iteration, so a scrape never reaches into the engine while it runs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from serving.engine import EngineStats
from serving.outputs import RequestOutput

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60, 120, 240, 480, 960, 1920, 7680)
"""vLLM's buckets for a request's phases (request_inference_time_seconds)."""
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
"""vLLM's buckets for iteration_tokens_total."""
N_BUCKETS = (1, 2, 5, 10, 20)
"""vLLM's buckets for request_params_n."""


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts of a request."""
    return [value for exponent in range(len(str(limit))) for m in (1, 2, 5) if (value := m * 10**exponent) <= limit]


class Twins:
    """One measurement under vattn's name and vLLM's (`vattn:x` and `vllm:x`), so that dashboards
    made for vLLM work unchanged."""

    def __init__(self, kind: type[Counter] | type[Histogram], name: str, doc: str, **options: Any) -> None:
        self.metrics = [kind(f"{prefix}:{name}", doc, **options) for prefix in ("vattn", "vllm")]

    def inc(self, amount: float = 1, **labels: str) -> None:
        for metric in self.metrics:
            (metric.labels(**labels) if labels else metric).inc(amount)  # type: ignore[union-attr]

    def observe(self, value: float) -> None:
        for metric in self.metrics:
            metric.observe(value)  # type: ignore[union-attr]


class ServerMetrics(Collector):
    def __init__(self, max_model_len: int) -> None:
        self.registry = registry = CollectorRegistry()

        def histogram(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Twins:
            return Twins(Histogram, name, doc, buckets=buckets, registry=registry)

        self.prompt_tokens = Twins(Counter, "prompt_tokens", "Prompt tokens accepted.", registry=registry)
        self.generation_tokens = Twins(Counter, "generation_tokens", "Tokens generated.", registry=registry)
        self.finished = Twins(
            Counter, "request_success", "Requests ended, by reason.", labelnames=["finished_reason"], registry=registry
        )
        self.ttft = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.inter_token = histogram("inter_token_latency_seconds", "Time between a request's successive tokens.")
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to the first KV slot.")
        self.prefill_time = histogram("request_prefill_time_seconds", "First KV slot to the first token.")
        self.decode_time = histogram("request_decode_time_seconds", "First token to the last.")
        self.inference_time = histogram(
            "request_inference_time_seconds", "First KV slot to the last token.", REQUEST_LATENCY_BUCKETS
        )
        tokens = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram("request_prompt_tokens", "Prompt tokens of each request.", tokens)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens each finished request generated.", tokens
        )
        self.params_n = histogram("request_params_n", "The n of each prompt's request.", N_BUCKETS)
        self.params_max_tokens = histogram("request_params_max_tokens", "Each request's max_tokens.", tokens)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens computed by each engine iteration.", ITERATION_TOKEN_BUCKETS
        )
        self._snapshot: EngineStats | None = None
        self.registry.register(self)

    # ------------------------------------------------------------- engine thread

    def update(self, stats: EngineStats) -> None:
        if self._snapshot is not None and stats.iterations > self._snapshot.iterations:
            self.iteration_tokens.observe(stats.last_iteration_tokens)
        self._snapshot = stats

    def observe_request(self, n: int, max_tokens: int) -> None:
        """A prompt's request was accepted, with `n` choices of at most `max_tokens` tokens."""
        self.params_n.observe(n)
        self.params_max_tokens.observe(max_tokens)

    def observe_prompts(self, tokens: int) -> None:
        self.prompt_tokens.inc(tokens)

    def observe_tokens(self, arrival: float, last_token: float | None, now: float, count: int) -> None:
        """`count` tokens of one request came out at `now`."""
        self.generation_tokens.inc(count)
        if last_token is None:
            self.ttft.observe(now - arrival)
        else:
            self.inter_token.observe((now - last_token) / count)

    def observe_finish(self, arrival: float, now: float, reason: str | None, output: RequestOutput | None) -> None:
        """A request ended; `output` (None when aborted) has its phases."""
        self.e2e.observe(now - arrival)
        self.finished.inc(finished_reason=reason or "unknown")
        if output is None:
            return
        self.request_prompt_tokens.observe(len(output.prompt_token_ids))
        self.request_generation_tokens.observe(len(output.token_ids))
        if output.queue_time is not None and output.latency is not None:
            self.inference_time.observe(output.latency - output.queue_time)
        if output.queue_time is not None and output.ttft is not None:
            self.queue_time.observe(output.queue_time)
            self.prefill_time.observe(output.ttft - output.queue_time)
            if output.latency is not None:
                self.decode_time.observe(output.latency - output.ttft)

    # ------------------------------------------------------------- scrape side

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def load(self) -> int:
        """Requests running or queued at the last iteration (what routers' /get_load reads)."""
        snap = self._snapshot
        return 0 if snap is None else snap.running + snap.waiting

    def describe(self) -> list[Metric]:
        return []  # values appear once the model has loaded

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot
        if snap is None:
            return
        cache, counters = snap.kv, snap.kv.counters

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            return GaugeMetricFamily(f"vattn:{name}", doc, value=value)

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            return CounterMetricFamily(f"vattn:{name}", doc, value=value)

        def twins(gauge: bool, name: str, doc: str, value: float) -> Iterator[Metric]:
            kind = GaugeMetricFamily if gauge else CounterMetricFamily
            for prefix in ("vattn", "vllm"):
                yield kind(f"{prefix}:{name}", doc, value=value)

        yield from twins(True, "num_requests_running", "Requests holding a KV slot.", snap.running)
        yield from twins(True, "num_requests_waiting", "Requests queued for a KV slot.", snap.waiting)
        usage = cache.active_bytes / (cache.pool_pages * cache.page_size)
        yield from twins(True, "kv_cache_usage_perc", "Active KV bytes over the KV budget.", usage)
        yield from twins(False, "num_preemptions", "Requests preempted (recomputed later).", snap.preemptions)
        yield counter("engine_iterations", "Batched model iterations run.", snap.iterations)
        yield gauge("kv_mapped_bytes", "Physical bytes mapped behind KV slots.", cache.mapped_bytes)
        yield gauge("kv_active_bytes", "Mapped bytes of running requests.", cache.active_bytes)
        yield gauge("kv_idle_bytes", "Mapped bytes kept by free slots (deferred reclamation).", cache.idle_bytes)
        yield gauge("kv_waste_bytes", "Mapped bytes that hold no token.", cache.waste_bytes)
        yield gauge("kv_free_pages", "Physical pages in the pool, unmapped.", cache.free_bytes // cache.page_size)
        yield gauge("kv_pool_pages", "Physical pages the KV budget allows.", cache.pool_pages)
        yield gauge("kv_active_slots", "KV slots in use.", cache.active_slots)
        yield gauge("kv_cached_bytes", "Bytes held only by the prefix cache.", cache.cached_bytes)
        queries, hits = cache.prefix.queries, cache.prefix.hits
        yield from twins(False, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", queries)
        yield from twins(False, "prefix_cache_hits", "Prompt tokens found there (not computed).", hits)
        needs = CounterMetricFamily(
            "vattn:kv_page_needs", "Pages a step needed, by who had mapped them.", labels=["met_by"]
        )
        needs.add_metric(["background"], counters.needs_met_by_background)
        needs.add_metric(["reuse"], counters.needs_met_by_reuse)
        needs.add_metric(["step"], counters.needs_mapped_in_step)
        yield needs
        taken = CounterMetricFamily("vattn:kv_pages_taken", "Physical pages taken from the pool.", labels=["kind"])
        taken.add_metric(["fresh"], cache.fresh_pages_taken)
        taken.add_metric(["recycled"], cache.recycled_pages_taken)
        yield taken
        yield counter("kv_map_calls", "Batched map calls to the VMM backend.", counters.map.calls)
        yield counter("kv_pages_mapped", "Pages mapped.", counters.map.pages)
        yield counter("kv_pages_unmapped", "Pages unmapped.", counters.unmap.pages)
        yield counter("kv_map_seconds", "Time spent mapping.", counters.map.seconds)
        yield counter("kv_background_errors", "Background mapper failures.", cache.background_errors)
