"""The OpenAI-compatible routes: request bodies -> engine requests -> responses or streams."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.background import BackgroundTask

from serving.chat_template import chat_prompt_ids
from serving.request import check_prompt_ids, generation_room, prompt_token_ids
from serving.sampling_params import SamplingParams
from serving.server.async_engine import AsyncEngine, RequestGroup
from serving.server.errors import APIError, NotReadyError, error_response
from serving.server.metrics import ServerMetrics
from serving.server.protocol import MAX_N, ChatCompletionRequest, CompletionRequest, SamplingFields, now
from serving.server.responses import ChatCompletions, Completions, ResponseShape, sse
from serving.structured_output import StructuredOutput

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
        _check_common(body, model_name, engine)
        prompts = _completion_prompts(engine, body.prompt, body.n, body.add_special_tokens)
        params = [_sampling_params(body, body.max_tokens, body.logprobs, engine, p, "prompt") for p in prompts]
        if body.echo and body.logprobs is not None:  # the echoed prompt's tokens come with their logprobs
            params = [[replace(p, prompt_logprobs=body.logprobs) for p in choices] for choices in params]
        echoes = [engine.tokenizer.decode(p) for p in prompts] if body.echo else None
        shape = Completions(engine.tokenizer, model_name, body.n, prompts, body.logprobs is not None, echoes)
        return await _respond(engine, request, body, shape, prompts, params)

    @router.post("/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        _check_common(body, model_name, engine)
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
        params = [_sampling_params(body, max_tokens, logprobs, engine, prompt, "messages")]
        echo = messages[-1]["content"] if body.echo and messages[-1]["role"] == "assistant" else ""
        shape = ChatCompletions(engine.tokenizer, model_name, body.n, [prompt], body.logprobs, [echo])
        return await _respond(engine, request, body, shape, [prompt], params)

    return router


def _check_common(body: SamplingFields, model_name: str, engine: AsyncEngine) -> None:
    """Checks both endpoints make before anything else: model, readiness, combinations of fields."""
    _check_model(body.model, model_name)
    _ready(engine)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", param="stream_options")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")


def _check_model(requested: str, served: str) -> None:
    if requested != served:
        raise APIError(404, f"the model {requested!r} does not exist; this server serves {served!r}", param="model")


def _ready(engine: AsyncEngine) -> None:
    if not engine.ready:
        raise NotReadyError(engine.not_ready_reason())


def _completion_prompts(
    engine: AsyncEngine, prompt: str | list[int] | list[str] | list[list[int]], n: int, add_special_tokens: bool
) -> list[list[int]]:
    """The request's prompts as token ids: one string or id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError(400, "prompt is empty", param="prompt")
    if len(prompt) * n > MAX_N:
        raise APIError(400, f"{len(prompt)} prompts x n={n} choices is over the limit of {MAX_N}", param="n")
    try:
        ids = [prompt_token_ids(engine.tokenizer, p, add_special_tokens)[1] for p in prompt]
        for prompt_ids in ids:
            check_prompt_ids(prompt_ids, engine.vocab_size)  # before an echo decodes them
    except ValueError as error:
        raise APIError(400, str(error), param="prompt") from error
    return ids


def _sampling_params(
    body: SamplingFields,
    max_tokens: int | None,
    logprobs: int | None,
    engine: AsyncEngine,
    prompt: list[int],
    prompt_field: str,
) -> list[SamplingParams]:
    """One SamplingParams per choice (seeds seed, seed+1, ...); checks lengths against the context."""
    try:
        room = generation_room(len(prompt), engine.max_context)
    except ValueError as error:
        raise APIError(400, str(error), param=prompt_field) from error
    if max_tokens is None:
        max_tokens = room
    elif isinstance(max_tokens, int) and max_tokens > room:
        raise APIError(
            400,
            f"max_tokens is {max_tokens}, but the prompt has {len(prompt)} tokens and the maximum context "
            f"length is {engine.max_context}: at most {room} tokens can be generated",
            param="max_tokens",
        )
    stop = body.stop if body.stop is not None else ()
    structured = _structured_output(body)
    try:
        return [
            SamplingParams(
                max_tokens=max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=None if body.seed is None else body.seed + i,
                stop=stop,
                stop_token_ids=body.stop_token_ids or (),
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                min_tokens=body.min_tokens,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=body.repetition_penalty,
                logit_bias=_logit_bias(body.logit_bias),
                allowed_token_ids=body.allowed_token_ids,
                structured_output=structured,
                cache_salt=body.cache_salt,
            )
            for i in range(body.n)
        ]
    except ValueError as error:
        message = str(error)
        raise APIError(400, message, param=message.split(" ", 1)[0]) from error


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as strings."""
    if bias is None:
        return None
    parsed = {}
    for token, value in bias.items():
        try:
            parsed[int(token)] = value
        except ValueError as error:
            message = f"logit_bias keys must be token ids (integers as strings): {token!r} is not one"
            raise APIError(400, message, param="logit_bias") from error
    return parsed


def _structured_output(body: SamplingFields) -> StructuredOutput | None:
    """The one grammar the request asks for, through any of OpenAI's or vLLM's fields."""
    try:
        found = _structured_outputs(body)
    except ValueError as error:
        raise APIError(400, str(error), param=structured_field(body)) from error
    if len(found) > 1:
        names = ", ".join(found)
        raise APIError(400, f"only one structured output may be asked for, got {names}", param=next(iter(found)))
    return next(iter(found.values()), None)


def _structured_outputs(body: SamplingFields) -> dict[str, StructuredOutput]:
    found: dict[str, StructuredOutput] = {}
    fmt = body.response_format
    if fmt is not None and fmt.type == "json_object":
        found["response_format"] = StructuredOutput.json_schema({"type": "object"})
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(400, "response_format of type json_schema needs json_schema", param="response_format")
        found["response_format"] = StructuredOutput.json_schema(fmt.json_schema.json_schema)
    if body.guided_json is not None:
        found["guided_json"] = StructuredOutput.json_schema(body.guided_json)
    if body.guided_regex is not None:
        found["guided_regex"] = StructuredOutput("regex", body.guided_regex)
    if body.guided_choice is not None:
        found["guided_choice"] = StructuredOutput.choice(body.guided_choice)
    if body.guided_grammar is not None:
        found["guided_grammar"] = StructuredOutput("grammar", body.guided_grammar)
    if (fields := body.structured_outputs) is not None:
        chosen = {
            "json": fields.json_ is not None and StructuredOutput.json_schema(fields.json_),
            "regex": fields.regex is not None and StructuredOutput("regex", fields.regex),
            "choice": fields.choice is not None and StructuredOutput.choice(fields.choice),
            "grammar": fields.grammar is not None and StructuredOutput("grammar", fields.grammar),
            "json_object": bool(fields.json_object) and StructuredOutput.json_schema({"type": "object"}),
        }
        found.update({f"structured_outputs.{k}": v for k, v in chosen.items() if v})
    return found


def structured_field(body: SamplingFields) -> str:
    """The field that asked for structured output, for errors about its grammar."""
    for name in ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            return name
    return "structured_outputs"


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
    except ValueError as error:
        message, first = str(error), str(error).split(" ", 1)[0]
        if message.startswith("structured output"):
            param = structured_field(body)
            message = f"{param}: {message}"
        else:
            param = first if first in SamplingParams.__dataclass_fields__ else "prompt"
        raise APIError(400, message, param=param) from error


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
