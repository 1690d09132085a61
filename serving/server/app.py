"""The FastAPI app: the engine thread's lifetime, API-key and Host checks, routes and limits."""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import fields, replace
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from starlette.middleware.trustedhost import TrustedHostMiddleware

from serving.config import EngineConfig
from serving.server.async_engine import AsyncEngine
from serving.server.body_limit import BodyLimit
from serving.server.errors import APIError, add_error_handlers
from serving.server.metrics import ServerMetrics
from serving.server.routes import docs_routes, public_routes, sleep_routes, v1_routes
from serving.server.settings import SHARED_OPTIONS, ServerSettings
from vattn import PageBudget
from vattn.sizes import KiB, MiB

log = logging.getLogger("vattn.serve")


def build_app(settings: ServerSettings) -> FastAPI:
    """The app; its lifespan starts the engine threads (the models load while /health says 503).
    Several models get an engine each, their KV caches drawing on one PageBudget of kv_budget
    bytes; ValueError if two share a served name."""
    if settings.engine_config.model is None:
        from serving.default_model import ensure_default_model

        settings = replace(settings, engine_config=replace(settings.engine_config, model=str(ensure_default_model())))
    configs = _model_configs(settings)
    metrics = ServerMetrics(max(config.max_context for config in configs.values()))
    budget = PageBudget(settings.engine_config.kv_budget) if len(configs) > 1 else None
    engines = {
        name: AsyncEngine(config, config.max_slots + settings.max_queue, metrics.model(name), budget)
        for name, config in configs.items()
    }
    engine = next(iter(engines.values()))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for each in engines.values():
            each.start()
        announce = [asyncio.create_task(_announce_ready(e, name, settings)) for name, e in engines.items()]
        yield
        for task in announce:
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(each.stop) for each in engines.values()))

    # the docs are served by docs_routes, behind the API key
    app = FastAPI(title="vattn", version="0.1.0", lifespan=lifespan, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.engine = engine
    app.state.engines = engines
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes, timeout=settings.body_timeout)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=settings.trusted_hosts)  # outermost: checked first
    add_error_handlers(app)
    app.include_router(public_routes(engines, metrics))
    authorized = [Depends(_authorizer(settings.api_key))]
    app.include_router(v1_routes(engines), dependencies=authorized)
    app.include_router(docs_routes(app), dependencies=authorized)
    app.include_router(sleep_routes(engines), dependencies=authorized)
    return app


def _model_configs(settings: ServerSettings) -> dict[str, EngineConfig]:
    """Each served model's engine config by its served name: engine_config with the model's own
    options; ValueError for two models under one name or options the server cannot apply."""
    served = [(str(settings.engine_config.model), settings.model_name), *settings.more_models]
    configs = {name or _served_name(model): replace(settings.engine_config, model=model) for model, name in served}
    if len(configs) < len(served):
        raise ValueError(f"two models are served under one name: {[name or _served_name(m) for m, name in served]}")
    known = {f.name for f in fields(EngineConfig)} - set(SHARED_OPTIONS)
    for name, options in settings.model_options:
        if name not in configs:
            raise ValueError(f"--model-config names {name!r}, which is not served; served: {', '.join(configs)}")
        if shared := sorted(set(options) & set(SHARED_OPTIONS)):
            raise ValueError(f"--model-config {name}: {', '.join(shared)} is the same for every model: set it once")
        if unknown := sorted(set(options) - known):
            raise ValueError(
                f"--model-config {name}: no option {', '.join(unknown)}; options: {', '.join(sorted(known))}"
            )
        try:
            configs[name] = replace(configs[name], **options)
        except (TypeError, ValueError) as error:
            raise ValueError(f"--model-config {name}: {error}") from error
    return configs


def _served_name(model: str) -> str:
    """A model's default served name: its folder's (or .gguf file's) name."""
    return Path(model).name.removesuffix(".gguf")


async def _announce_ready(engine: AsyncEngine, model_name: str, settings: ServerSettings) -> None:
    if await asyncio.to_thread(engine.wait_ready):
        config = engine.config
        cache = (
            f"virtual KV cache, {config.page_size // KiB} KiB pages, prefix caching "
            + ("on" if config.prefix_caching else "off")
            if config.kv_cache == "virtual"
            else f"paged KV cache, {config.block_size}-token blocks"
        )
        log.info(
            "ready: %s on http://%s:%d/v1 (%s, %s KV, projections %s, %d slots, %d MiB KV budget, %s)",
            model_name,
            settings.host,
            settings.port,
            config.dtype,
            str(config.kv_torch_dtype).removeprefix("torch."),
            config.projections,
            config.max_slots,
            config.kv_budget // MiB,
            cache,
        )


def _authorizer(api_key: str | None) -> Callable[[Request], Awaitable[None]]:
    async def authorize(request: Request) -> None:
        if api_key is None:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), api_key.encode()):
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'", "invalid_api_key")

    return authorize
