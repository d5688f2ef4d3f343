"""``POST /admin/ui/chat``: the console's playground, a chat completion through the real pipeline.

The admin token comes in ``x-admin-token`` (checked as every admin call is); the page may also send a
client key in ``Authorization`` for the plugins that want one (tenancy). The request is then handed to the
``/v1/chat/completions`` handler unchanged but for the path and without the admin token, so it meets the
same plugins, limits, workers and metrics as any client's, and its answer (JSON or SSE) comes back with
the headers the gateway added (``x-cache``, ``x-request-id``, ...) and one only the playground gets:
``x-gateway-worker``, the worker that answered. The playground has its own handler whose proxy adds it,
so a client's request never pays for it and never learns a worker's address. Not on the request path of
clients: only this admin route leads here.
"""

from __future__ import annotations

from typing import Any

from starlette.routing import Route

from gateway.pipeline.context import RequestContext
from gateway.proxy.forward import Proxy, Reply
from gateway.server.admin_auth import check_admin
from gateway.server.routes.openai import InferenceEndpoints
from gateway.server.state import AppState
from gateway.wire.errors import GatewayError
from gateway.wire.protocol import check_single_credentials

PLAYGROUND_PATH = "/admin/ui/chat"
#: Where the playground reads the admin token: ``Authorization`` carries the client key it passes on.
SEND_TOKEN = "'x-admin-token: <GATEWAY_ADMIN_TOKEN>' (here Authorization carries the client key, if any)"
_TARGET = "/v1/chat/completions"

ASGIApp = Any


WORKER_HEADER = "x-gateway-worker"


class WorkerNamingProxy(Proxy):
    """The client path's proxy, and the answer names the worker that produced it (a cache hit has none;
    a stream continued after its worker failed names the first)."""

    async def serve(self, ctx: RequestContext) -> Reply:
        reply = await super().serve(ctx)
        if ctx.worker is not None:
            reply.headers[WORKER_HEADER] = ctx.worker.url
        return reply


def playground_handler(state: AppState) -> InferenceEndpoints:
    """The inference handler the playground hands its requests to: the clients' (same holder, services,
    plugins and limits) with the worker-naming proxy."""
    handler = InferenceEndpoints(state.holder, state.services)
    handler.proxy = WorkerNamingProxy(state.services)
    return handler


class Playground:
    """An ASGI endpoint: admin check, then the inference handler on a copy of the scope."""

    def __init__(self, state: AppState, inference: ASGIApp) -> None:
        self.state = state
        self.inference = inference

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        headers: list[tuple[bytes, bytes]] = list(scope["headers"])
        tokens = [v for k, v in headers if k.lower() == b"x-admin-token"]
        try:
            check_single_credentials(headers)  # x-admin-token twice is a 400, as on every admin route
            presented = tokens[0].decode("latin-1").strip() if tokens else None
            check_admin(self.state.settings.admin_token, presented or None, send_as=SEND_TOKEN)
        except GatewayError as error:
            await _send_error(error, send)
            return
        inner = dict(scope)
        inner["path"] = _TARGET
        inner["raw_path"] = _TARGET.encode()
        inner["headers"] = [(k, v) for k, v in headers if k.lower() != b"x-admin-token"]

        async def send_once(message: dict[str, Any]) -> None:
            # The admin app tags every answer with x-request-id already; the handler's own (the same
            # id when the page sends one) is dropped so the header appears once.
            if message["type"] == "http.response.start":
                message = {**message, "headers": [(k, v) for k, v in message["headers"] if k != b"x-request-id"]}
            await send(message)

        await self.inference(inner, receive, send_once)


def playground_route(state: AppState, inference: ASGIApp) -> Route:
    """The route to add to an app's router (a plain ASGI endpoint: the answer may be a stream)."""
    return Route(PLAYGROUND_PATH, Playground(state, inference), methods=["POST"])


async def _send_error(error: GatewayError, send: Any) -> None:
    body = error.to_json()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    headers += [(k.encode("latin-1"), v.encode("latin-1")) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": body})
