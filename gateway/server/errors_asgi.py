"""The error answers of the FastAPI side (the admin API, models, health, files, batches) and of the
ASGI wrappers in front of plain apps: every one in ``gateway.wire.errors``' OpenAI shape, with the
request's ``x-request-id``."""

from __future__ import annotations

import logging
from collections.abc import MutableMapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from gateway.server.cycle import Receive, Scope, Send, request_id_from
from gateway.server.paths import path_problem
from gateway.server.routes import JSON
from gateway.wire.errors import GatewayError, InvalidRequest, ServerError, error_for_status

log = logging.getLogger("gateway")


def _error_response(error: GatewayError) -> JSON:
    return JSON(error.body(), status_code=error.status_code, headers=error.headers)


def install_error_handlers(api: FastAPI) -> None:
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
