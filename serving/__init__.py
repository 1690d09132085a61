"""The vattn serving engine: a real model on the vattn KV cache with continuous batching."""

from serving.engine import EngineConfig, LLMEngine
from serving.llm import LLM
from serving.outputs import RequestOutput, StreamDelta
from serving.sampling_params import SamplingParams

__all__ = ["LLM", "EngineConfig", "LLMEngine", "RequestOutput", "SamplingParams", "StreamDelta"]
