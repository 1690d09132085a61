"""What a request asks of generation; checked up front so bad values never reach the engine."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from serving.invalid_field import InvalidField
from serving.structured_output import StructuredOutput
from vattn.validate import is_int

GREEDY_BELOW = 1e-5
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 4
"""As OpenAI allows: the engine looks for each after every token."""
MAX_STOP_LENGTH = 256
"""Characters per stop string: the text searched after each token, and held back from streams, grows with it."""


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's names and defaults. temperature 0 (below 1e-5) is greedy; top_k 0 means no top-k cut."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    """Per-request random stream: the same seed gives the same text, whatever else runs."""
    stop: str | Sequence[str] = ()
    """Strings that end generation; the text stops before them."""
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    """Return the sampled token's log-probability and this many top alternatives (0: none)."""
    prompt_logprobs: int | None = None
    """Return each prompt token's log-probability (None for the first) and this many top
    alternatives; such a request computes its whole prompt (no prefix cache, no fork)."""
    min_tokens: int = 0
    """Tokens generated before EOS, `stop_token_ids` or `stop` strings may end the request."""
    presence_penalty: float = 0.0
    """Subtracted from the logit of every token the output already has (OpenAI's, in [-2, 2])."""
    frequency_penalty: float = 0.0
    """Subtracted once per occurrence in the output so far (OpenAI's, in [-2, 2])."""
    repetition_penalty: float = 1.0
    """Divides positive logits (multiplies negative ones) of tokens in the prompt or output (HF's, > 0)."""
    min_p: float = 0.0
    """Drops tokens less likely than min_p times the most likely one (after temperature)."""
    logit_bias: Mapping[int, float] | None = None
    """Added to the logits of these token ids, each in [-100, 100] (OpenAI's)."""
    allowed_token_ids: Sequence[int] | None = None
    """Only these tokens may be generated (vLLM's)."""
    structured_output: StructuredOutput | None = None
    """A grammar the output must follow (serving.structured_output)."""
    cache_salt: str | None = None
    """vLLM's: the request shares prefix-cached (and forked) KV only with requests of the same salt."""

    def __post_init__(self) -> None:
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidField("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidField("temperature", f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidField("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < 0:
            raise InvalidField("top_k", f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**63):
            raise InvalidField("seed", f"seed must be a 64-bit signed integer, got {self.seed!r}")
        self._check_stops()
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidField("logprobs", f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS
        ):
            raise InvalidField(
                "prompt_logprobs",
                f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.prompt_logprobs!r}",
            )
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidField(
                "min_tokens", f"min_tokens must be an integer in [0, max_tokens], got {self.min_tokens!r}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            if not _is_number(value := getattr(self, name)) or not -2 <= value <= 2:
                raise InvalidField(name, f"{name} must be a number in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidField(
                "repetition_penalty", f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}"
            )
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidField("min_p", f"min_p must be in [0, 1], got {self.min_p!r}")
        self._check_token_maps()
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidField("cache_salt", f"cache_salt must be a non-empty string, got {self.cache_salt!r}")

    def _check_stops(self) -> None:
        """stop (a string or a list of them) and stop_token_ids, stored as tuples."""
        stop = (self.stop,) if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, tuple | list) or not all(isinstance(s, str) and s for s in stop):
            raise InvalidField("stop", f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if len(stop) > MAX_STOP_STRINGS:
            raise InvalidField("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(len(s) > MAX_STOP_LENGTH for s in stop):
            raise InvalidField("stop", f"stop strings must be at most {MAX_STOP_LENGTH} characters long")
        object.__setattr__(self, "stop", tuple(stop))
        ids = self.stop_token_ids
        if not isinstance(ids, tuple | list) or not all(is_int(t) and t >= 0 for t in ids):
            raise InvalidField("stop_token_ids", f"stop_token_ids must be a list of token ids, got {ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))

    def _check_token_maps(self) -> None:
        """logit_bias and allowed_token_ids, stored as a dict and a tuple."""
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, Mapping):
                raise InvalidField("logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}")
            bad = next((t for t in bias if not is_int(t) or t < 0), None)
            if bad is not None:
                raise InvalidField("logit_bias", f"logit_bias must map token ids to numbers: {bad!r} is not a token id")
            if not all(_is_number(b) and -100 <= b <= 100 for b in bias.values()):
                raise InvalidField("logit_bias", "logit_bias values must be numbers in [-100, 100]")
            object.__setattr__(self, "logit_bias", dict(bias))
        if self.allowed_token_ids is not None:
            allowed = self.allowed_token_ids
            if not isinstance(allowed, tuple | list) or not allowed or not all(is_int(t) and t >= 0 for t in allowed):
                raise InvalidField(
                    "allowed_token_ids", f"allowed_token_ids must be a non-empty list of token ids, got {allowed!r}"
                )
            object.__setattr__(self, "allowed_token_ids", tuple(allowed))

    def check_token_ids(self, vocab_size: int) -> None:
        """ValueError naming the field if a token id it lists is not in the vocabulary."""
        for name in ("stop_token_ids", "logit_bias", "allowed_token_ids"):
            bad = next((t for t in getattr(self, name) or () if t >= vocab_size), None)
            if bad is not None:
                raise InvalidField(
                    name, f"{name} must hold token ids in [0, {vocab_size}): {bad} is not in the vocabulary"
                )

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1)

    @property
    def greedy(self) -> bool:
        """Temperatures this small are argmax in all but name (and would overflow the softmax)."""
        return self.temperature < GREEDY_BELOW


@dataclass(frozen=True)
class BeamSearchParams:
    """vLLM's offline beam search parameters; the search itself is HF generate(num_beams=...)'s."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    """A finished beam scores cumulative log-probability / generated tokens ** length_penalty."""
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise InvalidField("beam_width", f"beam_width must be an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise InvalidField("max_tokens", f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.length_penalty):
            raise InvalidField("length_penalty", f"length_penalty must be a finite number, got {self.length_penalty!r}")
