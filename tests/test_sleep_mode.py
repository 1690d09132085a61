"""vLLM's sleep mode on the virtual cache: the KV cache's pages (level 1) and the weights (level
2) go back to the system and come back on waking, through `LLM` and the HTTP server."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest

from serving import LLM, SamplingParams
from tests.live_server import MODEL, live_server, openai_client
from vattn.sizes import MiB

GREEDY = SamplingParams(max_tokens=12, temperature=0)
PROMPTS = ["The capital of France is", "def fib(n):"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    made = LLM(dtype="float32", enable_sleep_mode=True, max_slots=4, max_context=256, kv_budget=32 * MiB)
    yield made
    made.close()


def texts(llm: LLM) -> list[str]:
    return [output.text for output in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_level_1_gives_every_kv_page_back_and_waking_answers_as_before(llm: LLM) -> None:
    before = texts(llm)
    assert llm.engine.kv.stats().pages_created > 0
    llm.sleep(1)
    assert llm.is_sleeping() and llm.engine.kv.stats().pages_created == 0
    with pytest.raises(ValueError, match=r"the engine sleeps \(level 1\): wake it up first"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    llm.wake_up()
    assert not llm.is_sleeping() and texts(llm) == before


def test_level_2_drops_the_weights_until_they_are_woken(llm: LLM) -> None:
    before = texts(llm)
    llm.sleep(2)
    assert llm.engine.executor.runner is None
    llm.wake_up(["kv_cache"])  # the weights still sleep: so does the engine
    assert llm.is_sleeping() and llm.engine.executor.runner is None
    llm.wake_up(["weights"])
    assert not llm.is_sleeping() and texts(llm) == before


def test_bad_sleep_and_wake_calls_are_refused_and_change_nothing(llm: LLM) -> None:
    with pytest.raises(ValueError, match="the engine is awake"):
        llm.wake_up()
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="the sleep level must be 1"):
            llm.sleep(level)  # type: ignore[arg-type]
    llm.sleep(1)
    with pytest.raises(ValueError, match=r"already sleeps \(level 1\)"):
        llm.sleep(2)
    with pytest.raises(ValueError, match=r"unknown wake_up tags \['kv'\]"):
        llm.wake_up(["kv"])
    assert llm.is_sleeping()
    llm.wake_up()
    request = llm.engine.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="requests are running"):
        llm.sleep(1)
    llm.engine.abort(request)
    assert not llm.is_sleeping()


def test_sleep_mode_needs_asking_for_and_the_virtual_cache() -> None:
    with pytest.raises(ValueError, match="needs kv_cache 'virtual' and tensor_parallel_size 1"):
        LLM(enable_sleep_mode=True, kv_cache="paged")


def test_the_server_sleeps_refuses_with_503_and_wakes() -> None:
    """/sleep lets a stream in progress finish, then /health, /is_sleeping and /get_load say the
    engine sleeps and a request gets 503 with Retry-After, never a hang; bad calls get 400;
    after /wake_up the answers are those from before."""
    with live_server(enable_sleep_mode=True) as server:
        client, http = openai_client(server), httpx.Client(base_url=server.url, timeout=60)
        before = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=12, temperature=0
        )
        stream = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stream=True)
        chunks = iter(stream)
        first = next(chunks)
        slept: dict[str, httpx.Response] = {}
        sleeper = threading.Thread(target=lambda: slept.setdefault("answer", http.post("/sleep", params={"level": 1})))
        sleeper.start()
        rest = list(chunks)  # the stream in progress runs to its end
        sleeper.join(60)
        assert rest[-1].choices[0].finish_reason == "length" and first.choices[0].text is not None
        assert slept["answer"].status_code == 200 and slept["answer"].json()["is_sleeping"] is True
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.get("/get_load").json()["is_sleeping"] is True
        health = http.get("/health")
        assert health.status_code == 503 and "sleeps" in health.json()["error"]["message"]
        refused = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "POST /wake_up" in refused.json()["error"]["message"]
        assert http.post("/sleep", params={"level": 2}).status_code == 400  # already asleep
        assert http.post("/wake_up", params={"tags": "bogus"}).status_code == 400
        assert http.post("/wake_up").json() == {"is_sleeping": False}
        assert http.post("/wake_up").status_code == 400  # awake already
        for level in ("0", "3", "x"):
            answer = http.post("/sleep", params={"level": level})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == "level"
        after = client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=PROMPTS[0], max_tokens=12, temperature=0
        )
        assert after.choices[0].text == before.choices[0].text
    with live_server() as plain:
        answer = httpx.post(f"{plain.url}/sleep", params={"level": 1}, timeout=60)
        assert answer.status_code == 400 and "--enable-sleep-mode" in answer.json()["error"]["message"]
