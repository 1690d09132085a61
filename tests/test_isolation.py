"""One request's contradictions or failures end it alone: every other request finishes exactly
as it would have on an unloaded server, and nothing leaks."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from serving import structured_output
from serving.structured_output import _compile as compile_grammar
from tests.live_server import MODEL, LiveServer, live_server

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village by the sea,"]
STREAM = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True}
HI, H, EOS = 6004, 88, 2
"""SmolLM2's tokens 'hi' and 'h', and its EOS (<|im_end|>)."""

POISON = [
    # (case, request fields, the HTTP status, words its error must contain)
    ("a choice its allowed ids cannot begin", {"guided_choice": ["hello"], "allowed_token_ids": [5]}, 400, "allowed"),
    ("a regex disjoint from its allowed ids", {"guided_regex": "[0-9]+", "allowed_token_ids": [HI]}, 400, "allowed"),
    ("only EOS allowed before min_tokens", {"allowed_token_ids": [EOS], "min_tokens": 3, "max_tokens": 4}, 400, "EOS"),
    (
        "only a stop token allowed before min_tokens",
        {"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2, "max_tokens": 4},
        400,
        "stop tokens",
    ),
    (
        # admitted ('hi' is allowed), then after 'hi' the grammar wants EOS or 'x', min_tokens bans EOS
        "a grammar that runs out of tokens mid-way",
        {"guided_regex": "hi(x)*", "allowed_token_ids": [HI, EOS], "min_tokens": 3, "max_tokens": 6},
        400,
        "no token satisfies",
    ),
    (
        "two choices, both running out of tokens",
        {"guided_regex": "hi(x)*", "allowed_token_ids": [HI, EOS], "min_tokens": 3, "max_tokens": 6, "n": 2},
        400,
        "no token satisfies",
    ),
    ("an echoed negative token id", {"prompt": [-1], "echo": True}, 400, "got -1"),
    ("an echoed token id past 64 bits", {"prompt": [2**70], "echo": True, "logprobs": 1}, 400, "token ids"),
    ("a logit_bias id past the vocabulary", {"logit_bias": {"49152": 5}}, 400, "49152 is not in the vocabulary"),
]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    with live_server(max_slots=12) as running:
        yield running


async def stream_text(client: httpx.AsyncClient, prompt: str, started: asyncio.Event) -> tuple[str, float]:
    """The stream's text, and when its last token came (the event loop's clock)."""
    text, last = "", 0.0
    async with client.stream("POST", "/v1/completions", json={**STREAM, "prompt": prompt}) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                last = asyncio.get_running_loop().time()
                started.set()
    return text, last


async def poison(client: httpx.AsyncClient, fields: dict[str, Any], stream: bool, started: asyncio.Event) -> Any:
    """Sent once the streams run; returns (status, error) of the answer or of the stream's error
    event, and when it ended (the event loop's clock)."""
    await started.wait()
    body = {"model": MODEL, "prompt": "Say hi", "max_tokens": 4, "temperature": 0, **fields, "stream": stream}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            error = json.loads(await response.aread())["error"]
            return response.status_code, error, asyncio.get_running_loop().time()
        events = [json.loads(line[6:]) async for line in response.aiter_lines() if line.startswith("data: {")]
    errors = [event["error"] for event in events if "error" in event]
    ended = asyncio.get_running_loop().time()
    return (errors[0]["code"], errors[0], ended) if errors else (200, None, ended)


async def serve(url: str, poisoned: bool) -> tuple[list[tuple[str, float]], list[Any]]:
    started = asyncio.Event()
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        streams = [stream_text(client, prompt, started) for prompt in PROMPTS]
        cases = [(fields, stream) for _, fields, *_ in POISON for stream in (False, True)] if poisoned else []
        results = await asyncio.gather(*streams, *(poison(client, f, stream, started) for f, stream in cases))
    return list(results[: len(PROMPTS)]), list(results[len(PROMPTS) :])


def test_poisoned_requests_end_alone_and_the_others_are_unchanged(server: LiveServer) -> None:
    unloaded, _ = asyncio.run(serve(server.url, poisoned=False))
    streams, answers = asyncio.run(serve(server.url, poisoned=True))
    assert [text for text, _ in streams] == [text for text, _ in unloaded]
    # the poisons were sent after the streams' first token and all ended before any stream's
    # last: they ran beside the streams (the grammar cases in the same iterations), not after
    assert max(ended for *_, ended in answers) < min(last for _, last in streams)
    expected = [(case, status, words) for case, _, status, words in POISON for _ in (False, True)]
    for (case, status, words), (got, error, _) in zip(expected, answers, strict=True):
        assert got == status and error is not None, (case, got, error)
        assert words in error["message"], (case, error)
    assert server.engine.num_pending == 0
    free_slots, free_pages, pool_pages = server.pages_back_in_pool()
    assert free_slots == server.settings.engine_config.max_slots and free_pages == pool_pages


def test_a_grammar_is_compiled_off_the_engine_thread(server: LiveServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large JSON schema compiles on the compiler threads (llguidance drops the GIL there),
    never on the engine thread, which finds it compiled at admission."""
    threads: list[str] = []

    def compile_and_record(*args: Any) -> Any:
        threads.append(threading.current_thread().name)
        return compile_grammar(*args)

    monkeypatch.setattr(structured_output, "_compile", compile_and_record)
    names = [f"field{i}" for i in range(500)]
    schema = {"type": "object", "properties": {name: {"type": "integer"} for name in names}, "required": names}
    body = {"model": MODEL, "prompt": "{", "max_tokens": 3, "temperature": 0, "guided_json": schema}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 200, response.text
    assert len(threads) == 1 and threads[0].startswith("vattn-grammar"), threads


def test_an_oversized_grammar_is_refused(server: LiveServer) -> None:
    regex = "(" + "|".join(f"word{i}" for i in range(30_000)) + ")"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "guided_regex": regex}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "guided_regex" and "over the limit" in error["message"]
