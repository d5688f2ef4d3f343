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

import orjson
from fastapi import APIRouter, Depends, Path, Request, WebSocket
from fastapi.responses import Response

from gateway.ops.metrics import STATUS_LABELS
from gateway.pipeline.config import LimitsConfig, ModelConfig, ResponsesConfig
from gateway.pipeline.plugin import SideCall, SideRoute
from gateway.pipeline.runtime import RuntimeSnapshot
from gateway.proxy.forward import Proxy, Reply
from gateway.proxy.responses_fit import TRUNCATED_HEADER, fit_history
from gateway.proxy.responses_turn import ResponsesTurn
from gateway.proxy.translated_turn import chat_context
from gateway.server.admin_auth import require_admin
from gateway.server.cycle import Receive, RequestCycle, Scope, Send
from gateway.server.responses_store import Chain, ResponseStore, not_found
from gateway.server.routes import JSON
from gateway.server.routes.models import model_card
from gateway.server.routes.openai import _WATCH_AFTER_S, InferenceEndpoints
from gateway.server.state import AppState
from gateway.wire.allowlist import ParamAllowList
from gateway.wire.errors import InvalidRequest, ServerError, model_not_found
from gateway.wire.openapi import RESPONSES_CREATE_DOC
from gateway.wire.protocol import ENDPOINTS, check_request, decimal, header_dict, parse_body
from gateway.wire.responses_chat import chat_request, items_as_seen
from gateway.wire.responses_request import ResponsesRequest, parse_request

router = APIRouter()
#: ``GET /admin/responses/usage`` (admin token): stored bytes per tenant, for operators and the console.
admin_router = APIRouter(prefix="/admin", dependencies=[Depends(require_admin)], include_in_schema=False)
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
        cycle: RequestCycle,
        allow: AllowListOf,
    ) -> Reply:
        """One ``POST /v1/responses`` body: a whole JSON reply (or error), or the translated stream."""
        config = self.config()
        req = parse_request(parse_body(body))
        pin = contextlib.ExitStack()
        try:
            snapshot: RuntimeSnapshot = pin.enter_context(self.state.holder.pin())
            model = snapshot.models.resolve(req.model)
            if req.previous_response_id is not None:
                await self._admit_continuation(snapshot, headers, req, model)
            scope = await self.store.scope_of(headers)
            chain = await self._conversation(config, scope, req)
            history = chain.items
            if model is None:
                raise model_not_found(req.model)
            dropped = 0
            if req.truncation == "auto" and history:
                history, dropped = await self._fit(snapshot, model, req, history)
            chat = chat_request(req, model.upstream_name, history)
            allow(snapshot.config.limits).check(_CHAT.name, chat)
            check_request(_CHAT, chat)
            ctx = chat_context(
                api="responses",
                request_id=cycle.request_id,
                chat=chat,
                headers=headers,
                model=model,
                requested_model=req.model,
                snapshot=snapshot,
                started=cycle.started,
            )
            cycle.ctx = ctx  # the disconnect watch marks it: a client that hangs up still pays (billing)
            if dropped:  # said on the answer (and in the access log): the worker read fewer turns than stored
                ctx.response_headers[TRUNCATED_HEADER] = str(dropped)
                ctx.log["truncated_items"] = dropped

            async def save(response: dict[str, Any]) -> None:
                # the input as the worker saw it (redactions applied), never the raw request
                await self.store.save(config, scope, response, items_as_seen(req, history, ctx.body), chain)

            turn = ResponsesTurn(self.proxy, self.state.services.metrics, req, ctx, save if req.store else None)
            cycle.self_recorded = True  # from here on the turn records its own metrics and access log line
            return await turn.reply(pin)
        finally:
            pin.close()

    @staticmethod
    async def _admit_continuation(
        snapshot: RuntimeSnapshot, headers: dict[str, str], req: ResponsesRequest, model: ModelConfig | None
    ) -> None:
        """Refuse a caller the turn's ``on_request`` would refuse anyway before its conversation is read
        and (``truncation: "auto"``) counted by a worker: that work scales with the stored chain, and a
        refused request must not buy it. The caller goes through ``on_models`` for the model, as on
        ``/tokenize`` (tenancy: 401 without a valid key, the model hidden from a key that may not use
        it), then ``on_side_request`` as ``responses.create`` with the turn's chat request without the
        conversation, the least the turn can cost: a check that counts nothing (tenancy: 429 for a key
        or tenant without room even for that). The turn's own admission still counts and reserves it,
        on the conversation as the worker will read it."""
        cards = [] if model is None else [model_card(req.model, model, int(snapshot.loaded_at))]
        visible = await snapshot.pipeline.run_models(headers, cards)  # the caller first (401 without a key)
        if model is None or not visible:
            await snapshot.pipeline.run_side(SideCall("responses.create", headers))
            raise model_not_found(req.model)  # unknown, or this caller may not use it: the same answer
        own = chat_request(req, model.upstream_name, [])
        await snapshot.pipeline.run_side(SideCall("responses.create", headers, model.name, own))

    async def _conversation(self, config: ResponsesConfig, scope: str, req: ResponsesRequest) -> Chain:
        """The stored conversation this turn continues (empty without previous_response_id), after
        refusing a turn the store could not keep: now, rather than after the worker ran."""
        chain = Chain()
        if req.previous_response_id is not None:
            previous = await self.store.load(config, scope, req.previous_response_id)
            if previous is None:
                raise not_found(req.previous_response_id, param="previous_response_id")
            chain = await self.store.chain(config, scope, previous, "previous_response_id")
        _refuse_duplicate_ids(chain.items, req.input_items)
        if req.store:  # what the record will hold at least
            await self.store.check_room(config, scope, len(orjson.dumps(req.input_items)), chain)
        return chain

    async def _fit(
        self, snapshot: RuntimeSnapshot, model: ModelConfig, req: ResponsesRequest, history: list[dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], int]:
        """``truncation: "auto"``: the newest turns of ``history`` that fit the context of a worker of
        ``model`` with room for the answer's ``max_output_tokens`` (at least one token)."""
        urls = [url for url in snapshot.models.worker_urls.get(model.name, []) if not url.startswith("dns://")]
        if not urls:
            return history, 0
        reserve = int(req.sampling.get("max_tokens") or 1)
        return await fit_history(
            self.state.services.upstream,
            urls[0],
            lambda kept: chat_request(req, model.upstream_name, kept),
            history,
            reserve,
        )

    # -- stored responses ----------------------------------------------------------------------------

    async def scope_of(self, request: Request, route: SideRoute) -> str:
        """The caller's scope, after the plugins' ``on_side_request`` metered and bounded it for ``route``
        (tenancy: one request on the key's request limits, a 429 past them; 401 without a valid key)."""
        headers = header_dict(request.scope["headers"])
        if self.state.holder.loaded:
            with self.state.holder.pin() as snapshot:
                await snapshot.pipeline.run_side(SideCall(route, headers))
        return await self.store.scope_of(headers)

    async def stored(
        self, request: Request, response_id: str, route: SideRoute
    ) -> tuple[ResponsesConfig, str, dict[str, Any]]:
        """The caller's stored response (a 404 otherwise), after the caller was metered for ``route``."""
        config = self.config()
        scope = await self.scope_of(request, route)
        stored = await self.store.load(config, scope, response_id)
        if stored is None:
            raise not_found(response_id)
        return config, scope, stored


def _refuse_duplicate_ids(history: list[dict[str, Any]], items: list[dict[str, Any]]) -> None:
    """A 400 for an input item whose id is already in the conversation (as OpenAI answers): ids name the
    items input_items lists and pages by (``after``), so each must be one item."""
    seen = {item.get("id") for item in history}
    for index, item in enumerate(items):
        if item["id"] in seen:
            raise InvalidRequest(
                f"Duplicate item found with id '{item['id']}'. Remove duplicate items from your input (an item "
                "of the previous response is already part of the conversation) and try again.",
                param=f"input[{index}].id",
            )
        seen.add(item["id"])


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
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        cycle = RequestCycle(self.request_ids(raw_headers), time.perf_counter(), task=asyncio.current_task())
        try:
            body = await self._read_body(raw_headers, receive)
            self._watch(receive, cycle, _WATCH_AFTER_S)
            headers = header_dict(raw_headers)
            reply = await self.service.create(body, headers, cycle, self._allow_list)
            await self._send_reply(reply, send, cycle)
        except BaseException as exc:  # _answer_failure raises again what it does not answer
            await self._answer_failure(exc, send, cycle)
        finally:
            self._stop_watching(cycle)
            if not cycle.self_recorded:  # refused before it became a turn (bad body, unknown id or model, 401)
                self.metrics.requests.labels("-", "responses", STATUS_LABELS[cycle.status]).inc()


@router.post("/v1/responses/compact", include_in_schema=False)  # always refused: not an API to fuzz
async def compact_response() -> None:
    """Refused: see docs/responses.md#what-is-supported-and-what-is-not-and-why."""
    raise InvalidRequest(
        "POST /v1/responses/compact is not supported by this gateway: OpenAI's compaction returns an encrypted "
        "item only OpenAI's models can read back. Keep the conversation short with 'truncation': 'auto' (the "
        "oldest turns are dropped to fit the context) or start a new one with the context you need as 'input'.",
        code="unsupported_endpoint",
    )


@router.websocket("/v1/responses")
async def responses_websocket(websocket: WebSocket) -> None:
    """Refused before the handshake completes, with an OpenAI error as the HTTP answer (or, where the
    server cannot send one, a close frame carrying the reason)."""
    error = InvalidRequest(
        "The Responses WebSocket mode is not supported by this gateway; send POST /v1/responses with "
        "'stream': true for the same events over server-sent events.",
        code="unsupported_transport",
    )
    if "websocket.http.response" in websocket.scope.get("extensions", {}):
        body = Response(error.to_json(), status_code=error.status_code, media_type="application/json")
        await websocket.send_denial_response(body)
    else:
        await websocket.close(code=1008, reason="WebSocket mode is not supported; POST /v1/responses with stream")


@router.get("/v1/responses/{response_id}")
async def retrieve_response(request: Request, response_id: ResponseId) -> JSON:
    if request.query_params.get("stream") in ("true", "True", "1"):
        raise InvalidRequest(
            "Streaming a stored response back is only for background responses, which this gateway does not run.",
            param="stream",
            code="unsupported_parameter",
        )
    _, _, stored = await ResponsesService.of(request).stored(request, response_id, "responses.retrieve")
    return JSON(stored["response"])


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: ResponseId) -> JSON:
    service = ResponsesService.of(request)
    config = service.config()
    scope = await service.scope_of(request, "responses.delete")
    if not await service.store.delete(config, scope, response_id):
        raise not_found(response_id)
    return JSON({"id": response_id, "object": "response", "deleted": True})


@router.get("/v1/responses/{response_id}/input_items")
async def list_input_items(request: Request, response_id: ResponseId) -> JSON:
    query = request.query_params
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise InvalidRequest("'order' must be 'asc' or 'desc'.", param="order")
    limit = decimal(query.get("limit", "20"))
    if limit is None or not 1 <= limit <= 100:
        raise InvalidRequest("'limit' must be an integer from 1 to 100.", param="limit")
    service = ResponsesService.of(request)
    config, scope, stored = await service.stored(request, response_id, "responses.input_items")
    items = (await service.store.chain(config, scope, stored, None, output=False)).items
    if order == "desc":
        items = items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [item.get("id") for item in items]
        if after not in ids:
            raise InvalidRequest(f"'after' names no input item of response '{response_id}'.", param="after")
        items = items[ids.index(after) + 1 :]
    page = items[:limit]
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
    # 404 for an unknown or foreign id
    await ResponsesService.of(request).stored(request, response_id, "responses.cancel")
    raise InvalidRequest(
        f"Only responses created with background=true can be cancelled; this gateway does not run background "
        f"responses, so '{response_id}' finished before its creation returned.",
        param="response_id",
        code="not_cancellable",
    )


@admin_router.get("/responses/usage")
async def stored_usage(request: Request) -> JSON:
    """What the Responses store holds per tenant (bytes and responses, expired ones already taken off),
    beside the bounds that apply: the figures an operator sizes Redis by (docs/responses.md#bounds)."""
    service = ResponsesService.of(request)
    config = service.config()
    scopes = await service.store.tenants(config)
    return JSON(
        {
            "max_tenant_bytes": config.max_tenant_bytes,
            "max_response_bytes": config.max_response_bytes,
            "tenants": [
                {
                    "tenant": scope[2:] if scope.startswith("t:") else None,
                    "scope": scope,
                    "bytes": usage.bytes,
                    "responses": usage.responses,
                }
                for scope, usage in scopes
            ],
        }
    )
