"""The vattn serving engine: a real model on the vattn KV cache with continuous batching.

Names are imported on first use, so `python -m serving.default_model` (part of set-up)
does not load torch and transformers first.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "LLM": "serving.llm",
    "EngineConfig": "serving.config",
    "LLMEngine": "serving.engine",
    "RequestOutput": "serving.outputs",
    "SamplingParams": "serving.sampling_params",
    "StreamDelta": "serving.outputs",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'serving' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
