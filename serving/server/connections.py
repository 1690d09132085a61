"""How uvicorn serves the app: connections get a deadline for their request headers.

uvicorn bounds idle kept-alive connections, but nothing bounds a request that is still
sending its headers: a client sending a byte now and then (slowloris) holds a connection
for ever. Its h11 protocol (h11 always, httptools is not used even when installed) runs
here with a timer from the moment the connection is ready for a request (connected, or
done with the last response) to the request's last header. Request bodies have their own
deadline in `body_limit`.
"""

from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from serving.server.settings import ServerSettings


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol, closing connections whose request headers take over `header_timeout` seconds."""

    header_timeout = 10.0
    _deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # the request's headers are in
            self._cancel_deadline()

    def on_response_complete(self) -> None:
        self._await_headers()  # the next request's; a pipelined one already in cancels it
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_deadline()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        """Also closes connections still sending a request body: nothing of the request has
        run yet (the app reads the whole body first), and uvicorn would wait for it."""
        if self.conn.their_state is h11.SEND_BODY and not self.cycle.response_started:
            self.transport.close()
        else:
            super().shutdown()

    def _await_headers(self) -> None:
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.header_timeout, self.transport.close)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


def uvicorn_options(settings: ServerSettings) -> dict[str, Any]:
    """uvicorn.run's (and uvicorn.Config's) arguments for the settings' address, deadlines and shutdown."""

    class Protocol(HeaderDeadlineProtocol):
        header_timeout = settings.header_timeout

    return {
        "host": settings.host,
        "port": settings.port,
        "http": Protocol,
        "timeout_graceful_shutdown": settings.shutdown_timeout,
    }
