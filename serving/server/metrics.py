"""Prometheus metrics of the server: requests, tokens, latencies, and the allocator's own figures,
each sample labelled with its model's served name (`model_name`, as vLLM labels its own).

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
MODEL_LABEL = "model_name"
"""The label every sample carries: the served model's name, as vLLM's own metrics carry it."""


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to `limit`: vLLM's buckets for token counts of a request."""
    return [value for exponent in range(len(str(limit))) for m in (1, 2, 5) if (value := m * 10**exponent) <= limit]


class Twins:
    """One measurement under vattn's name and vLLM's (`vattn:x` and `vllm:x`), so that dashboards
    made for vLLM work unchanged; labelled by `model_name`, as vLLM labels its own."""

    def __init__(
        self, kind: type[Counter] | type[Histogram], name: str, doc: str, labels: Sequence[str] = (), **options: Any
    ) -> None:
        self.metrics = [
            kind(f"{prefix}:{name}", doc, labelnames=[MODEL_LABEL, *labels], **options) for prefix in ("vattn", "vllm")
        ]

    def inc(self, amount: float = 1, **labels: str) -> None:
        for metric in self.metrics:
            metric.labels(**labels).inc(amount)  # type: ignore[union-attr]

    def observe(self, value: float, **labels: str) -> None:
        for metric in self.metrics:
            metric.labels(**labels).observe(value)  # type: ignore[union-attr]


class ServerMetrics(Collector):
    """The server's registry: each served model records into it through its `ModelMetrics`."""

    def __init__(self, max_model_len: int) -> None:
        self.registry = registry = CollectorRegistry()
        self.models: dict[str, ModelMetrics] = {}

        def histogram(name: str, doc: str, buckets: Sequence[float] = LATENCY_BUCKETS) -> Twins:
            return Twins(Histogram, name, doc, buckets=buckets, registry=registry)

        self.prompt_tokens = Twins(Counter, "prompt_tokens", "Prompt tokens accepted.", registry=registry)
        self.generation_tokens = Twins(Counter, "generation_tokens", "Tokens generated.", registry=registry)
        self.finished = Twins(
            Counter, "request_success", "Requests ended, by reason.", labels=["finished_reason"], registry=registry
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
        self.registry.register(self)

    def model(self, name: str) -> ModelMetrics:
        """What the engine serving `name` records through (its samples carry model_name=name)."""
        self.models[name] = ModelMetrics(self, name)
        return self.models[name]

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def load(self) -> int:
        """Requests running or queued at every model's last iteration (what routers' /get_load reads)."""
        return sum(model.load() for model in self.models.values())

    def describe(self) -> list[Metric]:
        return []  # values appear once a model has loaded

    def collect(self) -> Iterator[Metric]:
        """The engines' snapshot figures, one family per name, one sample per loaded model."""
        families: dict[str, Metric] = {}
        for name, model in self.models.items():
            if model.snapshot is not None:
                for metric, kind, doc, extra, value in snapshot_samples(model.snapshot):
                    family = families.get(metric)
                    if family is None:
                        family = families[metric] = kind(metric, doc, labels=[MODEL_LABEL, *extra])
                    family.add_metric([name, *extra.values()], value)  # type: ignore[attr-defined]
        yield from families.values()


class ModelMetrics:
    """One served model's view of the server's metrics: what its engine thread records."""

    def __init__(self, server: ServerMetrics, name: str) -> None:
        self.server = server
        self.label = {MODEL_LABEL: name}
        self.snapshot: EngineStats | None = None

    def update(self, stats: EngineStats) -> None:
        if self.snapshot is not None and stats.iterations > self.snapshot.iterations:
            self.server.iteration_tokens.observe(stats.last_iteration_tokens, **self.label)
        self.snapshot = stats

    def load(self) -> int:
        snap = self.snapshot
        return 0 if snap is None else snap.running + snap.waiting

    def observe_request(self, n: int, max_tokens: int) -> None:
        """A prompt's request was accepted, with `n` choices of at most `max_tokens` tokens."""
        self.server.params_n.observe(n, **self.label)
        self.server.params_max_tokens.observe(max_tokens, **self.label)

    def observe_prompts(self, tokens: int) -> None:
        self.server.prompt_tokens.inc(tokens, **self.label)

    def observe_tokens(self, arrival: float, last_token: float | None, now: float, count: int) -> None:
        """`count` tokens of one request came out at `now`."""
        self.server.generation_tokens.inc(count, **self.label)
        if last_token is None:
            self.server.ttft.observe(now - arrival, **self.label)
        else:
            self.server.inter_token.observe((now - last_token) / count, **self.label)

    def observe_finish(self, arrival: float, now: float, reason: str | None, output: RequestOutput | None) -> None:
        """A request ended; `output` (None when aborted) has its phases."""
        server, label = self.server, self.label
        server.e2e.observe(now - arrival, **label)
        server.finished.inc(finished_reason=reason or "unknown", **label)
        if output is None:
            return
        server.request_prompt_tokens.observe(len(output.prompt_token_ids), **label)
        server.request_generation_tokens.observe(len(output.token_ids), **label)
        if output.queue_time is not None and output.latency is not None:
            server.inference_time.observe(output.latency - output.queue_time, **label)
        if output.queue_time is not None and output.ttft is not None:
            server.queue_time.observe(output.queue_time, **label)
            server.prefill_time.observe(output.ttft - output.queue_time, **label)
            if output.latency is not None:
                server.decode_time.observe(output.latency - output.ttft, **label)


Sample = tuple[str, type[GaugeMetricFamily] | type[CounterMetricFamily], str, dict[str, str], float]
"""A family's name, kind and help, the sample's labels beyond model_name, and its value."""


def snapshot_samples(snap: EngineStats) -> Iterator[Sample]:
    """An engine snapshot's gauges and counters (vLLM's under both names, vattn's own once)."""
    gauge, counter = GaugeMetricFamily, CounterMetricFamily
    cache, counters = snap.kv, snap.kv.counters

    def twins(
        kind: type[GaugeMetricFamily] | type[CounterMetricFamily], name: str, doc: str, value: float
    ) -> Iterator[Sample]:
        for prefix in ("vattn", "vllm"):
            yield f"{prefix}:{name}", kind, doc, {}, value

    yield from twins(gauge, "num_requests_running", "Requests holding a KV slot.", snap.running)
    yield from twins(gauge, "num_requests_waiting", "Requests queued for a KV slot.", snap.waiting)
    usage = cache.active_bytes / (cache.pool_pages * cache.page_size)
    yield from twins(gauge, "kv_cache_usage_perc", "Active KV bytes over the KV budget.", usage)
    yield from twins(counter, "num_preemptions", "Requests preempted (recomputed later).", snap.preemptions)
    yield from twins(
        counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", cache.prefix.queries
    )
    yield from twins(counter, "prefix_cache_hits", "Prompt tokens found there (not computed).", cache.prefix.hits)
    own: list[tuple[type[GaugeMetricFamily] | type[CounterMetricFamily], str, str, float]] = [
        (counter, "engine_iterations", "Batched model iterations run.", snap.iterations),
        (gauge, "kv_mapped_bytes", "Physical bytes mapped behind KV slots.", cache.mapped_bytes),
        (gauge, "kv_active_bytes", "Mapped bytes of running requests.", cache.active_bytes),
        (gauge, "kv_idle_bytes", "Mapped bytes kept by free slots (deferred reclamation).", cache.idle_bytes),
        (gauge, "kv_waste_bytes", "Mapped bytes that hold no token.", cache.waste_bytes),
        (gauge, "kv_free_pages", "Physical pages in the pool, unmapped.", cache.free_bytes // cache.page_size),
        (gauge, "kv_pool_pages", "Physical pages the KV budget allows.", cache.pool_pages),
        (gauge, "kv_active_slots", "KV slots in use.", cache.active_slots),
        (gauge, "kv_cached_bytes", "Bytes held only by the prefix cache.", cache.cached_bytes),
        (counter, "kv_map_calls", "Batched map calls to the VMM backend.", counters.map.calls),
        (counter, "kv_pages_mapped", "Pages mapped.", counters.map.pages),
        (counter, "kv_pages_unmapped", "Pages unmapped.", counters.unmap.pages),
        (counter, "kv_map_seconds", "Time spent mapping.", counters.map.seconds),
        (counter, "kv_background_errors", "Background mapper failures.", cache.background_errors),
    ]
    for kind, name, doc, value in own:
        yield f"vattn:{name}", kind, doc, {}, value
    needs = "Pages a step needed, by who had mapped them."
    yield "vattn:kv_page_needs", counter, needs, {"met_by": "background"}, counters.needs_met_by_background
    yield "vattn:kv_page_needs", counter, needs, {"met_by": "reuse"}, counters.needs_met_by_reuse
    yield "vattn:kv_page_needs", counter, needs, {"met_by": "step"}, counters.needs_mapped_in_step
    taken = "Physical pages taken from the pool."
    yield "vattn:kv_pages_taken", counter, taken, {"kind": "fresh"}, cache.fresh_pages_taken
    yield "vattn:kv_pages_taken", counter, taken, {"kind": "recycled"}, cache.recycled_pages_taken
