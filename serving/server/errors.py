"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with a 4xx status.

Every error a client can cause is answered this way; only a bug gets a 500.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from serving.request import RequestError

log = logging.getLogger("vattn.serve")
RETRY_AFTER_SECONDS = 1
"""What 429 and 503 answers tell clients to wait before trying again."""
CLOSE = {"Connection": "close"}
"""On a 500: the exception that caused it ends the connection once the answer is sent (Starlette
re-raises it to the server), so the answer says the connection will not be kept."""


class NotReadyError(Exception):
    """The model is still loading, failed to load, or the engine has stopped: 503."""


class OverloadedError(Exception):
    """The queue of accepted requests is full; the client should retry later: 429."""


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def request_failed(error: RequestError) -> APIError:
    """A request the engine ended with an error: 400 when its own controls contradict each
    other, 500 when the server failed it (the other requests went on either way)."""
    if error.internal:
        return APIError(500, error.message, "internal_error")
    return APIError(400, error.message)


def error_body(message: str, kind: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        headers = {"Retry-After": str(RETRY_AFTER_SECONDS)} if error.status in (429, 503) else None
        if error.status >= 500 and error.status != 503:
            headers = CLOSE  # after a failure of its own the server drops the connection, and says so
        return error_response(error.status, error.message, error.kind, error.param, headers)

    @app.exception_handler(NotReadyError)
    async def not_ready(request: Request, error: NotReadyError) -> JSONResponse:
        return await api_error(request, APIError(503, str(error), "service_unavailable"))

    @app.exception_handler(OverloadedError)
    async def overloaded(request: Request, error: OverloadedError) -> JSONResponse:
        return await api_error(request, APIError(429, str(error), "rate_limit_exceeded"))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        context = first.get("ctx", {})
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {context.get('error', first.get('msg'))}"
            return error_response(400, message, "invalid_request_error")
        # a check of the whole body names the field in its context
        param = ".".join(str(part) for part in first.get("loc", ()) if part != "body") or context.get("param")
        if not param:
            return error_response(400, "the body must be a JSON object (application/json)", "invalid_request_error")
        return error_response(400, f"{param}: {first.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", "internal_error", headers=CLOSE)
