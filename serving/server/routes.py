"""The OpenAI-compatible routes: request bodies -> engine requests -> responses or streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Mapping
from dataclasses import replace
from importlib.metadata import version as package_version
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, FastAPI, Query
from fastapi import Request as HTTPRequest
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from serving.chat_template import chat_prompt_ids
from serving.invalid_field import STRUCTURED_OUTPUT, InvalidField
from serving.sampling_params import SamplingParams
from serving.server.async_engine import AsyncEngine, RequestGroup
from serving.server.errors import APIError, NotReadyError, error_response
from serving.server.metrics import ServerMetrics
from serving.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from serving.server.responses import ChatCompletions, Completions, ResponseShape, now, sse

T = TypeVar("T")


Engines = Mapping[str, AsyncEngine]
"""The served models' engines by the name clients send as `model`."""


def public_routes(engines: Engines, metrics: ServerMetrics) -> APIRouter:
    """/health, /metrics, /version and /get_load: open even when an API key is set (as in
    vLLM), for the probes of load balancers and routers (vllm-router, SMG). With several
    models the server is healthy while one serves and every other serves or sleeps."""
    router = APIRouter()

    @router.get("/health")
    async def health() -> JSONResponse:
        awake = [engine for engine in engines.values() if engine.sleep_level is None]
        if awake and all(engine.ready for engine in awake):
            return JSONResponse({"status": "ok"})
        blocking = next((e for e in awake if not e.ready), next(iter(engines.values())))
        return error_response(503, blocking.not_ready_reason(), "service_unavailable")

    @router.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.get("/version")
    async def version() -> dict[str, str]:
        return {"version": package_version("vattn")}

    @router.get("/get_load")
    async def load() -> dict[str, int | bool]:
        """SGLang's load probe, which vllm-router's power_of_two policy polls (while the engine
        sleeps, /health answers 503 and this says so)."""
        return {"load": metrics.load(), "is_sleeping": all(e.sleep_level is not None for e in engines.values())}

    return router


def sleep_routes(engines: Engines) -> APIRouter:
    """vLLM's sleep mode: POST /sleep?level=1|2, POST /wake_up[?tags=weights&tags=kv_cache],
    GET /is_sleeping, each for every model or the one `model` names. Requests in progress when
    /sleep arrives finish first; new ones get 503 with Retry-After until the engine is awake.
    A sleeping model's KV pages go back to the budget the other models share."""
    router = APIRouter()

    @router.post("/sleep")
    async def sleep(level: str = "1", model: str | None = None) -> dict[str, Any]:
        if level not in ("1", "2"):
            raise APIError(400, f"level must be 1 (KV cache) or 2 (KV cache and weights), got {level!r}", param="level")
        released = 0
        for engine in _engines_named(engines, model):
            try:
                released += await engine.sleep(int(level))
            except ValueError as error:
                raise APIError(400, str(error), param="level") from None
        return {"is_sleeping": True, "level": int(level), "released_kv_bytes": released}

    @router.post("/wake_up")
    async def wake_up(tags: Annotated[list[str] | None, Query()] = None, model: str | None = None) -> dict[str, Any]:
        chosen = _engines_named(engines, model)
        if model is None and len(engines) > 1:
            chosen = [engine for engine in chosen if engine.sleep_level is not None] or chosen
        for engine in chosen:
            try:
                await engine.wake_up(tags)
            except ValueError as error:
                raise APIError(400, str(error), param="tags") from None
        return {"is_sleeping": any(engine.sleep_level is not None for engine in chosen)}

    @router.get("/is_sleeping")
    async def is_sleeping(model: str | None = None) -> dict[str, bool]:
        return {"is_sleeping": all(engine.sleep_level is not None for engine in _engines_named(engines, model))}

    return router


def _engines_named(engines: Engines, model: str | None) -> list[AsyncEngine]:
    """The engine `model` names (404 if none), or every engine."""
    if model is None:
        return list(engines.values())
    return [_engine_for(engines, model)]


def _engine_for(engines: Engines, model: str) -> AsyncEngine:
    if (engine := engines.get(model)) is None:
        served = ", ".join(repr(name) for name in engines)
        raise APIError(404, f"the model {model!r} does not exist; this server serves {served}", param="model")
    return engine


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


def v1_routes(engines: Engines) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.get("/models")
    async def models() -> dict[str, Any]:
        """vLLM's model cards: routers read `root` as the model's path and `max_model_len`."""
        cards = [
            {"id": name, "object": "model", "created": now(), "owned_by": "vattn", "root": str(engine.config.model)}
            | {"parent": None, "max_model_len": engine.max_context}
            for name, engine in engines.items()
        ]
        return {"object": "list", "data": cards}

    @router.post("/completions", response_model=None)
    async def completions(body: CompletionRequest, request: HTTPRequest) -> Response:
        engine = _check_common(body, engines)
        model_name = body.model
        try:
            prompts = body.prompt_ids(engine.tokenizer, engine.vocab_size)
            params = [body.sampling_params(len(p), engine.max_context, body.max_tokens, body.logprobs) for p in prompts]
        except InvalidField as error:
            raise field_error(error, body) from error
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
            params = [[replace(p, prompt_logprobs=body.logprobs) for p in choices] for choices in params]
        echoes = [engine.tokenizer.decode(p) for p in prompts] if body.echo else None
        shape = Completions(engine.tokenizer, model_name, body.n, prompts, body.logprobs is not None, echoes)
        return await _respond(engine, request, body, shape, prompts, params)

    @router.post("/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: HTTPRequest) -> Response:
        engine = _check_common(body, engines)
        model_name = body.model
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs set to true", param="top_logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        if body.continue_final_message and (body.add_generation_prompt or messages[-1]["role"] != "assistant"):
            message = "continue_final_message needs add_generation_prompt false and an assistant message last"
            raise APIError(400, message, param="continue_final_message")
        try:
            prompt = chat_prompt_ids(
                engine.tokenizer,
                messages,
                body.add_generation_prompt,
                body.continue_final_message,
                body.add_special_tokens,
            )
        except ValueError as error:
            raise APIError(400, str(error), param="messages") from error
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        try:
            params = [body.sampling_params(len(prompt), engine.max_context, max_tokens, logprobs)]
        except InvalidField as error:
            raise field_error(error, body) from error
        echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
        shape = ChatCompletions(engine.tokenizer, model_name, body.n, [prompt], body.logprobs, [echo])
        return await _respond(engine, request, body, shape, [prompt], params)

    return router


def _check_common(body: SamplingFields, engines: Engines) -> AsyncEngine:
    """Checks both endpoints make before anything else: model, readiness, combinations of
    fields; returns the engine of the model asked for."""
    engine = _engine_for(engines, body.model)
    _ready(engine)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    return engine


def _ready(engine: AsyncEngine) -> None:
    if not engine.ready:
        raise NotReadyError(engine.not_ready_reason())


def field_error(error: InvalidField, body: SamplingFields) -> APIError:
    """A 400 naming the body field an InvalidField is about (a grammar's: whichever field asked for it)."""
    if error.field == STRUCTURED_OUTPUT:
        field = body.structured_field()
        return APIError(400, f"{field}: {error}", param=field)
    return APIError(400, str(error), param=error.field)


async def _respond(
    engine: AsyncEngine,
    request: HTTPRequest,
    body: SamplingFields,
    shape: ResponseShape,
    prompts: list[list[int]],
    params: list[list[SamplingParams]],
) -> Response:
    """Submits every choice of every prompt (choice index: prompt * n + j), then streams or collects."""
    flat_prompts = [prompt for prompt, choices in zip(prompts, params, strict=True) for _ in choices]
    group = await _submit(engine, body, flat_prompts, [p for choices in params for p in choices])
    for choices in params:  # one request per prompt, as vLLM counts them
        engine.metrics.observe_request(len(choices), choices[0].max_tokens)
    if body.stream:
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)

        async def close() -> None:  # async, so it runs on the event loop like every other group change
            group.close()

        chunks = sse(shape.stream(group, include_usage, continuous_usage))
        return StreamingResponse(chunks, media_type="text/event-stream", background=BackgroundTask(close))
    try:
        collected = await _unless_disconnected(request, shape.collect(group))
    finally:
        group.close()  # a no-op when collect() ran to its end
    if collected is None:
        return Response(status_code=499)  # the client is gone; nobody reads this
    return JSONResponse(collected)


async def _submit(
    engine: AsyncEngine, body: SamplingFields, prompts: list[list[int]], params: list[SamplingParams]
) -> RequestGroup:
    """Queues the requests; the engine's own checks (token ids in the vocabulary, a grammar that
    compiles) answer 400 naming the field."""
    try:
        return await engine.submit(prompts, params)
    except InvalidField as error:
        raise field_error(error, body) from error
    except ValueError as error:  # the engine's other refusals of input: still the client's, still a 400
        raise APIError(400, str(error)) from error


async def _unless_disconnected(request: HTTPRequest, work: Awaitable[T]) -> T | None:
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
