"""The Responses API: ``POST /v1/responses``, ``GET``/``DELETE /v1/responses/{id}``,
``GET /v1/responses/{id}/input_items`` and ``POST /v1/responses/{id}/cancel``.

A Responses request is translated into a chat completions request (``gateway.wire.responses_request``)
and runs the same path as one: the pinned snapshot's plugins see the expanded conversation (safety
screens every text the model will read, tenancy charges it, the cache may answer it, guided JSON
enforces ``text.format``, routing picks the worker by it), then a worker answers. The chat answer, or its
SSE stream chunk by chunk, comes back as a Response object or OpenAI's Responses events. Stored
responses live in Redis (``gateway.server.responses_store``), scoped by tenant.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Path, Request

from gateway.pipeline.config import LimitsConfig, ResponsesConfig
from gateway.pipeline.runtime import RuntimeSnapshot
from gateway.proxy.forward import Proxy, Reply
from gateway.proxy.responses_turn import ResponsesTurn
from gateway.proxy.translated_turn import chat_context
from gateway.server.responses_store import ResponseStore, not_found
from gateway.server.routes import JSON
from gateway.server.routes.openai import (
    _WATCH_AFTER_S,
    InferenceEndpoints,
    Receive,
    Scope,
    Send,
)
from gateway.server.state import AppState
from gateway.wire.allowlist import ParamAllowList
from gateway.wire.errors import InvalidRequest, ServerError, model_not_found
from gateway.wire.openapi import RESPONSES_CREATE_DOC
from gateway.wire.protocol import ENDPOINTS, check_request, header_dict, parse_body
from gateway.wire.responses_items import output_as_input
from gateway.wire.responses_request import chat_request, parse_request

router = APIRouter()
log = logging.getLogger("gateway.access")
_CHAT = ENDPOINTS["/v1/chat/completions"]
_EXTRAS_KEY = "responses"
AllowListOf = Callable[[LimitsConfig], ParamAllowList]


class ResponsesService:
    """What the routes share for the app's lifetime: the proxy (stateless) and the store."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.proxy = Proxy(state.services)
        self.store = ResponseStore(state.services)

    @staticmethod
    def of(request: Request) -> ResponsesService:
        return ResponsesService.of_state(request.app.state.gateway)

    @staticmethod
    def of_state(state: AppState) -> ResponsesService:
        service: ResponsesService | None = state.extras.get(_EXTRAS_KEY)
        if service is None:
            service = state.extras[_EXTRAS_KEY] = ResponsesService(state)
        return service

    def config(self) -> ResponsesConfig:
        if not self.state.holder.loaded:
            raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)
        return self.state.holder.current.config.responses

    # -- create ----------------------------------------------------------------------------------

    async def create(
        self,
        body: bytes,
        headers: dict[str, str],
        request_id: str,
        started: float,
        allow: AllowListOf,
        record: dict[str, Any],
    ) -> Reply:
        """One ``POST /v1/responses`` body: a whole JSON reply (or error), or the translated stream."""
        config = self.config()
        req = parse_request(parse_body(body))
        scope = await self.store.scope_of(headers)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = await self.store.load(config, scope, req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, param="previous_response_id")
            history = [*previous["input_items"], *output_as_input(previous["response"]["output"])]
        pin = contextlib.ExitStack()
        try:
            snapshot: RuntimeSnapshot = pin.enter_context(self.state.holder.pin())
            model = snapshot.models.resolve(req.model)
            if model is None:
                raise model_not_found(req.model)
            chat = chat_request(req, model.upstream_name, history)
            allow(snapshot.config.limits).check(_CHAT.name, chat)
            check_request(_CHAT, chat)
            ctx = chat_context(
                api="responses",
                request_id=request_id,
                chat=chat,
                headers=headers,
                model=model,
                requested_model=req.model,
                snapshot=snapshot,
                started=started,
            )
            conversation = [*history, *req.input_items]  # what the response answers: stored as its input

            async def save(response: dict[str, Any]) -> None:
                await self.store.save(config, scope, response, conversation)

            turn = ResponsesTurn(self.proxy, self.state.services.metrics, req, ctx, save if req.store else None)
            record["turn"] = True  # from here on the turn records its own metrics and access log line
            return await turn.reply(pin)
        finally:
            pin.close()

    # -- stored responses ----------------------------------------------------------------------------

    async def stored(self, request: Request, response_id: str) -> tuple[ResponsesConfig, str, dict[str, Any]]:
        config = self.config()
        scope = await self.store.scope_of(header_dict(request.scope["headers"]))
        stored = await self.store.load(config, scope, response_id)
        if stored is None:
            raise not_found(response_id)
        return config, scope, stored


#: The id format, documented (not enforced here: an id of another format is as unknown as any, a 404).
ResponseId = Annotated[str, Path(json_schema_extra={"pattern": "^resp_[0-9a-f]{48}$"})]


@router.post("/v1/responses", openapi_extra=RESPONSES_CREATE_DOC)
async def create_response() -> None:
    """Documents the route (and makes other methods a 405); POSTs are served by ``ResponsesEndpoint``."""
    raise ServerError("This route is served by the Responses handler.")


class ResponsesEndpoint(InferenceEndpoints):
    """ASGI app for ``POST /v1/responses``, served like the inference endpoints (no web framework on the
    hot path): the same body limit, request ids, disconnect watch, JSON and SSE senders and error shape."""

    def __init__(self, state: AppState) -> None:
        super().__init__(state.holder, state.services)
        self.service = ResponsesService.of_state(state)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        request_id = self.request_ids(raw_headers)
        state: dict[str, Any] = {"status": 0, "model": "-", "sent": False, "finished": False}
        task = asyncio.current_task()
        assert task is not None
        watcher: asyncio.TimerHandle | None = None
        try:
            body = await self._read_body(raw_headers, receive)
            watcher = asyncio.get_running_loop().call_later(_WATCH_AFTER_S, self._start_watcher, receive, task, state)
            headers = header_dict(raw_headers)
            reply = await self.service.create(body, headers, request_id, started, self._allow_list, state)
            await self._send_reply(reply, request_id, send, state)
        except BaseException as exc:  # _answer_failure raises again what it does not answer
            await self._answer_failure(exc, request_id, send, state)
        finally:
            self._stop_watching(watcher, state)
            if not state.get("turn"):  # refused before it became a turn (bad body, unknown id or model, 401)
                self.metrics.requests.labels("-", "responses", str(state["status"])).inc()


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: ResponseId) -> JSON:
    if request.query_params.get("stream") in ("true", "True", "1"):
        raise InvalidRequest(
            "Streaming a stored response back is only for background responses, which this gateway does not run.",
            param="stream",
            code="unsupported_parameter",
        )
    _, _, stored = await ResponsesService.of(request).stored(request, response_id)
    return JSON(stored["response"])


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: ResponseId) -> JSON:
    service = ResponsesService.of(request)
    config = service.config()
    scope = await service.store.scope_of(header_dict(request.scope["headers"]))
    if not await service.store.delete(config, scope, response_id):
        raise not_found(response_id)
    return JSON({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: ResponseId) -> JSON:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
    raw_limit = query.get("limit", "20")
    if not raw_limit.isdigit() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("'limit' must be an integer from 1 to 100.", param="limit")
    _, _, stored = await ResponsesService.of(request).stored(request, response_id)
    items: list[dict[str, Any]] = stored["input_items"]
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"'after' names no input item of response '{response_id}'.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[: int(raw_limit)]
    return JSON(
        {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(items) > len(page),
        }
    )


@router.post("/v1/responses/{response_id}/cancel")
async def cancel_response(request: Request, response_id: ResponseId) -> JSON:
    await ResponsesService.of(request).stored(request, response_id)  # 404 for an unknown or foreign id
    raise InvalidRequest(
        f"Only responses created with background=true can be cancelled; this gateway does not run background "
        f"responses, so '{response_id}' finished before its creation returned.",
        param="response_id",
        code="not_cancellable",
    )
