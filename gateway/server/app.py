"""create_app(settings): the gateway as one ASGI application, with no module-level state.

Inference endpoints are served by ``routes.openai.InferenceEndpoints`` directly at the ASGI level (the
hot path); everything else (models, health, metrics, admin) by FastAPI. Both render errors through
``gateway.wire.errors`` and tag every response with ``x-request-id``. What runs at start-up and
shutdown is ``lifecycle.Lifecycle``; the admin API's own port is ``admin_port``.
"""

from __future__ import annotations

from fastapi import FastAPI

from gateway.ops.metrics import Metrics
from gateway.ops.series import LiveSeries
from gateway.ops.settings import Settings
from gateway.ops.stats import LiveStats
from gateway.ops.tracing import Tracing
from gateway.pipeline.config import ConfigError, GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.reload import Reloader
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.server.admin_port import AdminServer, admin_port, include_admin_routes
from gateway.server.console.assets import load_assets
from gateway.server.console.playground import playground_handler
from gateway.server.cors import Cors
from gateway.server.cycle import Receive, Scope, Send
from gateway.server.errors_asgi import RequestIdTagger, install_error_handlers, send_path_error
from gateway.server.lifecycle import EngineFactory, Lifecycle, default_engine
from gateway.server.paths import path_problem
from gateway.server.routes import audio, batches, files, health, messages, models, responses, utility
from gateway.server.routes.openai import InferenceEndpoints
from gateway.server.state import AppState
from gateway.server.websocket_paths import WebSocketPaths
from gateway.upstream.client import UpstreamClient, UpstreamConfig, make_http_client
from gateway.upstream.workers import WorkerTable
from gateway.wire.openapi import ERROR_RESPONSES, placeholder_for
from gateway.wire.protocol import ENDPOINTS


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
        self.websockets = WebSocketPaths(api.router, self._own.keys(), messages.PATHS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        cors = self.cors.policy(scope) if scope["type"] == "http" else None  # None unless on and with an Origin
        if cors is not None:
            await self.cors.serve(*cors, scope, receive, send, self._route)
            return
        await self._route(scope, receive, send)

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            raw = scope.get("raw_path") or b"%"
            # path_problem's own first test, inlined; find, not `in` (see gateway/wire/streaming.py)
            if raw.find(b"%") >= 0 or raw.find(b"/.") >= 0 or raw.find(b"\\") >= 0:
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
        elif scope["type"] == "websocket" and not self.websockets.routed(scope):
            await self.websockets.refuse(scope, send)  # Starlette's answer would be uvicorn's bare 403
            return
        await self._tagged_api(scope, receive, send)


def create_app(
    settings: Settings,
    *,
    registry: PluginRegistry | None = None,
    config: GatewayConfig | None = None,
    engine_factory: EngineFactory | None = default_engine,
) -> GatewayApp:
    """Build the app. ``config`` overrides reading ``settings.config_path``; ``engine_factory=None``
    never starts managed workers (tests, or workers given by URL only)."""
    state = app_state(settings, registry or PluginRegistry(), config)
    console_assets = load_assets()
    playground = playground_handler(state)
    admin_server: AdminServer | None = None
    if settings.admin_port is not None:
        admin_server = admin_port(state, console_assets, playground)
    lifecycle = Lifecycle(state, config, engine_factory, admin_server)
    api = FastAPI(title="vLLM gateway", version="0.1.0", lifespan=lifecycle.lifespan, docs_url=None, redoc_url=None)
    # Starlette answers "/path/" with a 307 to "/path" built from the Host header: a client-chosen
    # host in Location (host-header injection). Routes are exact; a wrong spelling is a 404.
    api.router.redirect_slashes = False
    api.state.gateway = state
    install_error_handlers(api)
    for router in (health.router, models.router, utility.router):
        api.include_router(router)
    for router in (responses.router, files.router, batches.router):
        api.include_router(router, responses=ERROR_RESPONSES)
    for path in ENDPOINTS:
        # Declared for the OpenAPI schema and so other methods get 405; POSTs never reach FastAPI.
        api.add_api_route(
            path,
            placeholder_for(path),
            methods=["POST"],
            summary=f"OpenAI-compatible {path}",
            responses=ERROR_RESPONSES,
        )
    if admin_server is None:  # no port of its own: the admin API behind its token on the public port
        include_admin_routes(api, console_assets, playground, token_required=True)
    return GatewayApp(api, InferenceEndpoints(state.holder, state.services), state)


def app_state(settings: Settings, registry: PluginRegistry, config: GatewayConfig | None) -> AppState:
    """The services and state the app holds for its lifetime (nothing started yet)."""
    upstream_config = config.upstream if config else UpstreamConfig()
    services = Services(
        settings=settings,
        upstream=UpstreamClient(upstream_config, make_http_client(settings.upstream_client, upstream_config)),
        workers=WorkerTable(),
        metrics=Metrics(),
        tracing=Tracing.from_settings(settings),
    )
    holder = RuntimeHolder(registry, services)
    series = LiveSeries(
        services.metrics,
        lambda: {w.url: w.in_flight for w in services.workers.all()},
        interval_s=settings.console_sample_s,
    )
    return AppState(
        settings=settings,
        services=services,
        registry=registry,
        holder=holder,
        reloader=Reloader(holder, settings),
        live_stats=LiveStats(services.metrics),
        live_series=series,
    )


__all__ = ["ConfigError", "GatewayApp", "create_app"]
