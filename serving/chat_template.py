"""Conversations to prompt tokens through the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant")


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """Token ids of a conversation with the assistant's turn opened; bad messages raise ValueError."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise ValueError(f"each message needs a role among {ROLES}, got {message!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"each message needs string content, got {message!r}")
    rendered = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)
