"""The OpenAI API's request bodies (the subset vattn serves), as pydantic models, and their
translation into the engine's prompts and SamplingParams (as vLLM's `to_sampling_params`).

Field types are checked here, with the bounds clients should see in the schema taken from
the same constants; ranges are checked by SamplingParams, so each rule lives in one place.
Translation raises InvalidField naming the body field it is about.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from serving.chat_template import ROLES
from serving.invalid_field import STRUCTURED_OUTPUT, InvalidField
from serving.request import check_prompt_ids, generation_room, prompt_token_ids
from serving.sampling_params import MAX_LOGPROBS, MAX_STOP_LENGTH, MAX_STOP_STRINGS, SamplingParams
from serving.structured_output import StructuredOutput

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

    prompt_field: ClassVar[str] = "prompt"
    """The field that holds the prompt, for errors about its length."""
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

    def sampling_params(
        self, prompt_tokens: int, max_context: int, max_tokens: int | None, logprobs: int | None
    ) -> list[SamplingParams]:
        """One SamplingParams per choice (seeds seed, seed+1, ...), lengths checked against the context."""
        try:
            room = generation_room(prompt_tokens, max_context)
        except InvalidField as error:
            raise InvalidField(self.prompt_field, str(error)) from error
        if max_tokens is None:
            max_tokens = room
        elif isinstance(max_tokens, int) and max_tokens > room:
            raise InvalidField(
                "max_tokens",
                f"max_tokens is {max_tokens}, but the prompt has {prompt_tokens} tokens and the maximum context "
                f"length is {max_context}: at most {room} tokens can be generated",
            )
        structured = self.structured_output()
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                seed=None if self.seed is None else self.seed + i,
                stop=self.stop if self.stop is not None else (),
                stop_token_ids=self.stop_token_ids or (),
                ignore_eos=self.ignore_eos,
                logprobs=logprobs,
                min_tokens=self.min_tokens,
                presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
                repetition_penalty=self.repetition_penalty,
                logit_bias=_logit_bias(self.logit_bias),
                allowed_token_ids=self.allowed_token_ids,
                structured_output=structured,
                cache_salt=self.cache_salt,
            )
            for i in range(self.n)
        ]

    def structured_output(self) -> StructuredOutput | None:
        """The one grammar the request asks for, through any of OpenAI's or vLLM's fields."""
        try:
            found = self._structured_outputs()
        except InvalidField as error:
            field = self.structured_field() if error.field == STRUCTURED_OUTPUT else error.field
            raise InvalidField(field, str(error)) from error
        if len(found) > 1:
            raise InvalidField(
                next(iter(found)), f"only one structured output may be asked for, got {', '.join(found)}"
            )
        return next(iter(found.values()), None)

    def _structured_outputs(self) -> dict[str, StructuredOutput]:
        found: dict[str, StructuredOutput] = {}
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found["response_format"] = StructuredOutput.json_schema({"type": "object"})
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise InvalidField("response_format", "response_format of type json_schema needs json_schema")
            found["response_format"] = StructuredOutput.json_schema(fmt.json_schema.json_schema)
        if self.guided_json is not None:
            found["guided_json"] = StructuredOutput.json_schema(self.guided_json)
        if self.guided_regex is not None:
            found["guided_regex"] = StructuredOutput("regex", self.guided_regex)
        if self.guided_choice is not None:
            found["guided_choice"] = StructuredOutput.choice(self.guided_choice)
        if self.guided_grammar is not None:
            found["guided_grammar"] = StructuredOutput("grammar", self.guided_grammar)
        if (fields := self.structured_outputs) is not None:
            chosen = {
                "json": fields.json_ is not None and StructuredOutput.json_schema(fields.json_),
                "regex": fields.regex is not None and StructuredOutput("regex", fields.regex),
                "choice": fields.choice is not None and StructuredOutput.choice(fields.choice),
                "grammar": fields.grammar is not None and StructuredOutput("grammar", fields.grammar),
                "json_object": bool(fields.json_object) and StructuredOutput.json_schema({"type": "object"}),
            }
            found.update({f"structured_outputs.{k}": v for k, v in chosen.items() if v})
        return found

    def structured_field(self) -> str:
        """The field that asked for structured output, for errors about its grammar."""
        for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "structured_outputs"


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    add_special_tokens: bool = True

    def prompt_ids(self, tokenizer: Any, vocab_size: int) -> list[list[int]]:
        """The request's prompts as token ids (one string or id list, or a list of them), each
        checked against the vocabulary before anything (an echo) decodes it."""
        prompts = self.prompt
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if not prompts:
            raise InvalidField("prompt", "prompt is empty")
        if len(prompts) * self.n > MAX_N:
            raise InvalidField("n", f"{len(prompts)} prompts x n={self.n} choices is over the limit of {MAX_N}")
        ids = [prompt_token_ids(tokenizer, p, self.add_special_tokens)[1] for p in prompts]
        for prompt in ids:
            check_prompt_ids(prompt, vocab_size)
        return ids


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
    prompt_field: ClassVar[str] = "messages"
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


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if bias is None:
        return None
    parsed = {}
    for token, value in bias.items():
        try:
            parsed[int(token)] = value
        except ValueError as error:
            message = f"logit_bias keys must be token ids (integers as strings): {token!r} is not one"
            raise InvalidField("logit_bias", message) from error
    return parsed
