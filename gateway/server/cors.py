"""CORS: which web pages of other origins may call the API, answered in front of every route.

A browser asks first (a preflight: ``OPTIONS`` with ``Origin`` and ``Access-Control-Request-Method``) and
then reads an actual response only if it carries ``Access-Control-Allow-Origin`` for its origin. Both are
answered here, at the ASGI level in front of every route, from the pinned config's ``cors`` section
(``gateway.pipeline.config.CorsConfig``, off while ``allow_origins`` is empty):

- a preflight is answered at once, 204 with the allowed methods and headers, and reaches no route and no
  plugin; one from an origin, or asking for a method or header, the config does not allow is a 403
  (``cors_not_allowed``) without CORS headers, so the browser stops there;
- every actual response to an allowed origin, errors and SSE streams included, gets the CORS headers on
  its ``http.response.start``; a response to another origin gets none (the browser keeps it from the page).

CORS is a browser's rule, not an access control: a request from a disallowed origin still runs (as it would
from curl); keys and tenancy decide who may do what. The admin API and console never get CORS headers: an
admin token is not for web pages of other origins.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from gateway.pipeline.config import CorsConfig
from gateway.pipeline.runtime import RuntimeHolder
from gateway.wire.errors import PermissionDenied

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]
App = Callable[[Scope, Receive, Send], Awaitable[None]]
_NO_CORS = (b"/admin", b"/console")


class CorsPolicy:
    """A ``CorsConfig`` made ready to answer: sets of origins, methods and header names (or prefixes)."""

    def __init__(self, config: CorsConfig) -> None:
        self.config = config
        self.any_origin = "*" in config.allow_origins
        self.origins = frozenset(o.encode("latin-1") for o in config.allow_origins)
        self.methods = frozenset(m.upper() for m in config.allow_methods) | {"OPTIONS"}
        names = [h.lower() for h in config.allow_headers]
        self.headers = frozenset(n for n in names if not n.endswith("*"))
        self.prefixes = tuple(n[:-1] for n in names if n.endswith("*"))
        self.expose = ", ".join(config.expose_headers).encode("latin-1")

    def allows_origin(self, origin: bytes) -> bool:
        return self.any_origin or origin.lower() in self.origins

    def allows_header(self, name: str) -> bool:
        return name in self.headers or (bool(self.prefixes) and name.startswith(self.prefixes))

    def response_headers(self, origin: bytes) -> list[tuple[bytes, bytes]]:
        """Added to an actual response for an allowed origin."""
        headers = [(b"access-control-allow-origin", origin), (b"vary", b"origin")]
        if self.expose:
            headers.append((b"access-control-expose-headers", self.expose))
        return headers

    def preflight(self, origin: bytes, method: bytes, requested: bytes) -> list[tuple[bytes, bytes]]:
        """The headers of a preflight's 204; a 403 naming what the config does not allow."""
        if not self.allows_origin(origin):
            raise _refused(f"The origin '{origin.decode('latin-1')[:200]}' may not call this API from a web page.")
        wanted = method.decode("latin-1").upper()
        if wanted not in self.methods:
            raise _refused(f"Cross-origin requests may not use the method '{wanted[:20]}' here.")
        names = [n.strip().lower() for n in requested.decode("latin-1").split(",") if n.strip()]
        for name in names:
            if not self.allows_header(name):
                raise _refused(f"Cross-origin requests may not send the header '{name[:100]}' here.")
        return [
            (b"access-control-allow-origin", origin),
            (b"access-control-allow-methods", ", ".join(sorted(self.methods)).encode("latin-1")),
            (b"access-control-allow-headers", ", ".join(names).encode("latin-1")),
            (b"access-control-max-age", b"%d" % self.config.max_age_s),
            (b"vary", b"origin, access-control-request-method, access-control-request-headers"),
        ]


def _refused(message: str) -> PermissionDenied:
    return PermissionDenied(message, code="cors_not_allowed")


class Cors:
    """The CORS answer in front of ``app``, following the live config (rebuilt only when it changes)."""

    def __init__(self, holder: RuntimeHolder, send_error: Callable[[PermissionDenied, Scope, Send], Awaitable[None]]):
        self.holder = holder
        self.send_error = send_error
        self._policy: CorsPolicy | None = None

    def policy(self, scope: Scope) -> tuple[CorsPolicy, bytes] | None:
        """The policy and the request's ``Origin`` when CORS applies to it, else None (cheap when off)."""
        if not self.holder.loaded:
            return None
        config = self.holder.current.config.cors
        if not config.allow_origins or scope["path"].encode("utf-8", "replace").startswith(_NO_CORS):
            return None
        origin = next((v for k, v in scope["headers"] if k == b"origin"), None)
        if origin is None:
            return None
        policy = self._policy
        if policy is None or policy.config is not config:
            policy = self._policy = CorsPolicy(config)
        return policy, origin

    async def serve(
        self, policy: CorsPolicy, origin: bytes, scope: Scope, receive: Receive, send: Send, app: App
    ) -> None:
        headers = dict(scope["headers"])
        method = headers.get(b"access-control-request-method")
        if scope["method"] == "OPTIONS" and method is not None:
            try:
                answer = policy.preflight(origin, method, headers.get(b"access-control-request-headers", b""))
            except PermissionDenied as refused:
                await self.send_error(refused, scope, send)
                return
            await send({"type": "http.response.start", "status": 204, "headers": answer})
            await send({"type": "http.response.body", "body": b""})
            return
        if not policy.allows_origin(origin):
            await app(scope, receive, send)
            return
        extra = policy.response_headers(origin)

        async def send_with_cors(message: MutableMapping[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        await app(scope, receive, send_with_cors)
