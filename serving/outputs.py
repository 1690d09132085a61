"""What callers get back: a finished request, or the next piece of a streamed one."""

from __future__ import annotations

from dataclasses import dataclass

from serving.request import Request, RequestError, TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (EOS, a stop token or string), "length" (max_tokens or the context), "abort", or
    "error" (see `error`)."""
    logprobs: list[TokenLogprob] | None
    ttft: float | None
    """Seconds from arrival to the first generated token."""
    latency: float | None
    """Seconds from arrival to the end."""
    queue_time: float | None
    """Seconds from arrival to the first slot."""
    preemptions: int
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    error: RequestError | None = None
    """Why the request ended with finish reason "error" (its own fault or, if `internal`, the server's)."""

    @classmethod
    def of(cls, request: Request) -> RequestOutput:
        return cls(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=list(request.prompt_ids),
            text=request.text,
            token_ids=list(request.output_ids),
            finish_reason=request.finish_reason,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            ttft=None if request.first_token_time is None else request.first_token_time - request.arrival,
            latency=None if request.finish_time is None else request.finish_time - request.arrival,
            queue_time=None if request.scheduled_time is None else request.scheduled_time - request.arrival,
            preemptions=request.preemptions,
            cached_tokens=request.cached_tokens or 0,
            prompt_logprobs=list(request.prompt_logprobs) if request.params.prompt_logprobs is not None else None,
            error=request.error,
        )


@dataclass(frozen=True)
class StreamDelta:
    """Text and tokens a request produced since its previous delta."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None
    cached_tokens: int = 0
    """Prompt tokens of the request whose KV came from the prefix cache."""
    prompt_logprobs: list[TokenLogprob | None] | None = None
    """In a request's first delta, with `prompt_logprobs` asked for."""
    error: RequestError | None = None
    """With finish reason "error": why."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class BeamSequence:
    """One finished beam."""

    token_ids: list[int]
    """Generated tokens, the EOS that ended the beam included."""
    text: str
    cum_logprob: float
    score: float
    """`cum_logprob / len(token_ids) ** length_penalty`: what the beams are ranked by."""
    finish_reason: str
    """"stop" (EOS) or "length" (max_tokens)."""


@dataclass(frozen=True)
class BeamSearchOutput:
    prompt: str | None
    prompt_token_ids: list[int]
    sequences: list[BeamSequence]
    """The `beam_width` best finished beams, best first."""
