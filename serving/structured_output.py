"""Structured output: a grammar the generated text must follow, enforced token by token.

llguidance (one of vLLM's structured-output backends; a 3 MB wheel with no dependencies,
where xgrammar would pull triton) compiles a JSON schema, regex, list of choices or Lark /
GBNF grammar into a matcher. Before each sampling step the matcher of every constrained
request fills a row of a token bitmask, which masks that request's logits in the same
batched step; the sampled token then advances the matcher.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from serving.invalid_field import STRUCTURED_OUTPUT, InvalidField

KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
"""Our kinds and llguidance's format names for them (`grammar`: Lark, or GBNF as llama.cpp writes it)."""


@dataclass(frozen=True)
class StructuredOutput:
    """What the output must match: a JSON schema, a regex, one of several strings, or a grammar."""

    kind: str
    spec: str
    """The schema as JSON text, the regex, the choices as a JSON list of strings, or the grammar."""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidField(
                STRUCTURED_OUTPUT, f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str) or not self.spec:
            raise InvalidField(
                STRUCTURED_OUTPUT, "structured output needs a non-empty schema, regex, choice list or grammar"
            )

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """From a schema given as JSON text or as a parsed object."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise InvalidField(
                STRUCTURED_OUTPUT, "structured output choices must be a non-empty list of non-empty strings"
            )
        return cls("choice", json.dumps(choices))


MAX_SPEC_CHARS = 256 * 1024
"""Longest schema, regex, choice list or grammar accepted (a 3,000-property JSON schema is ~220K)."""
COMPILED_KEPT = 64
"""Compiled grammars kept for reuse: clients tend to send the same schema again."""


class GrammarCompiler:
    """Matchers for one tokenizer, compiled once per grammar and copied for each request.

    `compile` may run on any thread (the server runs it off the engine thread: llguidance
    drops the GIL while it builds), and llguidance's parser limits bound the work a grammar
    can cost, at compile time and at every token. The llguidance tokenizer is built by `prepare`
    or on first use (~0.5 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer: Any = None
        self._compiled: OrderedDict[StructuredOutput, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, output: StructuredOutput) -> Any:
        """The compiled matcher of `output` (kept for reuse); ValueError with llguidance's
        message if the spec is invalid or over a limit."""
        with self._lock:
            if (compiled := self._compiled.get(output)) is not None:
                self._compiled.move_to_end(output)
                return compiled
            tokenizer = self._llg_tokenizer()
        compiled = _compile(output, tokenizer, self.vocab_size)
        with self._lock:
            self._compiled[output] = compiled
            while len(self._compiled) > COMPILED_KEPT:
                self._compiled.popitem(last=False)
        return compiled

    def prepare(self) -> None:
        """Builds the llguidance tokenizer now (~0.5 s of Python), rather than in the first
        structured request, where it competes with the engine thread for the GIL."""
        with self._lock:
            self._llg_tokenizer()

    def matcher(self, output: StructuredOutput) -> Any:
        """A fresh matcher for one request (a copy of the compiled one)."""
        return self.compile(output).deep_copy()

    def _llg_tokenizer(self) -> Any:
        import llguidance.hf

        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        return self._tokenizer


def _compile(output: StructuredOutput, tokenizer: Any, vocab_size: int) -> Any:
    import llguidance

    if len(output.spec) > MAX_SPEC_CHARS:
        size, limit = len(output.spec), MAX_SPEC_CHARS
        raise InvalidField(
            STRUCTURED_OUTPUT, f"structured output: the {output.kind} has {size} characters, over the limit of {limit}"
        )
    try:
        grammar = llguidance.grammar_from(KINDS[output.kind], output.spec)
    except ValueError as error:
        raise InvalidField(STRUCTURED_OUTPUT, f"structured output: {error}") from error
    limits = llguidance.LLParserLimits(verbose_errors=False)  # llguidance's default bounds, no grammar in messages
    if error := llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits):
        raise InvalidField(STRUCTURED_OUTPUT, f"structured output: the {output.kind} is not valid: {error.strip()}")
    matcher = llguidance.LLMatcher(tokenizer, grammar, limits=limits)
    if not matcher.is_error():  # a first mask, on a copy: a grammar no text can complete fails here
        first = matcher.deep_copy()
        allowed_next(first, vocab_size)
        matcher = first if first.is_error() else matcher
    if matcher.is_error():
        raise InvalidField(
            STRUCTURED_OUTPUT, f"structured output: the {output.kind} cannot be used: {why(matcher.get_error())}"
        )
    return matcher


def why(error: str) -> str:
    """llguidance's error in words a user can act on (its non-verbose form names only the cause)."""
    cause = error.replace("<non-verbose/>", "").strip()
    if cause.startswith("NoExtensionBias"):
        return (
            "no text can complete it: no token may come next (a rule that can never end, like `start: start "
            "start`, or one that needs more than is left of max_tokens)"
        )
    return cause


def mask_disallowed(logits: Tensor, rows: list[int], matchers: list[Any]) -> dict[int, str]:
    """Sets to -inf, in place, every logit of row `rows[i]` that matcher i does not allow next.
    Returns the matchers that failed (a limit reached, an error state), by index, with why:
    their rows allow nothing."""
    failures: dict[int, str] = {}
    bitmask = torch.full((len(rows), (logits.shape[1] + 31) // 32), -1, dtype=torch.int32)
    for index, matcher in enumerate(matchers):
        try:
            _fill(matcher, bitmask[index])
        except Exception as error:  # llguidance raises only on misuse; keep it to this request
            failures[index] = str(error)
        if index not in failures and matcher.is_error():
            failures[index] = why(matcher.get_error())
        if index in failures:
            bitmask[index] = 0
    logits[rows] = logits[rows].masked_fill(~_unpack(bitmask, logits.shape[1]), float("-inf"))
    return failures


def allowed_next(matcher: Any, vocab_size: int) -> Tensor:
    """`[vocab_size]` bools: the tokens the matcher allows next."""
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    _fill(matcher, bitmask[0])
    return _unpack(bitmask, vocab_size)[0]


def _fill(matcher: Any, words: Tensor) -> None:
    """Writes the matcher's next-token bitmask into `words`, a contiguous int32 CPU row."""
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def _unpack(bitmask: Tensor, vocab_size: int) -> Tensor:
    """llguidance's `[rows, words]` int32 bitmask (bit b of word w: token 32w + b) as `[rows,
    vocab_size]` bools. Not llguidance.torch's functions: its apply is torch.compile'd, and
    its first call compiled C++ for ~20 s on the engine thread, stalling every stream."""
    bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.flatten(1)[:, :vocab_size].bool()


class GrammarError(Exception):
    """The request's grammar refused its own sampled token: the request ends, alone."""


def advance(matcher: Any, token: int) -> None:
    """Feeds the sampled token to the matcher; GrammarError if it was not allowed."""
    if not matcher.consume_token(token):
        raise GrammarError(f"structured output: the grammar refused token {token}: {why(matcher.get_error())}")
