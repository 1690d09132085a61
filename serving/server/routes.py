"""The OpenAI-compatible routes: request bodies -> engine requests -> responses or streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from serving.chat_template import chat_prompt_ids
from serving.request import generation_room, prompt_token_ids
from serving.sampling_params import SamplingParams
from serving.server.async_engine import AsyncEngine, RequestGroup
from serving.server.errors import APIError, NotReadyError, error_response
from serving.server.metrics import ServerMetrics
from serving.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, SamplingFields, now
from serving.server.responses import ChatCompletions, Completions, ResponseShape, sse

T = TypeVar("T")


def public_routes(engine: AsyncEngine, metrics: ServerMetrics) -> APIRouter:
    """/health and /metrics: open even when an API key is set (as in vLLM)."""
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


def docs_routes(app: FastAPI) -> APIRouter:
    """/openapi.json, /docs and /redoc as FastAPI serves them, but as routes that take dependencies."""
    router = APIRouter(include_in_schema=False)

    @router.get("/openapi.json")
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @router.get("/docs")
    async def swagger() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - Swagger UI")

    @router.get("/redoc")
    async def redoc() -> HTMLResponse:
        return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    return router


def v1_routes(engine: AsyncEngine, model_name: str) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": now(), "owned_by": "vattn"}
        return {"object": "list", "data": [{**card, "max_model_len": engine.max_context}]}

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        _check_model(body.model, model_name)
        _ready(engine)
        prompts = _completion_prompts(engine, body.prompt, body.n)
        params = [
            _sampling_params(body, body.max_tokens, body.logprobs, engine.max_context, p, "prompt") for p in prompts
        ]
        shape = Completions(engine.tokenizer, model_name, body.n, prompts, wants_logprobs=body.logprobs is not None)
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
        params = [_sampling_params(body, max_tokens, logprobs, engine.max_context, prompt, "messages")]
        shape = ChatCompletions(engine.tokenizer, model_name, body.n, [prompt], wants_logprobs=body.logprobs)
        return await _respond(engine, request, body, shape, [prompt], params)

    return router


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}", param="model")


def _ready(engine: AsyncEngine) -> None:
    if not engine.ready:
        raise NotReadyError(engine.not_ready_reason())


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
    try:
        return [prompt_token_ids(engine.tokenizer, p)[1] for p in prompt]
    except ValueError as error:
        raise APIError(400, str(error), param="prompt") from error


def _sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    max_context: int,
    prompt: list[int],
    prompt_field: str,
) -> list[SamplingParams]:
    """One SamplingParams per choice (seeds seed, seed+1, ...); checks lengths against the context."""
    try:
        room = generation_room(len(prompt), max_context)
    except ValueError as error:
        raise APIError(400, str(error), param=prompt_field) from error
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
            sse(shape.stream(group, include_usage)), media_type="text/event-stream", background=BackgroundTask(close)
        )
    try:
        collected = await _unless_disconnected(request, shape.collect(group))
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
