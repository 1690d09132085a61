"""What `vattn serve` is asked for: the engine's config and the HTTP server's own limits."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from serving.config import EngineConfig
from vattn.sizes import MiB

SHARED_OPTIONS = ("model", "kv_budget", "backend", "kv_cache", "tensor_parallel_size")
"""EngineConfig fields every served model has alike: --model names each model, and their KV
caches share one budget on one backend."""
LOOPBACK_ADDRESSES = frozenset({"127.0.0.1", "localhost", "::1"})
LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "[::1]")
"""Host headers a server bound to a loopback address accepts by default (with any port): a web
page using DNS rebinding (`evil.example` resolving to 127.0.0.1) sends its own name and is refused."""


@dataclass(frozen=True)
class ServerSettings:
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    model_name: str | None = None
    """The name clients send as `model`; by default the model folder's (or file's) name."""
    more_models: tuple[tuple[str, str | None], ...] = ()
    """Further models served beside engine_config's, as (model, served name or None), each with
    engine_config's other settings unless model_options give its own; all their KV caches share
    one kv_budget."""
    model_options: tuple[tuple[str, Mapping[str, Any]], ...] = ()
    """(served name, EngineConfig fields) for models whose settings differ from engine_config's,
    all but SHARED_OPTIONS."""
    api_key: str | None = None
    """When set, every route but /health and /metrics (probes, scrapers: open as in vLLM) needs `Bearer <api_key>`."""
    max_queue: int = 256
    """Requests that may wait for a slot; beyond it new ones get 429 with Retry-After."""
    max_body_bytes: int = MiB
    header_timeout: float = 10.0
    """Seconds a connection has to send a request's headers (from connecting or the last response); then it closes."""
    body_timeout: float = 30.0
    """Seconds a request has to send its body once its headers are in; then 408."""
    shutdown_timeout: int = 30
    """Seconds requests in progress get to finish after SIGTERM; then they are cancelled."""
    allowed_hosts: tuple[str, ...] | None = None
    """Host headers accepted (`*`: any); None: LOOPBACK_HOSTS when bound to a loopback address, else any."""
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def trusted_hosts(self) -> tuple[str, ...]:
        if self.allowed_hosts is not None:
            return self.allowed_hosts
        return LOOPBACK_HOSTS if self.host in LOOPBACK_ADDRESSES else ("*",)
