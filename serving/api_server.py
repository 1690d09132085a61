"""The OpenAI-compatible HTTP API: FastAPI routes over the AsyncEngine.

Every error a client can cause is answered in OpenAI's shape,
`{"error": {"message", "type", "param", "code"}}`, with a 4xx status.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from serving.async_engine import AsyncEngine, NotReadyError, OverloadedError, RequestGroup
from serving.chat_template import chat_prompt_ids
from serving.engine import EngineConfig
from serving.metrics import ServerMetrics
from serving.protocol import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
    error_body,
    new_id,
    now,
    usage,
)
from serving.sampling_params import SamplingParams
from serving.sequence import TokenLogprob

log = logging.getLogger("vattn.serve")
T = TypeVar("T")
MiB = 1 << 20


@dataclass(frozen=True)
class ServerSettings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    model_name: str | None = None
    """The name clients send as `model`; by default the model folder's (or file's) name."""
    api_key: str | None = None
    """When set, /v1/* requires `Authorization: Bearer <api_key>`."""
    max_queue: int = 256
    """Requests that may wait for a slot; beyond it new ones get 429 with Retry-After."""
    max_body_bytes: int = MiB
    host: str = "127.0.0.1"
    port: int = 8000

    @property
    def max_pending(self) -> int:
        return self.engine.max_slots + self.max_queue


class APIError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_response(
    status: int, message: str, kind: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, kind, param, status), status_code=status, headers=headers)


# ---------------------------------------------------------------- the app


def build_app(settings: ServerSettings) -> FastAPI:
    """The app; its lifespan starts the engine thread (the model loads while /health says 503)."""
    if settings.engine.model is None:
        from serving.model_store import ensure_default_model

        settings = replace(settings, engine=replace(settings.engine, model=str(ensure_default_model())))
    model_name = settings.model_name or Path(str(settings.engine.model)).name.removesuffix(".gguf")
    metrics = ServerMetrics()
    engine = AsyncEngine(settings.engine, settings.max_pending, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        announce = asyncio.create_task(_announce_ready(engine, model_name, settings))
        yield
        announce.cancel()
        await asyncio.to_thread(engine.stop)

    app = FastAPI(title="vattn", version="0.1.0", lifespan=lifespan)
    app.state.engine, app.state.metrics, app.state.model_name = engine, metrics, model_name
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    _add_error_handlers(app)
    app.include_router(_public_routes(engine, metrics))
    app.include_router(_v1_routes(engine, model_name, settings), dependencies=[Depends(_authorizer(settings.api_key))])
    return app


async def _announce_ready(engine: AsyncEngine, model_name: str, settings: ServerSettings) -> None:
    if await asyncio.to_thread(engine.wait_ready):
        config = settings.engine
        log.info(
            "ready: %s on http://%s:%d/v1 (%s, %d slots, %d MiB KV budget, %d KiB pages)",
            model_name,
            settings.host,
            settings.port,
            config.dtype,
            config.max_slots,
            config.kv_budget // MiB,
            config.page_size // 1024,
        )


def _public_routes(engine: AsyncEngine, metrics: ServerMetrics) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        if engine.ready:
            return JSONResponse({"status": "ok"})
        return error_response(503, engine.not_ready_reason(), "service_unavailable")

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return router


def _authorizer(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'", "invalid_api_key")

    return authorize


def _v1_routes(engine: AsyncEngine, model_name: str, settings: ServerSettings) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        max_context = engine.engine.max_context if engine.engine else settings.engine.max_context
        card = {"id": model_name, "object": "model", "created": now(), "owned_by": "vattn"}
        return {"object": "list", "data": [{**card, "max_model_len": max_context}]}

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model, model_name)
        _ready(engine)
        prompts = _completion_prompts(engine, body.prompt, body.n)
        params = [_sampling_params(body, body.max_tokens, body.logprobs, engine, p, "prompt") for p in prompts]
        shape = Completions(engine, model_name, body.n, prompts, wants_logprobs=body.logprobs is not None)
        return await _respond(engine, request, body, shape, prompts, params)

    @router.post("/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_model(body.model, model_name)
        _ready(engine)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = chat_prompt_ids(engine.tokenizer, messages)
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        params = [_sampling_params(body, max_tokens, logprobs, engine, prompt, "messages")]
        shape = ChatCompletions(engine, model_name, body.n, [prompt], wants_logprobs=body.logprobs)
        return await _respond(engine, request, body, shape, [prompt], params)

    return router


# ---------------------------------------------------------------- request -> engine


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}", param="model")


def _ready(engine: AsyncEngine) -> None:
    if not engine.ready:
        raise APIError(503, engine.not_ready_reason(), "service_unavailable")


def _completion_prompts(
    engine: AsyncEngine, prompt: str | list[int] | list[str] | list[list[int]], n: int
) -> list[list[int]]:
    """The request's prompts as token ids: one string or id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) * n > MAX_N:
        raise APIError(400, f"{len(prompt)} prompts x n={n} choices is over the limit of {MAX_N}", param="n")
    prompts = []
    for p in prompt:
        if not p:
            raise APIError(400, "prompt is empty", param="prompt")
        prompts.append(engine.tokenizer.encode(p, add_special_tokens=True) if isinstance(p, str) else list(p))
    return prompts


def _sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    engine: AsyncEngine,
    prompt: list[int],
    prompt_field: str,
) -> list[SamplingParams]:
    """One SamplingParams per choice (seeds seed, seed+1, ...); checks lengths against the context."""
    max_context = engine.engine.max_context  # type: ignore[union-attr]
    if len(prompt) >= max_context:
        raise APIError(
            400,
            f"the prompt has {len(prompt)} tokens but this model's maximum context length is {max_context} "
            "tokens (prompt plus at least one generated token)",
            param=prompt_field,
        )
    room = max_context - len(prompt)
    if max_tokens is None:
        max_tokens = room
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise APIError(
            400,
            f"max_tokens is {max_tokens}, but the prompt has {len(prompt)} tokens and the maximum context "
            f"length is {max_context}: at most {room} tokens can be generated",
            param="max_tokens",
        )
    stop = body.stop if body.stop is not None else ()
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                seed=None if body.seed is None else body.seed + i,
                stop=stop,
                stop_token_ids=body.stop_token_ids or (),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
            )
            for i in range(body.n)
        ]
    except ValueError as error:
        message = str(error)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from error


async def _respond(
    engine: AsyncEngine,
    request: Request,
    body: SamplingFields,
    shape: ResponseShape,
    prompts: list[list[int]],
    params: list[list[SamplingParams]],
) -> Response:
    """Submits every choice of every prompt (choice index: prompt * n + j), then streams or collects."""
    flat_prompts = [prompt for prompt, choices in zip(prompts, params, strict=True) for _ in choices]
    group = await _submit(engine, flat_prompts, [p for choices in params for p in choices])
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def close() -> None:  # async, so it runs on the event loop like every other group change
            group.close()

        return StreamingResponse(
            _sse(shape.stream(group, include_usage)), media_type="text/event-stream", background=BackgroundTask(close)
        )
    try:
        collected = await _unless_disconnected(request, shape.collect(group))
    except NotReadyError as error:
        raise APIError(503, str(error), "service_unavailable") from error
    finally:
        group.close()  # a no-op when collect() ran to its end
    if collected is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(collected)


async def _submit(engine: AsyncEngine, prompts: list[list[int]], params: list[SamplingParams]) -> RequestGroup:
    try:
        return await engine.submit(prompts, params)
    except ValueError as error:
        raise APIError(400, str(error), param="prompt") from error
    except OverloadedError as error:
        raise APIError(429, str(error), "rate_limit_exceeded") from error
    except NotReadyError as error:
        raise APIError(503, str(error), "service_unavailable") from error


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Awaits `work`, or cancels it (aborting its requests) as soon as the client disconnects."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    try:
        async for event in events:
            yield f"data: {json.dumps(event)}\n\n"
    except NotReadyError as error:  # headers are sent: errors travel as an event
        yield f"data: {json.dumps(error_body(str(error), 'service_unavailable', code=503))}\n\n"
    except Exception:
        log.exception("a stream failed")
        yield f"data: {json.dumps(error_body('internal server error', 'internal_error', code=500))}\n\n"
    yield "data: [DONE]\n\n"


# ---------------------------------------------------------------- engine -> response


class ResponseShape(ABC):
    """How one endpoint turns deltas into a response body or stream chunks."""

    object_name: str
    chunk_name: str
    id_prefix: str

    def __init__(self, engine: AsyncEngine, model: str, n: int, prompts: list[list[int]], wants_logprobs: bool) -> None:
        self.tokenizer = engine.tokenizer
        self.model = model
        self.wants_logprobs = wants_logprobs
        self.prompt_tokens = sum(map(len, prompts)) * n
        self.id = new_id(self.id_prefix)
        self.created = now()

    @abstractmethod
    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, first: bool) -> dict[str, Any]:
        """A stream chunk's choice; `first` marks the choice's first chunk."""

    @abstractmethod
    def final_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        """A whole response's choice."""

    @abstractmethod
    def logprobs(self, entries: list[TokenLogprob] | None, offset: int) -> Any:
        """Logprobs of tokens whose text starts at character `offset` of the choice."""

    def envelope(self, name: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        head = {"id": self.id, "object": name, "created": self.created, "model": self.model}
        return {**head, "choices": choices, **extra}

    async def collect(self, group: RequestGroup) -> dict[str, Any]:
        texts: dict[int, str] = {}
        tokens: dict[int, int] = {}
        logprobs: dict[int, list[TokenLogprob]] = {}
        reasons: dict[int, str | None] = {}
        async for index, delta in group.deltas():
            texts[index] = texts.get(index, "") + delta.text
            tokens[index] = tokens.get(index, 0) + len(delta.token_ids)
            logprobs.setdefault(index, []).extend(delta.logprobs or [])
            reasons[index] = delta.finish_reason
        choices = [
            self.final_choice(i, texts[i], self.logprobs(logprobs[i], 0) if self.wants_logprobs else None, reasons[i])
            for i in sorted(reasons)
        ]
        return self.envelope(self.object_name, choices, usage=usage(self.prompt_tokens, sum(tokens.values())))

    async def stream(self, group: RequestGroup, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        completion_tokens = 0
        offsets: dict[int, int] = {}
        started: set[int] = set()
        async for index, delta in group.deltas():
            completion_tokens += len(delta.token_ids)
            offset = offsets.get(index, 0)
            logprobs = self.logprobs(delta.logprobs, offset) if self.wants_logprobs else None
            offsets[index] = offset + len(delta.text)
            first = index not in started
            started.add(index)
            yield self.envelope(self.chunk_name, [self.choice(index, delta.text, logprobs, delta.finish_reason, first)])
        if include_usage:
            yield self.envelope(self.chunk_name, [], usage=usage(self.prompt_tokens, completion_tokens))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])


class Completions(ResponseShape):
    object_name = chunk_name = "text_completion"
    id_prefix = "cmpl"

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, first: bool) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(index, text, logprobs, finish_reason, True)

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int) -> dict[str, Any]:
        entries = entries or []
        tokens = [self.token_text(e.token_id) for e in entries]
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self.token_text(t): lp for t, lp in e.top} for e in entries],
            "text_offset": text_offset,
        }


class ChatCompletions(ResponseShape):
    object_name = "chat.completion"
    chunk_name = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None, first: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}

    def final_choice(self, index: int, text: str, logprobs: Any, finish_reason: str | None) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}

    def logprobs(self, entries: list[TokenLogprob] | None, offset: int) -> dict[str, Any]:
        def entry(token_id: int, logprob: float) -> dict[str, Any]:
            token = self.token_text(token_id)
            return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

        return {
            "content": [
                {**entry(e.token_id, e.logprob), "top_logprobs": [entry(t, lp) for t, lp in e.top]}
                for e in entries or []
            ]
        }


# ---------------------------------------------------------------- errors and limits


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        headers = {"Retry-After": str(OverloadedError.retry_after)} if error.status in (429, 503) else None
        return error_response(error.status, error.message, error.kind, error.param, headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0]
        where = [str(part) for part in first.get("loc", ()) if part != "body"]
        if first.get("type") == "json_invalid":
            message = f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(400, message, "invalid_request_error")
        if not where:
            return error_response(400, "the body must be a JSON object (application/json)", "invalid_request_error")
        param = ".".join(where)
        return error_response(400, f"{param}: {first.get('msg')}", "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return error_response(error.status_code, str(error.detail), "invalid_request_error")

    @app.exception_handler(Exception)
    async def internal(request: Request, error: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(500, "internal server error", "internal_error")


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
