"""Conversations to prompt tokens through the model's own chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

ROLES = ("system", "user", "assistant")


def chat_prompt_ids(
    tokenizer: Any,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> list[int]:
    """Token ids of a conversation with the assistant's turn opened (or, continuing the final
    message, left open); bad messages raise ValueError."""
    if not isinstance(messages, list | tuple) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for message in messages:
        if not isinstance(message, Mapping) or message.get("role") not in ROLES:
            raise ValueError(f"each message needs a role among {ROLES}, got {message!r}")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"each message needs string content, got {message!r}")
    rendered = tokenizer.apply_chat_template(
        list(messages),
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        tokenize=False,
    )
    return tokenizer.encode(rendered, add_special_tokens=add_special_tokens)  # the template wrote its own
