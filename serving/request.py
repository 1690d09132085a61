"""One request as the engine tracks it: tokens, KV slot, progress, text, and why it ended."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch

from serving.detokenizer import IncrementalDetokenizer
from serving.invalid_field import InvalidField
from serving.sampling_params import SamplingParams
from vattn.validate import is_int


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


def prompt_token_ids(tokenizer: Any, prompt: object, add_special_tokens: bool = True) -> tuple[str | None, list[int]]:
    """A prompt's text (None when given as ids) and its token ids; ValueError if empty or mistyped."""
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidField("prompt", "the prompt is empty")
        return prompt, tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    ids = list(prompt) if isinstance(prompt, list | tuple) else None
    if ids is None or not all(is_int(t) for t in ids):
        raise InvalidField("prompt", f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")
    if not ids:
        raise InvalidField("prompt", "the prompt is empty")
    return None, ids


def check_prompt_ids(ids: list[int], vocab_size: int) -> None:
    """ValueError naming the first prompt token id outside the vocabulary: checked before
    anything (the engine, an echo) decodes the ids."""
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidField("prompt", f"prompt token ids must be in [0, {vocab_size}), got {bad}")


def generation_room(prompt_tokens: int, max_context: int) -> int:
    """Tokens a prompt leaves for generation; ValueError when it leaves none."""
    if prompt_tokens >= max_context:
        raise InvalidField(
            "prompt",
            f"the prompt has {prompt_tokens} tokens but the max context is {max_context} tokens "
            "(prompt plus at least one generated token)",
        )
    return max_context - prompt_tokens


@dataclass(frozen=True)
class RequestError:
    """Why a request ended with finish reason "error"; it alone ended, every other request goes on."""

    message: str
    internal: bool = False
    """True for a failure of the server's own (a bug: 500), False for the request's own
    contradiction (constraints that leave no token: 400)."""


@dataclass(frozen=True)
class TokenLogprob:
    """The sampled token's log-probability and the `top` most likely tokens at that step."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(eq=False)
class Request:
    """A request's state. Its KV covers `all_ids[:num_computed]` in KV slot `slot`.

    Preemption frees the slot and sets `num_computed` to 0: the prompt and the tokens
    generated so far are computed again when the request is scheduled next.
    """

    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    """With `params.prompt_logprobs`: one per prompt token computed so far (None for the first)."""
    status: RequestStatus = RequestStatus.WAITING
    slot: int | None = None
    num_computed: int = 0
    finish_reason: str | None = None
    emitted_chars: int = 0
    """Characters of text already handed to the caller (stop-string prefixes are held back)."""
    emitted_tokens: int = 0
    finish_reported: bool = False
    scheduled_time: float | None = None
    """When the request first got a slot (the end of its time in the queue)."""
    first_token_time: float | None = None
    finish_time: float | None = None
    preemptions: int = 0
    fork_of: Request | None = None
    """A request submitted before this one whose prompt begins the same: this one waits until
    that one has computed `fork_at` tokens, then maps its pages (`KVStore.fork`)."""
    fork_at: int = 0
    matcher: Any = None
    """The grammar matcher of a request with structured output (serving.structured_output)."""
    cached_tokens: int | None = None
    """Prompt tokens found in the prefix cache when first admitted (not computed)."""
    error: RequestError | None = None
    """Set when the request ended with finish reason "error"."""

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether the prompt logprobs are asked for and not all known yet."""
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def text(self) -> str:
        return self.detokenizer.text

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
