"""Several models in one server, their KV caches on one budget: the default model beside
`synthetic:tiny`, a random-weight model built on the spot. Two real models would double the
suite's load time for nothing more: what must differ is the cache's shape (30 layers of 3 KV
heads against 4 layers of 2), and the engines, tokenizers and routes, which they do."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import openai
import pytest

from serving import LLM, SamplingParams
from serving.engine import LLMEngine
from tests.live_server import MODEL, LiveServer, live_server, metric_values, openai_client
from vattn import PageBudget
from vattn.sizes import MiB

TINY = "tiny"
BUDGET = 16 * MiB
"""The default model's 256 tokens need 15 MiB of it (64 KiB pages, 60 K and V buffers of 85
tokens each), a tiny model's request of 200 tokens 1 MiB."""


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    tiny_options = {"max_slots": 12, "max_context": 512}  # its own, where the default model's are 8 and 256
    with live_server(
        more_models=(("synthetic:tiny", TINY),),
        model_options=((TINY, tiny_options),),
        kv_budget=BUDGET,
        enable_sleep_mode=True,
    ) as running:
        yield running


def cache_pages(server: LiveServer, name: str) -> tuple[int, PageBudget]:
    """(pages the model's cache has created, the budget it draws on), read on its engine thread."""

    def read(engine: LLMEngine) -> tuple[int, PageBudget]:
        cache = engine.kv.cache
        cache.wait_for_background()
        budget = cache._pool.budget
        assert budget is not None
        return cache.stats().pages_created, budget

    return server.app.state.engines[name].call(read).result(60)


def test_the_model_field_picks_the_engine_and_models_lists_both(server: LiveServer) -> None:
    client = openai_client(server)
    assert [card.id for card in client.models.list().data] == [MODEL, TINY]
    for name in (MODEL, TINY):
        answer = client.completions.create(model=name, prompt="The lighthouse", max_tokens=8, temperature=0)
        assert answer.model == name and answer.usage.completion_tokens == 8
    with pytest.raises(openai.NotFoundError, match=r"the model 'gpt-4' does not exist; this server serves"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


def test_each_model_runs_with_its_own_options(server: LiveServer) -> None:
    engines = server.app.state.engines
    assert (engines[MODEL].config.max_slots, engines[TINY].config.max_slots) == (8, 12)
    assert {card.id: card.max_model_len for card in openai_client(server).models.list().data} == {MODEL: 256, TINY: 512}
    long = openai_client(server).completions.create(model=TINY, prompt="word " * 100, max_tokens=4, temperature=0)
    assert long.usage.prompt_tokens > 256 and long.usage.completion_tokens == 4  # past the default model's context
    with pytest.raises(openai.BadRequestError):
        openai_client(server).completions.create(model=MODEL, prompt="word " * 300, max_tokens=4)


def test_one_budget_bounds_both_and_a_busy_model_takes_an_idle_ones_pages(server: LiveServer) -> None:
    client = openai_client(server)
    client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=4, temperature=0)  # 11.25 MiB
    default_pages, budget = cache_pages(server, MODEL)
    tiny_budget = cache_pages(server, TINY)[1]
    assert tiny_budget is budget and budget.limit == BUDGET and budget.used <= BUDGET
    assert default_pages > 0  # kept mapped while the model idles (deferred reclamation)
    batch = client.completions.create(model=TINY, prompt=["word " * 60] * 8, max_tokens=16, temperature=0)  # 8 MiB
    assert len(batch.choices) == 8  # the tiny model's burst takes what the idle one held
    default_after, _ = cache_pages(server, MODEL)
    assert default_after < default_pages and budget.used <= BUDGET, (default_pages, default_after)


def test_a_sleeping_model_gives_its_pages_back_while_the_other_serves(server: LiveServer) -> None:
    client = openai_client(server)
    client.completions.create(model=MODEL, prompt="word " * 200, max_tokens=4, temperature=0)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        slept = http.post("/sleep", params={"level": 1, "model": MODEL})
        assert slept.status_code == 200, slept.text
        assert cache_pages(server, MODEL)[0] == 0
        assert http.get("/is_sleeping", params={"model": MODEL}).json() == {"is_sleeping": True}
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}  # not every model sleeps
        assert http.get("/health").status_code == 200  # the tiny model still serves
        asleep = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert asleep.status_code == 503 and "Retry-After" in asleep.headers
        assert client.completions.create(model=TINY, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        assert http.post("/sleep", params={"level": 1, "model": "gpt-4"}).status_code == 404
        assert http.post("/wake_up", params={"model": MODEL}).status_code == 200
        assert http.post("/wake_up", params={"model": MODEL}).status_code == 400  # awake already
    assert client.completions.create(model=MODEL, prompt="hi", max_tokens=2).usage.completion_tokens == 2


def test_llms_share_a_page_budget_through_the_python_api() -> None:
    budget = PageBudget(8 * MiB)
    sizes = {"max_slots": 4, "max_context": 256, "kv_budget": 8 * MiB, "page_budget": budget}
    first, second = LLM("synthetic:tiny", dtype="float32", **sizes), LLM("synthetic:tiny", dtype="float32", **sizes)
    try:
        greedy = SamplingParams(max_tokens=8, temperature=0)
        outputs = [llm.generate(["a b c d"] * 4, greedy, use_tqdm=False) for llm in (first, second)]
        assert [o.text for o in outputs[0]] == [o.text for o in outputs[1]]
        assert first.engine.kv.cache._pool.budget is budget and budget.used <= budget.limit
    finally:
        first.close()
        second.close()
    assert budget.used == 0


def test_metrics_carry_each_models_name(server: LiveServer) -> None:
    before = {name: metric_values(server.url, name) for name in (MODEL, TINY)}
    openai_client(server).completions.create(model=TINY, prompt="The lighthouse", max_tokens=5, temperature=0)
    after = {name: metric_values(server.url, name) for name in (MODEL, TINY)}

    def grew(name: str, metric: str) -> float:
        return after[name].get(metric, 0.0) - before[name].get(metric, 0.0)

    for metric in ("vllm:generation_tokens_total", "vattn:generation_tokens_total"):
        assert grew(TINY, metric) == 5 and grew(MODEL, metric) == 0, metric
    assert grew(TINY, 'vllm:request_success_total{finished_reason="length"}') == 1
    assert grew(MODEL, "vattn:engine_iterations_total") == 0 < grew(TINY, "vattn:engine_iterations_total")
    for name in (MODEL, TINY):  # each engine's own snapshot, not the last one to update
        assert after[name]["vattn:kv_pool_pages"] > 0 and after[name]["vllm:num_requests_running"] == 0
    assert after[MODEL]["vattn:kv_mapped_bytes"] != after[TINY]["vattn:kv_mapped_bytes"]
