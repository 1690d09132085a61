"""The error a request's own fields cause: a ValueError that says which field, so the HTTP
layer can name it (OpenAI's `param`) without reading the message."""

from __future__ import annotations

STRUCTURED_OUTPUT = "structured_output"
"""The field of a grammar error: the server names whichever body field asked for the grammar."""


class InvalidField(ValueError):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field
