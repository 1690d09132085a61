"""What `vattn serve` is asked for: the engine's config and the HTTP server's own limits."""

from __future__ import annotations

from dataclasses import dataclass, field

from serving.config import EngineConfig
from vattn.sizes import MiB


@dataclass(frozen=True)
class ServerSettings:
    engine_config: EngineConfig = field(default_factory=EngineConfig)
    model_name: str | None = None
    """The name clients send as `model`; by default the model folder's (or file's) name."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>`."""
    max_queue: int = 256
    """Requests that may wait for a slot; beyond it new ones get 429 with Retry-After."""
    max_body_bytes: int = MiB
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def max_pending(self) -> int:
        return self.engine_config.max_slots + self.max_queue
