"""create_app(settings): the gateway as one ASGI application, with no module-level state.

Inference endpoints are served by ``routes.openai.InferenceEndpoints`` directly at the ASGI level (the
hot path); everything else (models, health, metrics, admin) by FastAPI. Both render errors through
``gateway.wire.errors`` and tag every response with ``x-request-id``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import gc
import logging
import socket
import sys
from collections.abc import AsyncIterator, Callable, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.batch.service import BatchService
from gateway.ops.logs import apply_logging
from gateway.ops.metrics import Metrics
from gateway.ops.series import LiveSeries
from gateway.ops.settings import Settings
from gateway.ops.stats import LiveStats
from gateway.ops.tracing import Tracing
from gateway.pipeline.config import ConfigError, GatewayConfig, load_config
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.reload import Reloader
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.server.console.assets import load_assets
from gateway.server.console.playground import playground_handler, playground_route
from gateway.server.console.routes import console_router
from gateway.server.cors import Cors
from gateway.server.cycle import Receive, Scope, Send, request_id_from
from gateway.server.drain import install_sigterm_drain
from gateway.server.front_door import http_protocol
from gateway.server.paths import path_problem
from gateway.server.routes import (
    JSON,
    admin,
    admin_batches,
    admin_views,
    audio,
    batches,
    files,
    health,
    messages,
    models,
    responses,
    utility,
)
from gateway.server.routes.openai import InferenceEndpoints
from gateway.server.state import AppState
from gateway.upstream.client import UpstreamClient, UpstreamConfig, make_http_client
from gateway.upstream.workers import WorkerTable
from gateway.wire.errors import GatewayError, InvalidRequest, ServerError, error_for_status
from gateway.wire.openapi import ERROR_RESPONSES, placeholder_for
from gateway.wire.protocol import ENDPOINTS

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


# Worker events that mean it is not serving (or stopped trying): worth a warning in the logs.
_BAD_WORKER_EVENTS = frozenset({"exited", "restarting", "restart_failed", "failed"})


def _engine_event_hook(metrics: Metrics) -> Callable[[str, str], None]:
    """The managed workers' ``on_event``: count each event and log it (it must not block or raise)."""

    def on_event(worker: str, event: str) -> None:
        metrics.engine_worker_events.labels(worker, event).inc()
        log.log(logging.WARNING if event in _BAD_WORKER_EVENTS else logging.INFO, "engine worker %s: %s", worker, event)

    return on_event


def _default_engine(state: AppState, config: GatewayConfig) -> Any:
    from gateway.engine.supervisor import EngineManager

    return EngineManager(
        config.managed_workers(),  # with LoRA enabled where a model serves adapters
        models_dir=state.settings.model_dir,
        ready_timeout_s=config.engine.ready_timeout_s,
        on_event=_engine_event_hook(state.services.metrics),
    )


class GatewayApp:
    """The ASGI entry point: inference paths go to the lean handler, the rest to FastAPI."""

    def __init__(self, api: FastAPI, inference: InferenceEndpoints, state: AppState) -> None:
        self.api = api
        self.inference = inference
        self.responses = responses.ResponsesEndpoint(state)
        endpoints = (messages.MessagesEndpoint(state), audio.AudioEndpoints(state.holder, state.services))
        self._own = dict.fromkeys(messages.PATHS, endpoints[0]) | dict.fromkeys(audio.AUDIO_ROUTES, endpoints[1])
        self.state = state
        self._tagged_api = RequestIdTagger(api)
        self.cors = Cors(state.holder, send_path_error)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cors = self.cors.policy(scope) if scope["type"] == "http" else None  # None unless on and with an Origin
        if cors is not None:
            await self.cors.serve(*cors, scope, receive, send, self._route)
            return
        await self._route(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path") or b"%"
            if b"%" in raw or b"/." in raw or b"\\" in raw:  # path_problem's own first test, inlined
                problem = path_problem(scope)
                if problem is not None:
                    await send_path_error(problem, scope, send)
                    return
            if scope["method"] == "POST":
                if scope["path"] in ENDPOINTS:
                    await self.inference(scope, receive, send)
                    return
                if scope["path"] == "/v1/responses":
                    await self.responses(scope, receive, send)
                    return
            own = self._own.get(scope["path"])  # Messages and audio, every method: their own 405 (and shape)
            if own is not None:
                await own(scope, receive, send)
                return
        await self._tagged_api(scope, receive, send)


class PathGuard:
    """``path_problem`` in front of a plain ASGI app (the admin port's)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            problem = path_problem(scope)
            if problem is not None:
                await send_path_error(problem, scope, send)
                return
        await self.app(scope, receive, send)


async def send_path_error(error: GatewayError, scope: Scope, send: Send) -> None:
    body = error.to_json()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
        (b"x-request-id", request_id_from(scope["headers"]).encode("ascii")),
    ]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(
    settings: Settings,
    *,
    registry: PluginRegistry | None = None,
    config: GatewayConfig | None = None,
    engine_factory: EngineFactory | None = _default_engine,
) -> GatewayApp:
    """Build the app. ``config`` overrides reading ``settings.config_path``; ``engine_factory=None``
    never starts managed workers (tests, or workers given by URL only)."""
    upstream_config = config.upstream if config else UpstreamConfig()
    services = Services(
        settings=settings,
        upstream=UpstreamClient(upstream_config, make_http_client(settings.upstream_client, upstream_config)),
        workers=WorkerTable(),
        metrics=Metrics(),
        tracing=Tracing.from_settings(settings),
    )
    registry = registry or PluginRegistry()
    holder = RuntimeHolder(registry, services)
    reloader = Reloader(holder, settings)
    series = LiveSeries(
        services.metrics,
        lambda: {w.url: w.in_flight for w in services.workers.all()},
        interval_s=settings.console_sample_s,
    )
    state = AppState(
        settings=settings,
        services=services,
        registry=registry,
        holder=holder,
        reloader=reloader,
        live_stats=LiveStats(services.metrics),
        live_series=series,
    )
    inference = InferenceEndpoints(state.holder, services)
    playground = playground_handler(state)
    console_assets = load_assets()
    admin_server: AdminServer | None = None

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        initial = config or load_config(settings.config_path)
        restore_sigterm = None
        if engine_factory is not None and settings.managed_workers and initial.engine.workers:
            state.engine = engine_factory(state, initial)
            await state.engine.start()
        try:
            await state.holder.load(initial)
            apply_logging(initial.logging, override=settings.log_level)
            if initial.batches.enabled:  # a restart resumes every replica's unfinished batches from Redis
                batch_service = state.extras[files.SERVICE_KEY] = BatchService(state.holder, services, initial.batches)
                batch_service.runner.start()
            services.workers.start_health_checks(
                lambda url: _probe(services, url), state.holder.current.config.upstream.health_interval_s
            )
            reloader.start(watch=config is None)  # watch the file only when the config came from it
            series.start()
            if admin_server is not None:
                await admin_server.start()
            gc.collect()
            gc.freeze()  # start-up objects never need collecting; keeps GC pauses short under load
            gc.set_threshold(*settings.gc_thresholds)
            restore_sigterm = install_sigterm_drain(state, settings.drain_delay_s)
            if state.engine is not None:  # a person ran `make run`: tell them where to point a client
                sys.stderr.write(ready_banner(settings, initial) + "\n")
            yield
        finally:
            state.draining = True
            if restore_sigterm is not None:
                restore_sigterm()
            await reloader.aclose()
            await series.aclose()
            if files.SERVICE_KEY in state.extras:
                await state.extras[files.SERVICE_KEY].runner.aclose()
            if admin_server is not None:
                await admin_server.stop()
            await state.holder.aclose()
            if state.engine is not None:
                await state.engine.stop()
            await services.aclose()
            if services.tracing is not None:
                await asyncio.to_thread(services.tracing.shutdown)  # flushes, bounded by the exporter timeout

    api = FastAPI(title="vLLM gateway", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    # Starlette answers "/path/" with a 307 to "/path" built from the Host header: a client-chosen
    # host in Location (host-header injection). Routes are exact; a wrong spelling is a 404.
    api.router.redirect_slashes = False
    api.state.gateway = state
    _install_error_handlers(api)
    api.include_router(health.router)
    api.include_router(models.router)
    api.include_router(utility.router)
    api.include_router(responses.router, responses=ERROR_RESPONSES)
    api.include_router(files.router, responses=ERROR_RESPONSES)
    api.include_router(batches.router, responses=ERROR_RESPONSES)
    for path in ENDPOINTS:
        # Declared for the OpenAPI schema and so other methods get 405; POSTs never reach FastAPI.
        api.add_api_route(
            path,
            placeholder_for(path),
            methods=["POST"],
            summary=f"OpenAI-compatible {path}",
            responses=ERROR_RESPONSES,
        )
    if settings.admin_port is None:
        api.include_router(admin.router)
        api.include_router(admin_views.router)
        api.include_router(responses.admin_router)
        api.include_router(admin_batches.router)
        api.include_router(console_router(console_assets, token_required=True))
        api.router.routes.append(playground_route(state, playground))
    else:
        # Its own app, not a filter on the public one: the public port has no admin routes at all, so
        # no Host header, path trick or proxy header can reach them there.
        admin_api = FastAPI(title="vLLM gateway admin", docs_url=None, redoc_url=None, openapi_url=None)
        admin_api.router.redirect_slashes = False
        admin_api.state.gateway = state
        setattr(admin_api.state, health.ADMIN_VIEW, True)  # /ready and /metrics in full here
        _install_error_handlers(admin_api)
        admin_api.include_router(admin.router)
        admin_api.include_router(admin_views.router)
        admin_api.include_router(responses.admin_router)
        admin_api.include_router(admin_batches.router)
        admin_api.include_router(health.router)
        # The console's page holds no data and asks for the token itself: served here without one.
        admin_api.include_router(console_router(console_assets, token_required=False))
        admin_api.router.routes.append(playground_route(state, playground))
        admin_server = AdminServer(
            PathGuard(RequestIdTagger(admin_api)),
            settings.host,
            settings.admin_port,
            keepalive_timeout_s=settings.keepalive_timeout_s,
            http=http_protocol(settings),
            proxy=settings.proxy_options(),
        )
    return GatewayApp(api, inference, state)


class RequestIdTagger:
    """Adds ``x-request-id`` to every response of a plain ASGI app."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = request_id_from(scope["headers"]).encode("ascii")

        async def send_with_id(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


class _QuietServer(uvicorn.Server):
    """A uvicorn server that leaves signals to the main server (which owns shutdown)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class AdminServer:
    """The admin API on ``settings.admin_port``: a second uvicorn server on the same event loop, started
    and stopped by the main app's lifespan, sharing its state (so a reload changes what the public port
    serves). With several worker processes only the first to bind the port serves it; the others keep
    following the config file (watcher) and, when configured, the Redis config channel."""

    def __init__(
        self,
        app: Any,
        host: str,
        port: int,
        *,
        keepalive_timeout_s: int,
        http: Any = "h11",
        proxy: dict[str, Any] | None = None,
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.proxy = proxy or {"proxy_headers": False}  # Settings.proxy_options: whose X-Forwarded-* count
        self.keepalive_timeout_s = keepalive_timeout_s
        self.http = http  # the front door's protocol, so the admin port has the same bounds
        self._server: _QuietServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as exc:
            sock.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            log.info("admin port %d is served by another worker process", self.port)
            return
        config = uvicorn.Config(
            self.app,
            log_config=None,
            access_log=False,
            lifespan="off",
            http=self.http,
            timeout_keep_alive=self.keepalive_timeout_s,
            **self.proxy,
        )
        self._server = _QuietServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="admin-server")
        for _ in range(1000):  # bounded: 10 s
            if self._server.started or self._task.done():
                break
            await asyncio.sleep(0.01)
        if self._task.done():
            self._task.result()  # start-up failed: surface why

    async def stop(self) -> None:
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(self._task, timeout=10)


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


def ready_banner(settings: Settings, config: GatewayConfig) -> str:
    """What a person who just ran `make run` needs: where to point a client, and how."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base_url = f"http://{host}:{settings.port}/v1"
    model = config.models[0].name
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello"}}]}}'
    sdk = (
        f"from openai import OpenAI; c = OpenAI(base_url='{base_url}', api_key='unused'); "
        f"print(c.chat.completions.create(model='{model}', "
        "messages=[{'role': 'user', 'content': 'Say hello'}]).choices[0].message.content)"
    )
    return (
        f"ready: OpenAI-compatible API at {base_url}\n"
        f"  curl -s {base_url}/chat/completions -H 'content-type: application/json' -d '{body}'\n"
        f'  python -c "{sdk}"'
    )
