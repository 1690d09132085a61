"""The OpenAI API's request and response bodies (the subset vattn serves), as pydantic models.

Field types are checked here, with the bounds clients should see in the schema taken from
the same constants; ranges are checked by SamplingParams and the server, so each rule
lives in one place and its message names the field.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from serving.chat_template import ROLES
from serving.sampling_params import MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS

MAX_N = 8
"""Most choices one request may ask for (n), over all its prompts."""
_SURROGATE = re.compile(r"[\ud800-\udfff]")


class OpenAIBody(BaseModel):
    # unknown fields are ignored, as OpenAI and vLLM do; `user`, `metadata`... pass through
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBody):
    include_usage: bool = False


class SamplingFields(OpenAIBody):
    """Fields both endpoints share. top_k, ignore_eos and stop_token_ids are vLLM's extensions."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters"
    )
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")
    frequency_penalty: float = Field(0.0, ge=0.0, le=0.0, description="not supported: must be 0")

    @model_validator(mode="after")
    def _text_is_unicode(self) -> SamplingFields:
        """JSON may escape lone surrogates (`"\\ud800"`): not text, they would fail in the tokenizer as a 500.

        The error has no location (it is the whole body's), so `param` in its context names the field.
        """
        where = _lone_surrogate(self.model_dump())
        if where is not None:
            message = "a lone surrogate (\\ud800-\\udfff) is not valid Unicode text"
            raise PydanticCustomError("invalid_unicode", message, {"param": where.removeprefix(".")})
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: Literal[False] = False


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBody):
    role: Literal[ROLES]  # type: ignore[valid-type]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)


def _lone_surrogate(value: object) -> str | None:
    """Where the first string in a JSON value with a lone surrogate is (`.messages[0].content`), or None."""
    if isinstance(value, str):
        return "" if _SURROGATE.search(value) else None
    pairs: Iterable[tuple[object, object]]
    if isinstance(value, dict):
        pairs, form = value.items(), ".{}{}"
    elif isinstance(value, list):
        pairs, form = enumerate(value), "[{}]{}"
    else:
        return None
    for key, item in pairs:
        if (rest := _lone_surrogate(item)) is not None:
            return form.format(key, rest)
    return None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage object; `cached_tokens` are prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
