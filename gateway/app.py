"""create_app(settings): the gateway as one ASGI application, with no module-level state.

Inference endpoints are served by ``routes.openai.InferenceEndpoints`` directly at the ASGI level (the
hot path); everything else (models, health, metrics, admin) by FastAPI. Both render errors through
``gateway.errors`` and tag every response with ``x-request-id``.
"""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.config import ConfigError, GatewayConfig, UpstreamConfig, load_config
from gateway.errors import GatewayError, InvalidRequest, ServerError, error_for_status
from gateway.metrics import Metrics
from gateway.protocol import ENDPOINTS
from gateway.registry import PluginRegistry
from gateway.routes import JSON, health, models
from gateway.routes.openai import InferenceEndpoints, Receive, Scope, Send, request_id_from
from gateway.runtime import RuntimeHolder
from gateway.services import Services
from gateway.settings import Settings
from gateway.state import AppState
from gateway.upstream import UpstreamClient
from gateway.workers import WorkerTable

log = logging.getLogger("gateway")

EngineFactory = Callable[[AppState, GatewayConfig], Any]


def _error_response(error: GatewayError) -> JSON:
    return JSON(error.body(), status_code=error.status_code, headers=error.headers)


def _install_error_handlers(api: FastAPI) -> None:
    @api.exception_handler(GatewayError)
    async def gateway_error(_: Request, exc: GatewayError) -> JSON:
        return _error_response(exc)

    @api.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSON:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        return _error_response(InvalidRequest(f"{param or 'request'}: {first.get('msg', 'invalid')}", param=param))

    @api.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSON:
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}."
        elif exc.status_code == 405:
            message = f"Method {request.method} is not allowed on {request.url.path}."
        else:
            message = str(exc.detail)
        error = error_for_status(exc.status_code, message)
        return JSON(error.body(), status_code=exc.status_code, headers=dict(exc.headers or {}))

    @api.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSON:
        log.exception("unhandled error", exc_info=exc)
        return _error_response(ServerError("The gateway failed to process the request; it has been logged."))


def _default_engine(state: AppState, config: GatewayConfig) -> Any:
    from gateway.engine.supervisor import EngineManager

    return EngineManager(
        list(config.engine.workers),
        models_dir=state.settings.model_dir,
        ready_timeout_s=config.engine.ready_timeout_s,
    )


class GatewayApp:
    """The ASGI entry point: inference paths go to the lean handler, the rest to FastAPI."""

    def __init__(self, api: FastAPI, inference: InferenceEndpoints, state: AppState) -> None:
        self.api = api
        self.inference = inference
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ENDPOINTS:
            await self.inference(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.api(scope, receive, send)
            return
        request_id = request_id_from(scope["headers"]).encode("ascii")

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        await self.api(scope, receive, send_with_id)


def create_app(
    settings: Settings,
    *,
    registry: PluginRegistry | None = None,
    config: GatewayConfig | None = None,
    engine_factory: EngineFactory | None = _default_engine,
) -> GatewayApp:
    """Build the app. ``config`` overrides reading ``settings.config_path``; ``engine_factory=None``
    never starts managed workers (tests, or workers given by URL only)."""
    services = Services(
        settings=settings,
        upstream=UpstreamClient(config.upstream if config else UpstreamConfig()),
        workers=WorkerTable(),
        metrics=Metrics(),
    )
    registry = registry or PluginRegistry()
    state = AppState(settings=settings, services=services, registry=registry, holder=RuntimeHolder(registry, services))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        initial = config or load_config(settings.config_path)
        if engine_factory is not None and settings.managed_workers and initial.engine.workers:
            state.engine = engine_factory(state, initial)
            await state.engine.start()
        try:
            await state.holder.load(initial)
            services.workers.start_health_checks(
                lambda url: _probe(services, url), state.holder.current.config.upstream.health_interval_s
            )
            gc.collect()
            gc.freeze()  # start-up objects never need collecting; keeps GC pauses short under load
            yield
        finally:
            state.draining = True
            await state.holder.aclose()
            if state.engine is not None:
                await state.engine.stop()
            await services.aclose()

    api = FastAPI(title="vLLM gateway", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    api.state.gateway = state
    _install_error_handlers(api)
    api.include_router(health.router)
    api.include_router(models.router)
    for path in ENDPOINTS:
        # Declared for the OpenAPI schema and so other methods get 405; POSTs never reach FastAPI.
        api.add_api_route(path, _served_by_asgi, methods=["POST"], summary=f"OpenAI-compatible {path}")
    return GatewayApp(api, InferenceEndpoints(state.holder, services), state)


async def _served_by_asgi() -> None:
    raise ServerError("This route is served by the inference handler.")


async def _probe(services: Services, url: str) -> str | None:
    """None when the worker answers /health with 200, else a short reason."""
    try:
        status, _ = await services.upstream.get(url + "/health", timeout_s=2.0)
    except TimeoutError:
        return "health check timed out"
    except Exception as exc:
        return type(exc).__name__
    return None if status == 200 else f"/health answered {status}"


__all__ = ["ConfigError", "GatewayApp", "create_app"]
