"""What callers get back: a finished request, or the next piece of a streamed one."""

from __future__ import annotations

from dataclasses import dataclass

from serving.sequence import Sequence, TokenLogprob


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    """"stop" (EOS, a stop token or string), "length" (max_tokens or the context), "abort"."""
    logprobs: list[TokenLogprob] | None
    ttft: float | None
    """Seconds from arrival to the first generated token."""
    latency: float | None
    preemptions: int

    @classmethod
    def of(cls, seq: Sequence) -> RequestOutput:
        return cls(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=list(seq.prompt_ids),
            text=seq.text,
            token_ids=list(seq.output_ids),
            finish_reason=seq.finish_reason,
            logprobs=list(seq.logprobs) if seq.params.logprobs is not None else None,
            ttft=None if seq.first_token_time is None else seq.first_token_time - seq.arrival,
            latency=None if seq.finish_time is None else seq.finish_time - seq.arrival,
            preemptions=seq.preemptions,
        )


@dataclass(frozen=True)
class StreamDelta:
    """Text and tokens a request produced since its previous delta."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
