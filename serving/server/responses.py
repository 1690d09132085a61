"""Engine deltas -> OpenAI response bodies and server-sent events, per endpoint."""

from __future__ import annotations

import itertools
import json
import logging
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from typing import Any

from serving.request import TokenLogprob
from serving.server.async_engine import RequestGroup
from serving.server.errors import APIError, NotReadyError, error_body

log = logging.getLogger("vattn.serve")
PromptLogprobs = tuple[list[int], list[TokenLogprob | None]]
"""An echoed prompt's token ids and their logprobs (None for the first)."""


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


class ResponseShape(ABC):
    """How one endpoint turns deltas into a response body or stream chunks."""

    object_name: str
    chunk_name: str
    id_prefix: str

    def __init__(
        self,
        tokenizer: Any,
        model: str,
        n: int,
        prompts: list[list[int]],
        wants_logprobs: bool,
        echoes: list[str] | None = None,
    ) -> None:
        """Choice i answers prompt i // n; `echoes[p]` starts the text of prompt p's choices."""
        self.tokenizer = tokenizer
        self.model = model
        self.n = n
        self.wants_logprobs = wants_logprobs
        self.echoes = echoes
        self.prompts = prompts
        self.prompt_tokens = sum(map(len, prompts))  # once per prompt, whatever n is (as OpenAI and vLLM)
        self.id = new_id(self.id_prefix)
        self.created = now()

    def echo(self, index: int) -> str:
        return self.echoes[index // self.n] if self.echoes else ""

    def usage(self, completion_tokens: int, cached: dict[int, int]) -> dict[str, Any]:
        """Usage with each prompt's cached tokens counted once (its choices fork one computation)."""
        per_prompt: dict[int, int] = {}
        for index, tokens in cached.items():
            per_prompt[index // self.n] = min(tokens, per_prompt.get(index // self.n, tokens))
        return usage(self.prompt_tokens, completion_tokens, sum(per_prompt.values()))

    @abstractmethod
    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """A stream chunk's choice; `first` marks the choice's first chunk."""

    @abstractmethod
    def final_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        """A whole response's choice."""

    @abstractmethod
    def logprobs(self, entries: list[TokenLogprob] | None, offset: int, prompt: PromptLogprobs | None = None) -> Any:
        """Logprobs of tokens whose text starts at character `offset` of the choice, after those
        of the echoed prompt's tokens (completions only)."""

    def envelope(self, name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": name, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    async def collect(self, group: RequestGroup) -> dict[str, Any]:
        texts: dict[int, str] = {}
        tokens: dict[int, int] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        reasons: dict[int, str | None] = {}
        cached: dict[int, int] = {}
        prompts: dict[int, PromptLogprobs] = {}
        async for index, delta in group.deltas():
            cached[index] = delta.cached_tokens
            if delta.prompt_logprobs is not None:
                prompts[index] = (self.prompts[index // self.n], delta.prompt_logprobs)
            texts[index] = texts.get(index, "") + delta.text
            tokens[index] = tokens.get(index, 0) + len(delta.token_ids)
            logprobs.setdefault(index, []).extend(delta.logprobs or [])
            reasons[index] = delta.finish_reason
        choices = [
            self.final_choice(
                i,
                self.echo(i) + texts[i],
                self.logprobs(logprobs[i], len(self.echo(i)), prompts.get(i)) if self.wants_logprobs else None,
                reasons[i],
            )
            for i in sorted(reasons)
        ]
        return self.envelope(self.object_name, choices, usage=self.usage(sum(tokens.values()), cached))

    async def stream(
        self, group: RequestGroup, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[dict[str, Any]]:
        """Chunks as deltas come; with `include_usage` a last chunk has the usage, and with
        `continuous_usage` every chunk has the usage so far."""
        completion_tokens = 0
        offsets: dict[int, int] = {}
        started: set[int] = set()
        cached: dict[int, int] = {}
        async for index, delta in group.deltas():
            cached[index] = delta.cached_tokens
            completion_tokens += len(delta.token_ids)
            offset = offsets.get(index, len(self.echo(index)))
            prompt = None if delta.prompt_logprobs is None else (self.prompts[index // self.n], delta.prompt_logprobs)
            logprobs = self.logprobs(delta.logprobs, offset, prompt) if self.wants_logprobs else None
            offsets[index] = offset + len(delta.text)
            first = index not in started
            started.add(index)
            text = self.echo(index) + delta.text if first else delta.text
            choice = self.choice(index, text, logprobs, delta.finish_reason, first)
            extra = {"usage": self.usage(completion_tokens, cached)} if include_usage and continuous_usage else {}
            yield self.envelope(self.chunk_name, [choice], **extra)
        if include_usage:
            yield self.envelope(self.chunk_name, [], usage=self.usage(completion_tokens, cached))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class Completions(ResponseShape):
    object_name = chunk_name = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, first: bool) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(index, text, logprobs, finish_reason, True)

    def logprobs(
        self, entries: list[TokenLogprob] | None, offset: int, prompt: PromptLogprobs | None = None
    ) -> dict[str, Any]:
        head: list[tuple[int, float | None, dict[str, float] | None]] = []
        if prompt is not None:  # echo: the prompt's tokens first, the first one without a logprob
            for token, known in zip(*prompt, strict=True):
                head.append((token, None, None) if known is None else (token, known.logprob, self.top(known)))
        rows = head + [(e.token_id, e.logprob, self.top(e)) for e in entries or []]
        tokens = [self.token_text(token) for token, _, _ in rows]
        lengths = [len(token) for token in tokens]
        text_offset = [*_starts(lengths[: len(head)], 0), *_starts(lengths[len(head) :], offset)]
        return {
            "tokens": tokens,
            "token_logprobs": [logprob for _, logprob, _ in rows],
            "top_logprobs": [top for _, _, top in rows],
            "text_offset": text_offset,
        }

    def top(self, entry: TokenLogprob) -> dict[str, float]:
        """The top alternatives and the token itself, as vLLM answers (so logprobs=0 still names it)."""
        return {**{self.token_text(t): lp for t, lp in entry.top}, self.token_text(entry.token_id): entry.logprob}


class ChatCompletions(ResponseShape):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(
        self, entries: list[TokenLogprob] | None, offset: int, prompt: PromptLogprobs | None = None
    ) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                for e in entries or []
            ]
        }


def _starts(lengths: list[int], first: int) -> list[int]:
    """Where each of consecutive pieces of these lengths starts, the first at `first`."""
    return list(itertools.accumulate(lengths[:-1], initial=first)) if lengths else []


async def sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
    except NotReadyError as error:  # headers are sent: errors travel as an event
        yield f"data: {json.dumps(error_body(str(error), 'service_unavailable', code=503))}\n\n"
    except APIError as error:  # the request ended with an error of its own
        yield f"data: {json.dumps(error_body(error.message, error.kind, error.param, error.status))}\n\n"
    except Exception:
        log.exception("a stream failed")
        yield f"data: {json.dumps(error_body('internal server error', 'internal_error', code=500))}\n\n"
    yield "data: [DONE]\n\n"
