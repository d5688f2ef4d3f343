"""The admin API on a port of its own (``settings.admin_port``), or mounted on the public app without one.

On its own port it is a second FastAPI app and uvicorn server on the same event loop, sharing the app's
state, so a reload through it changes what the public port serves; the public port then has no admin
routes at all, so no Host header, path trick or proxy header can reach them there. The admin port itself
answers only IP literals, ``localhost`` and ``GATEWAY_ADMIN_HOSTS`` in ``Host`` (``admin_hosts``: DNS
rebinding).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI

from gateway.server.admin_hosts import HostGuard, host_names
from gateway.server.console.playground import playground_route
from gateway.server.console.routes import console_router
from gateway.server.errors_asgi import PathGuard, RequestIdTagger, install_error_handlers
from gateway.server.front_door import http_protocol
from gateway.server.routes import admin, admin_batches, admin_views, health, responses
from gateway.server.state import AppState

log = logging.getLogger("gateway")


def include_admin_routes(api: FastAPI, assets: Any, playground: Any, *, token_required: bool) -> None:
    """The admin API, the console (its page asks for the token itself when ``token_required`` is off:
    it holds no data) and the playground."""
    api.include_router(admin.router)
    api.include_router(admin_views.router)
    api.include_router(responses.admin_router)
    api.include_router(admin_batches.router)
    api.include_router(console_router(assets, token_required=token_required))
    api.router.routes.append(playground_route(api.state.gateway, playground))


def admin_port(state: AppState, assets: Any, playground: Any) -> AdminServer:
    """The admin API as its own app on ``settings.admin_port`` (with ``/ready`` and ``/metrics`` in full)."""
    settings = state.settings
    api = FastAPI(title="vLLM gateway admin", docs_url=None, redoc_url=None, openapi_url=None)
    api.router.redirect_slashes = False
    api.state.gateway = state
    setattr(api.state, health.ADMIN_VIEW, True)
    install_error_handlers(api)
    api.include_router(health.router)
    include_admin_routes(api, assets, playground, token_required=False)
    assert settings.admin_port is not None
    return AdminServer(
        HostGuard(PathGuard(RequestIdTagger(api)), host_names(settings.admin_host_names())),
        settings.host,
        settings.admin_port,
        keepalive_timeout_s=settings.keepalive_timeout_s,
        http=http_protocol(settings),
        options=settings.server_options(),
    )


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
        options: dict[str, Any],
    ) -> None:
        self.app, self.host, self.port = app, host, port
        self.options = options  # Settings.server_options: whose X-Forwarded-* count, and no server header
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
            **self.options,
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
