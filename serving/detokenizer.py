"""Incremental detokenization: text grows token by token, and never ends in half a character."""

from __future__ import annotations

from typing import Any

CONTEXT_TOKENS = 5
"""Prompt tokens decoded ahead of the output, so tokenizers that drop a leading space keep it."""


class IncrementalDetokenizer:
    """Emits the text each new token adds.

    A byte-level tokenizer can split one character over several tokens; decoding those
    alone gives U+FFFD, so text is held back until the bytes complete. Each step decodes
    only the tokens since the last emitted text (plus the previous window for context).
    """

    def __init__(self, tokenizer: Any, prompt_ids: list[int]) -> None:
        self._tokenizer = tokenizer
        self._ids = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def add(self, token_id: int) -> str:
        """Appends a token; returns the text it completes (often "", at times several tokens' worth)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read])
        after = self._decode(self._ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def truncate(self, length: int) -> None:
        """Cuts the text (at a stop string); later tokens are not added."""
        self.text = self.text[:length]
