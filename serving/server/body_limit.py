"""A pure ASGI middleware that bounds request bodies, with or without Content-Length."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.server.errors import error_response


class BodyLimit:
    """Refuses request bodies over `max_bytes` with 413, whether or not Content-Length is sent."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._refuse(scope, receive, send, declared.isdigit())
            return
        body, more = bytearray(), True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._refuse(scope, receive, send, True)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, too_large: bool) -> None:
        if too_large:
            response = error_response(
                413, f"the request body is larger than {self.max_bytes} bytes", "invalid_request_error"
            )
        else:
            response = error_response(400, "the Content-Length header is not a number", "invalid_request_error")
        await response(scope, receive, send)
