"""Two vattn replicas behind vllm-router on loopback, started and stopped by `vattn replicas`:
requests flow through the router, and a replica killed mid-load costs only the requests it held."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from serving.server.replicas import find_router, free_port_run
from tests.live_server import MODEL

VATTN = Path(sys.executable).parent / "vattn"
IGNORE_EOS = {"ignore_eos": True}

try:
    find_router("vllm-router", None)
    ROUTER_MISSING = ""
except FileNotFoundError as missing:
    ROUTER_MISSING = f"vllm-router could not be installed here (`make router`): {missing}"

pytestmark = [pytest.mark.needs_model, pytest.mark.skipif(bool(ROUTER_MISSING), reason=ROUTER_MISSING)]


@dataclass
class Cluster:
    launcher: subprocess.Popen[str]
    router_url: str
    replica_urls: list[str]
    replica_pids: list[int]


def read_until_ready(launcher: subprocess.Popen[str], timeout: float) -> list[str]:
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert launcher.stdout is not None
        for line in launcher.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    seen, deadline = [], time.monotonic() + timeout
    while not any(line.startswith("ready:") for line in seen):
        line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        assert line is not None, f"the launcher exited with {launcher.wait()}: {seen}"
        seen.append(line)
    return seen


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    base = free_port_run(3)
    command = [str(VATTN), "replicas", "--replicas", "2", "--policy", "round_robin", "--port", str(base)]
    command += ["--first-replica-port", str(base + 1), "--", "--max-slots", "4", "--max-context", "512"]
    command += ["--enable-sleep-mode"]
    launcher = subprocess.Popen([*command, "--kv-budget", "64M"], stdout=subprocess.PIPE, text=True)
    try:
        lines = read_until_ready(launcher, timeout=300)
        replicas = [line.split() for line in lines if line.startswith("replica ")]
        yield Cluster(
            launcher,
            f"http://127.0.0.1:{base}",
            [words[4] for words in replicas],
            [int(words[3]) for words in replicas],
        )
    finally:
        launcher.send_signal(signal.SIGTERM)
        code = launcher.wait(120)
    assert code == 0
    for url in [f"http://127.0.0.1:{base}", *(f"http://127.0.0.1:{base + k}" for k in (1, 2))]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{url}/health", timeout=5)


def client(cluster: Cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.router_url}/v1", api_key="unused", max_retries=0, timeout=120)


def completed_requests(url: str) -> float:
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("vllm:request_success_total")
    )


def test_requests_flow_through_the_router_to_both_replicas(cluster: Cluster) -> None:
    before = [completed_requests(url) for url in cluster.replica_urls]
    with ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(
                lambda _: client(cluster).completions.create(
                    model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
                ),
                range(8),
            )
        )
    assert {answer.choices[0].text for answer in answers} == {answers[0].choices[0].text}
    assert answers[0].choices[0].text.startswith(" Paris")
    served = [completed_requests(url) - earlier for url, earlier in zip(cluster.replica_urls, before, strict=True)]
    assert served == [4, 4]  # round robin


def answered(cluster: Cluster) -> bool:
    try:
        client(cluster).completions.create(model=MODEL, prompt="Hello", max_tokens=1)
    except (openai.APIError, httpx.HTTPError):
        return False
    return True


def test_the_router_skips_a_sleeping_replica(cluster: Cluster) -> None:
    """A replica put to sleep answers /health with 503: the router's health checks take it out,
    every request goes to the other one; woken, it serves again."""
    sleeper, awake = cluster.replica_urls
    assert httpx.post(f"{sleeper}/sleep", params={"level": 1}, timeout=60).status_code == 200
    deadline, streak = time.monotonic() + 60, 0
    while streak < 4:  # the router has noticed once requests stop failing
        assert time.monotonic() < deadline, "the router kept sending requests to the sleeping replica"
        streak = streak + 1 if answered(cluster) else 0
    before = completed_requests(sleeper), completed_requests(awake)
    assert all(answered(cluster) for _ in range(6))
    assert completed_requests(sleeper) == before[0] and completed_requests(awake) == before[1] + 6
    assert httpx.post(f"{sleeper}/wake_up", timeout=60).json() == {"is_sleeping": False}
    deadline = time.monotonic() + 60
    while completed_requests(sleeper) == before[0]:  # back in the router's rotation
        assert time.monotonic() < deadline, "the router never sent to the woken replica again"
        assert answered(cluster)


def test_a_replica_killed_mid_load_costs_only_the_requests_it_held(cluster: Cluster) -> None:
    started = threading.Barrier(9)

    def stream() -> str:
        """'done' for a whole answer (200 tokens, finish_reason length), else 'failed'."""
        chunks = client(cluster).completions.create(
            model=MODEL, prompt="Once upon a time", max_tokens=200, temperature=0, stream=True, extra_body=IGNORE_EOS
        )
        finish, waited = None, False
        try:
            for chunk in chunks:
                if not waited:
                    waited = True
                    started.wait(60)
                finish = chunk.choices[0].finish_reason if chunk.choices else finish
        except (openai.APIError, httpx.HTTPError):
            return "failed"
        return "done" if finish == "length" else "failed"

    with ThreadPoolExecutor(8) as pool:
        streams = [pool.submit(stream) for _ in range(8)]
        started.wait(60)  # every stream has its first tokens: 4 on each replica
        os.kill(cluster.replica_pids[1], signal.SIGKILL)
        outcomes = [future.result(120) for future in streams]
    assert outcomes.count("done") == 4 and outcomes.count("failed") == 4  # round robin: 4 on each
    with ThreadPoolExecutor(8) as pool:  # the router retries the dead replica's refusals elsewhere
        after = list(
            pool.map(
                lambda _: client(cluster).completions.create(model=MODEL, prompt="Hello", max_tokens=2),
                range(8),
            )
        )
    assert all(answer.usage is not None and answer.usage.completion_tokens == 2 for answer in after)
    assert cluster.launcher.poll() is None  # the launcher keeps the router and the other replica
