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
    continuous_usage_stats: bool = False
    """vLLM's: every chunk carries the usage so far (with include_usage)."""


class JsonSchemaFormat(OpenAIBody):
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None
    """Accepted either way: the schema is always enforced."""


class ResponseFormat(OpenAIBody):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsFields(OpenAIBody):
    """vLLM's `structured_outputs` object: one of these."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


UNSUPPORTED: dict[str, object] = {
    "suffix": "",
    "use_beam_search": False,
    "length_penalty": 1.0,
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "bad_words": (),
    "truncate_prompt_tokens": None,
    "prompt_logprobs": None,
    "tools": (),
    "tool_choice": "none",
    "functions": (),
    "function_call": "none",
    "chat_template": None,
    "chat_template_kwargs": {},
    "documents": (),
    "mm_processor_kwargs": {},
    "guided_whitespace_pattern": None,
    "logits_processors": (),
}
"""vLLM or OpenAI request fields this server does not implement, with the value that asks for
nothing: any other value is refused with 400 rather than silently ignored."""


class SamplingFields(OpenAIBody):
    """Fields both endpoints share; all but OpenAI's own are vLLM's extensions."""

    model: str
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = Field(None, description="only equal to n: best-of selection is not supported")
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = Field(
        None, description=f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_LENGTH} characters"
    )
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: Literal["guidance", "llguidance", "auto"] | None = None
    structured_outputs: StructuredOutputsFields | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    cache_salt: str | None = Field(
        None, description="vLLM's: prefix-cached KV is shared only among requests with the same salt"
    )

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, neutral in UNSUPPORTED.items():
                value = data.get(name)
                if value is not None and value != neutral and not (value == [] and neutral == ()):
                    raise PydanticCustomError("not_supported", "not supported by this server", {"param": name})
        return data

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
    echo: bool = False
    add_special_tokens: bool = True


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
    echo: bool = False
    """vLLM's: the reply starts with the last message's content when that is the assistant's."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """vLLM's: the reply continues the last (assistant) message instead of opening a new one."""
    add_special_tokens: bool = False


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
