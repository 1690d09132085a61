"""Structured output: a grammar the generated text must follow, enforced token by token.

llguidance (one of vLLM's structured-output backends; a 3 MB wheel with no dependencies,
where xgrammar would pull triton) compiles a JSON schema, regex, list of choices or Lark /
GBNF grammar into a matcher. Before each sampling step the matcher of every constrained
request fills a row of a token bitmask, which masks that request's logits in the same
batched step; the sampled token then advances the matcher.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from torch import Tensor

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
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str) or not self.spec:
            raise ValueError("structured output needs a non-empty schema, regex, choice list or grammar")

    @classmethod
    def json_schema(cls, schema: Any) -> StructuredOutput:
        """From a schema given as JSON text or as a parsed object."""
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not choices or not all(isinstance(c, str) and c for c in choices):
            raise ValueError("structured output choices must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(choices))


class GrammarCompiler:
    """Matchers for one tokenizer. The llguidance tokenizer is built on first use (~0.3 s)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        self._hf_tokenizer, self.vocab_size = tokenizer, vocab_size
        self._tokenizer: Any = None

    def matcher(self, output: StructuredOutput) -> Any:
        """A fresh llguidance matcher; ValueError with llguidance's message if the spec is invalid."""
        import llguidance
        import llguidance.hf

        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self.vocab_size)
        try:
            grammar = llguidance.grammar_from(KINDS[output.kind], output.spec)
        except ValueError as error:
            raise ValueError(f"structured output: {error}") from error
        if error := llguidance.LLMatcher.validate_grammar(grammar, self._tokenizer):
            raise ValueError(f"structured output: the {output.kind} is not valid: {error.strip()}")
        return llguidance.LLMatcher(self._tokenizer, grammar)


def mask_disallowed(logits: Tensor, rows: list[int], matchers: list[Any]) -> None:
    """Sets to -inf, in place, every logit of row `rows[i]` that matcher i does not allow next."""
    import llguidance.torch

    bitmask = llguidance.torch.allocate_token_bitmask(len(rows), logits.shape[1])
    for index, matcher in enumerate(matchers):
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask, index)
    constrained = logits[rows]
    llguidance.torch.apply_token_bitmask_inplace(constrained, bitmask)
    logits[rows] = constrained


def advance(matcher: Any, token: int) -> None:
    """Feeds the sampled token to the matcher; RuntimeError if it was not allowed (a bug)."""
    if not matcher.consume_token(token):
        raise RuntimeError(f"the grammar matcher refused token {token}: {matcher.get_error()}")
