"""A pure ASGI middleware that bounds request bodies in size and in time, with or without Content-Length."""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.server.errors import error_response

KIND = "invalid_request_error"


class BodyLimit:
    """Reads the whole body before the app runs: over `max_bytes` gets 413, and a body that
    takes over `timeout` seconds to arrive gets 408 (and the connection is closed)."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout = timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and not declared.isdigit():
            await error_response(400, "the Content-Length header is not a number", KIND)(scope, receive, send)
            return
        if declared is not None and int(declared) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        try:
            body = await asyncio.wait_for(self._read(receive), self.timeout)
        except asyncio.TimeoutError:
            message = f"the request body did not arrive within {self.timeout:g} s"
            await error_response(408, message, "timeout", headers={"connection": "close"})(scope, receive, send)
            return
        if body is None:  # the client left: there is no one to answer
            return
        if len(body) > self.max_bytes:
            await self._too_large()(scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> bytearray | None:
        """The body, or its first part over `max_bytes`; None if the client disconnects first."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return None
            body += message.get("body", b"")
            if not message.get("more_body", False) or len(body) > self.max_bytes:
                return body

    def _too_large(self) -> JSONResponse:
        return error_response(413, f"the request body is larger than {self.max_bytes} bytes", KIND)
