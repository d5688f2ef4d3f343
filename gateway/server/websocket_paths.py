"""A well-formed WebSocket handshake to a path with no WebSocket route, answered as that path is over HTTP.

Only ``/v1/responses`` has a WebSocket route (its own ``unsupported_transport`` refusal). Starlette's
router answers a handshake anywhere else by closing before accepting, which uvicorn turns into an empty
``text/plain`` 403: the one answer of the public port not in the error shape. Here such a handshake gets
the JSON error of what the path is over HTTP: a path no route serves is the same 404 ``Unknown route``
an HTTP request gets, a path a route serves (whatever its methods) a 400 ``unsupported_transport``, a
path the app refuses as such (``gateway.server.paths``) that 400; in Anthropic's shape on the Messages
paths. It is sent as the handshake's HTTP answer (the ASGI WebSocket Denial Response, which uvicorn
sends with ``connection: close``). Only WebSocket scopes come here: no HTTP request pays for it.
"""

from __future__ import annotations

from collections.abc import Collection

from starlette.routing import Match, Router

from gateway.server.cycle import Scope, Send, request_id_from
from gateway.server.paths import path_problem
from gateway.wire.errors import GatewayError, InvalidRequest, NotFound, anthropic_json


class WebSocketPaths:
    """Which handshakes the FastAPI side has a WebSocket route for, and the answer to the others.

    ``own_paths`` are the paths served outside FastAPI (Messages, audio); ``anthropic_paths`` those of
    them whose errors are in Anthropic's shape."""

    def __init__(self, router: Router, own_paths: Collection[str], anthropic_paths: Collection[str]) -> None:
        self.router = router
        self.own_paths = own_paths
        self.anthropic_paths = anthropic_paths

    def routed(self, scope: Scope) -> bool:
        """True when a WebSocket route takes ``scope`` (read at each handshake: routes added later count)."""
        return any(route.matches(scope)[0] is Match.FULL for route in self.router.routes)

    def served_over_http(self, scope: Scope) -> bool:
        """True when some route serves the path over HTTP, with whatever method."""
        if scope["path"] in self.own_paths:
            return True
        as_http = {**scope, "type": "http", "method": "GET"}
        return any(route.matches(as_http)[0] is not Match.NONE for route in self.router.routes)

    def error_for(self, scope: Scope) -> GatewayError:
        path: str = scope["path"]
        problem = path_problem(scope)
        if problem is not None:
            return problem
        if not self.served_over_http(scope):
            return NotFound(f"Unknown route GET {path}.")  # what the same GET over HTTP is answered
        return InvalidRequest(
            f"WebSocket connections are not served on {path}; send the request over HTTP.",
            code="unsupported_transport",
        )

    async def refuse(self, scope: Scope, send: Send) -> None:
        """Answer the handshake with ``error_for(scope)``; where the server cannot send an HTTP answer to
        a handshake, close it as Starlette would."""
        if "websocket.http.response" not in scope.get("extensions", {}):
            await send({"type": "websocket.close", "code": 1000, "reason": ""})
            return
        error = self.error_for(scope)
        body = anthropic_json(error) if scope["path"] in self.anthropic_paths else error.to_json()
        headers: list[tuple[bytes, bytes]] = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            (b"x-request-id", request_id_from(scope["headers"]).encode("ascii")),
        ]
        await send({"type": "websocket.http.response.start", "status": error.status_code, "headers": headers})
        await send({"type": "websocket.http.response.body", "body": body})
