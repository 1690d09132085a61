"""A real uvicorn server on a loopback port, in this process, for tests to talk to over HTTP."""

from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import uvicorn
from fastapi import FastAPI
from prometheus_client.parser import text_string_to_metric_families

from serving.config import EngineConfig
from serving.engine import LLMEngine
from serving.server.app import build_app
from serving.server.async_engine import AsyncEngine
from serving.server.connections import uvicorn_options
from serving.server.settings import ServerSettings
from tests.process_memory import release_memory
from vattn.sizes import MiB

MODEL = "SmolLM2-135M-Instruct"


@dataclass
class LiveServer:
    url: str
    engine: AsyncEngine
    settings: ServerSettings
    app: FastAPI

    def on_engine(self, fn: Any, timeout: float = 60) -> Any:
        """Runs fn(engine) on the engine thread (between iterations) and returns its result."""
        return self.engine.call(fn).result(timeout)

    def pages_back_in_pool(self) -> tuple[int, int, int]:
        """(free slots, free pages, pool pages) once idle slots and the prefix cache give their pages back."""

        def release(engine: LLMEngine) -> tuple[int, int, int]:
            cache = engine.kv.cache
            assert cache.stats().active_bytes == 0
            cache.wait_for_background()
            cache.release_idle()
            cache.evict_prefix_cache()
            return cache.num_free_slots(), cache.num_free_pages(), cache.stats().pool_pages

        return self.on_engine(release)


def metric_values(url: str, model: str | None = None) -> dict[str, float]:
    """The server's /metrics by sample, `name{label="value",...}` (labels sorted, model_name left
    out): one model's samples, or by default the sum over every model's."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            labels = dict(sample.labels)
            if model is not None and labels.get("model_name") != model:
                continue
            labels.pop("model_name", None)
            shown = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
            key = f"{sample.name}{{{shown}}}" if shown else sample.name
            values[key] = values.get(key, 0.0) + sample.value
    return values


def openai_client(server: LiveServer, api_key: str = "unused") -> openai.OpenAI:
    """The real `openai` client on the server, without retries (a failure shows at once)."""
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=api_key, max_retries=0, timeout=120)


@contextmanager
def live_server(wait_ready: bool = True, **overrides: Any) -> Iterator[LiveServer]:
    """Serves the default model; keyword arguments are ServerSettings fields or EngineConfig fields."""
    engine_fields = {k: overrides.pop(k) for k in list(overrides) if k in EngineConfig.__dataclass_fields__}
    sizes = {"dtype": "float32", "max_slots": 8, "max_context": 256, "kv_budget": 64 * MiB}
    engine_config = EngineConfig(**{**sizes, **engine_fields})
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    settings = ServerSettings(engine_config=engine_config, port=port, **{"shutdown_timeout": 5, **overrides})
    app = build_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **uvicorn_options(settings)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        engine: AsyncEngine = app.state.engine
        while not server.started:
            assert thread.is_alive(), "uvicorn did not start"
            threading.Event().wait(0.05)
        if wait_ready:
            for each in app.state.engines.values():
                assert each.wait_ready(120), f"the model did not load: {each.load_error}"
        yield LiveServer(f"http://127.0.0.1:{port}", engine, settings, app)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
        release_memory()  # the stopped engine dropped its model


def read_until(server: subprocess.Popen[str], word: str) -> list[str]:
    """A `vattn serve` subprocess's log lines (stdout, text) up to the first holding `word`."""
    deadline, log = time.monotonic() + 120, []
    while time.monotonic() < deadline and not any(word in line for line in log):
        line = server.stdout.readline()  # type: ignore[union-attr]
        assert line or server.poll() is None, "".join(log)
        log.append(line)
    return log
