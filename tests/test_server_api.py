"""The OpenAI API as the real `openai` client sees it, against a live uvicorn server."""

from __future__ import annotations

from collections.abc import Iterator
from importlib.metadata import version as package_version

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from serving.default_model import default_model_dir
from tests.live_server import MODEL, LiveServer, live_server, metric_values, openai_client

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server() as running:
        yield running


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai_client(server)


def test_models_health_and_the_probes_routers_use(server: LiveServer, client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    [card] = httpx.get(f"{server.url}/v1/models").json()["data"]
    assert card["max_model_len"] == server.engine.max_context and card["root"].endswith("SmolLM2-135M-Instruct")
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/version").json()["version"] == package_version("vattn")
    load = httpx.get(f"{server.url}/get_load").json()  # vllm-router's power_of_two polls it
    assert load == {"load": 0, "is_sleeping": False}


def test_completion_is_greedy_and_counts_tokens(client: openai.OpenAI) -> None:
    first = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    choice = first.choices[0]
    assert choice.text.startswith(" Paris") and choice.text == again.choices[0].text
    assert choice.finish_reason == "length"
    assert first.usage is not None and first.usage.completion_tokens == 8 and first.usage.prompt_tokens == 5
    assert first.object == "text_completion" and first.id.startswith("cmpl-")


def test_token_id_prompts_and_several_prompts(client: openai.OpenAI) -> None:
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir())
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    as_text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    as_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=4, temperature=0)
    assert as_ids.usage.prompt_tokens == len(ids) == as_text.usage.prompt_tokens
    assert as_ids.choices[0].text == as_text.choices[0].text and as_ids.choices[0].text.startswith(" Paris")
    counting = tokenizer("1, 2, 3, 4,", add_special_tokens=False)["input_ids"]
    several_ids = client.completions.create(model=MODEL, prompt=[ids, counting], max_tokens=4, temperature=0)
    assert [c.text for c in several_ids.choices] == [as_text.choices[0].text, " 5, "]
    both = client.completions.create(model=MODEL, prompt=[PROMPT, "1, 2, 3, 4,"], max_tokens=4, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert both.choices[0].text == both.choices[1].text == as_text.choices[0].text
    assert [c.text for c in both.choices[2:]] == [" 5, "] * 2


def test_chat_answers_through_the_template(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].message.role == "assistant" and reply.object == "chat.completion"
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_streams_join_to_the_whole_text(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0, stream=True))
    assert chat[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chat)
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=24, temperature=0)
    assert streamed == reply.choices[0].message.content


def test_raw_stream_ends_with_done(server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]" and all(e.startswith("data: ") for e in events)


def test_stop_strings_cut_the_text(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0).choices[0].text
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=["."])
    assert stopped.choices[0].text == plain.split(".")[0] and stopped.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=".", stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == stopped.choices[0].text


def test_seeds_reproduce_and_differ(client: openai.OpenAI) -> None:
    def sample(seed: int) -> str:
        reply = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=16, seed=seed)
        return reply.choices[0].text

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    chat = [
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, seed=3, temperature=1.2)
        .choices[0]
        .message.content
        for _ in range(2)
    ]
    assert chat[0] == chat[1]


def test_chat_logprobs(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == 4
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert "".join(entry.token for entry in content) == reply.choices[0].message.content


def test_metrics_show_requests_tokens_and_the_allocator(server: LiveServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    text = httpx.get(f"{server.url}/metrics").text
    assert f'vllm:num_requests_running{{model_name="{MODEL}"}}' in text  # labelled as vLLM labels its own
    for name in (
        "vattn:num_requests_running",
        "vattn:num_requests_waiting",
        "vattn:kv_cache_usage_perc",
        "vattn:prompt_tokens_total",
        "vattn:generation_tokens_total",
        "vattn:time_to_first_token_seconds_bucket",
        "vattn:inter_token_latency_seconds_bucket",
        "vattn:e2e_request_latency_seconds_count",
        "vattn:num_preemptions_total",
        "vattn:kv_mapped_bytes",
        "vattn:kv_free_pages",
        "vattn:kv_waste_bytes",
        'vattn:kv_page_needs_total{met_by="background"}',
        'vattn:kv_page_needs_total{met_by="step"}',
        'vattn:kv_pages_taken_total{kind="fresh"}',
        "vattn:engine_iterations_total",
    ):
        assert name.split("{")[0] in text, name
    values = metric_values(server.url)
    assert values["vattn:generation_tokens_total"] >= 4 and values["vattn:kv_mapped_bytes"] > 0
    # the pool's pages were made at start (kv_preallocate): requests take them recycled, none fresh
    taken = {kind: values[f'vattn:kv_pages_taken_total{{kind="{kind}"}}'] for kind in ("fresh", "recycled")}
    assert values["vattn:engine_iterations_total"] >= 4 and taken["fresh"] == 0 and taken["recycled"] > 0
    # vLLM's names for the same figures, for dashboards made for vLLM
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "num_preemptions_total",
        "time_to_first_token_seconds_count",
        "e2e_request_latency_seconds_count",
        "request_queue_time_seconds_count",
        "request_prefill_time_seconds_count",
        "request_decode_time_seconds_count",
        "prefix_cache_queries_total",
        'request_success_total{finished_reason="length"}',
    ):
        assert values[f"vllm:{name}"] == values[f"vattn:{name}"], name
    assert values["vllm:request_decode_time_seconds_count"] >= 1
    # vLLM's per-request histograms, with its buckets (1-2-5 up to the max model length for token counts)
    for name, buckets in (
        ("request_prompt_tokens", [1, 2, 5, 10, 20, 50, 100, 200]),
        ("request_generation_tokens", [1, 2, 5, 10, 20, 50, 100, 200]),
        ("request_params_max_tokens", [1, 2, 5, 10, 20, 50, 100, 200]),
        ("request_params_n", [1, 2, 5, 10, 20]),
        ("iteration_tokens_total", [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
        ("request_inference_time_seconds", [0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 50, 60]),
    ):
        for bound in buckets:
            assert f'vllm:{name}_bucket{{le="{float(bound)}"}}' in values, (name, bound)
        assert values[f"vllm:{name}_count"] >= 1 and values[f"vllm:{name}_count"] == values[f"vattn:{name}_count"]
    assert values['vllm:request_generation_tokens_bucket{le="5.0"}'] >= 1  # the 4-token completion
    assert values['vllm:request_params_max_tokens_bucket{le="2.0"}'] < values["vllm:request_params_max_tokens_count"]


def test_api_key_is_required_when_set() -> None:
    with live_server(api_key="s3cret") as server:
        assert httpx.get(f"{server.url}/v1/models").status_code == 401
        wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "invalid_api_key"
        assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics stay open
        client = openai_client(server, api_key="s3cret")
        assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2


def test_not_ready_is_503() -> None:
    with live_server(wait_ready=False, kv_budget=1 << 20) as server:  # too small: the engine refuses to start
        server.engine.wait_ready(120)
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and "failed to load" in health.json()["error"]["message"]
        body = {"model": MODEL, "prompt": PROMPT}
        assert httpx.post(f"{server.url}/v1/completions", json=body).status_code == 503


@pytest.mark.parametrize("caching", [True, False])
def test_a_repeated_prompt_prefix_is_reported_cached(caching: bool) -> None:
    """16 KiB pages make a prefix-cache unit 64 tokens: a ~155-token prompt sent twice has its
    first two units mapped the second time and the rest but its last token copied from the
    first's cached tail, as usage and the metrics say (and none without)."""
    prompt = "The lighthouse keeper climbed the stairs and lit the lamp. " * 14
    with live_server(page_size=16 << 10, prefix_caching=caching) as running:
        client = openai_client(running)
        first, second = (
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0) for _ in range(2)
        )
        assert first.usage is not None and second.usage is not None
        assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        hit = first.usage.prompt_tokens - 1 if caching else 0
        assert second.usage.prompt_tokens_details.cached_tokens == hit
        assert second.choices[0].text == first.choices[0].text
        values = metric_values(running.url)
        assert values["vattn:prefix_cache_hits_total"] == hit
        assert values["vattn:prefix_cache_queries_total"] == (2 * first.usage.prompt_tokens if caching else 0)

        def cached(salt: str) -> int:
            reply = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
            )
            assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
            return reply.usage.prompt_tokens_details.cached_tokens or 0

        # vLLM's cache_salt: another tenant's prompt is never a hit, its own is
        assert [cached("tenant-b"), cached("tenant-b"), cached("tenant-c")] == [0, hit, 0]
