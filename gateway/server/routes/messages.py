"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

A Messages request is translated into a chat completions request (``gateway.wire.anthropic_request``) and
runs the same path as one (``gateway.proxy.messages_turn``): the plugins read the one body they know, the
worker answers chat, and the answer or its stream comes back in Anthropic's shapes. Every error on these
routes, the gateway's or a worker's, is rendered in Anthropic's shape (``gateway.wire.errors.anthropic_*``)
from the one error tree. The key may come as ``x-api-key`` (what Anthropic's SDK sends) or as
``Authorization: Bearer``; the plugins see it as the latter. ``anthropic-version`` and ``anthropic-beta``
are accepted and need no answer: the gateway speaks one version of the API.

``count_tokens`` generates nothing, so, like ``/tokenize``, it does not run the request pipeline: the caller
passes the plugins' ``on_models`` hook (tenancy's key check and allowed models) and ``on_side_request`` as a
``/tokenize`` (request limits, size and count bounds), and a worker of the model counts the translated
conversation with its own chat template.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import orjson

from gateway.ops.metrics import STATUS_LABELS
from gateway.pipeline.plugin import SideCall
from gateway.pipeline.runtime import RuntimeSnapshot
from gateway.proxy.forward import JSONReply, Reply
from gateway.proxy.messages_turn import MessagesTurn
from gateway.proxy.translated_turn import chat_context
from gateway.server.cycle import Receive, RequestCycle, Scope, Send, send_json
from gateway.server.routes.models import model_card
from gateway.server.routes.openai import _WATCH_AFTER_S, InferenceEndpoints
from gateway.server.routes.utility import call_worker
from gateway.server.state import AppState
from gateway.wire.anthropic_request import chat_request, parse_request, template_kwargs
from gateway.wire.errors import (
    BadGateway,
    GatewayError,
    InvalidRequest,
    MethodNotAllowed,
    ServerError,
    anthropic_json,
    anthropic_sse,
    endpoint_not_served,
    from_upstream,
    model_not_found,
)
from gateway.wire.media_urls import check_media_urls, check_request_media
from gateway.wire.protocol import ENDPOINTS, check_content_type, check_request, header_dict, parse_body

MESSAGES = "/v1/messages"
COUNT_TOKENS = "/v1/messages/count_tokens"
PATHS = frozenset({MESSAGES, COUNT_TOKENS})
_CHAT = ENDPOINTS["/v1/chat/completions"]


def anthropic_headers(raw: list[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's headers as plugins see them, with an ``x-api-key`` given as ``Authorization: Bearer``
    (the one header tenancy reads). Two different keys in the two headers are refused: one checked and
    the other used is how a credential gets past a check."""
    headers = header_dict(raw)
    key = headers.get("x-api-key")
    if key is not None:
        bearer = f"Bearer {key.strip()}"
        given = headers.get("authorization")
        if given is not None and given.strip() != bearer:
            raise InvalidRequest(
                "The request has an 'x-api-key' and an 'authorization' header with different keys; send one.",
                param="x-api-key",
                code="duplicate_credentials",
            )
        headers["authorization"] = bearer
    return headers


def token_count(answer: bytes) -> int:
    """The ``count`` of a worker's ``/tokenize`` answer. An answer without one (not JSON, not an object, a
    count that is no non-negative integer) is the worker's failure, a 502: not the gateway's 500, nor an
    ``input_tokens`` the client cannot read as a number."""
    try:
        payload = orjson.loads(answer)
    except orjson.JSONDecodeError:
        payload = None
    count = payload.get("count") if isinstance(payload, dict) else None
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise BadGateway("The model worker's /tokenize answer has no token count.", code="upstream_error")
    return count


class MessagesEndpoint(InferenceEndpoints):
    """ASGI app for the two Messages paths (any method: a wrong one is a 405 in Anthropic's shape), served
    like the inference endpoints: the same body limit, request ids, disconnect watch and senders."""

    def __init__(self, state: AppState) -> None:
        super().__init__(state.holder, state.services)
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_headers: list[tuple[bytes, bytes]] = scope["headers"]
        cycle = RequestCycle(self.request_ids(raw_headers), time.perf_counter(), task=asyncio.current_task())
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"Method {scope['method']} is not allowed on {scope['path']}.")
            check_content_type(raw_headers)
            body = await self._read_body(raw_headers, receive)
            self._watch(receive, cycle, _WATCH_AFTER_S)
            headers = anthropic_headers(raw_headers)
            if scope["path"] == COUNT_TOKENS:
                reply: Reply = await self.count_tokens(parse_body(body), headers)
            else:
                reply = await self.create(parse_body(body), headers, cycle)
            await self._send_reply(reply, send, cycle)
        except BaseException as exc:  # _answer_failure raises again what it does not answer
            await self._answer_failure(exc, send, cycle)
        finally:
            self._stop_watching(cycle)
            if not cycle.self_recorded:  # refused before it became a turn, or count_tokens
                self.metrics.requests.labels(cycle.model, "messages", STATUS_LABELS[cycle.status]).inc()

    def _snapshot(self, pin: contextlib.ExitStack) -> RuntimeSnapshot:
        if not self.holder.loaded:
            raise ServerError("The gateway has no config loaded yet.", code="not_ready", status=503)
        return pin.enter_context(self.holder.pin())

    async def create(self, body: dict[str, Any], headers: dict[str, str], cycle: RequestCycle) -> Reply:
        """One ``POST /v1/messages``: a whole JSON reply (or error), or the translated stream."""
        req = parse_request(body)
        pin = contextlib.ExitStack()
        try:
            snapshot = self._snapshot(pin)
            model = snapshot.models.resolve(req.model)
            if model is None:
                await snapshot.pipeline.run_models(headers, [])  # who is asking comes first (a 401)
                raise model_not_found(req.model)
            cycle.model = model.name
            chat = chat_request(req, model.upstream_name)
            self._allow_list(snapshot.config.limits).check(_CHAT.name, chat)
            check_request(_CHAT, chat)
            check_request_media(_CHAT.name, chat)
            ctx = chat_context(
                api="messages",
                request_id=cycle.request_id,
                chat=chat,
                headers=headers,
                model=model,
                requested_model=req.model,
                snapshot=snapshot,
                started=cycle.started,
            )
            cycle.ctx = ctx  # the disconnect watch marks it: a client that hangs up still pays (billing)
            turn = MessagesTurn(self.proxy, self.metrics, ctx, req.model)
            cycle.self_recorded = True  # from here on the turn records its own metrics and access log line
            return await turn.reply(pin)
        finally:
            pin.close()

    async def count_tokens(self, body: dict[str, Any], headers: dict[str, str]) -> JSONReply:
        """``{"input_tokens": n}``: the translated conversation counted by a worker of the model."""
        req = parse_request(body, count_tokens=True)
        with contextlib.ExitStack() as pin:
            snapshot = self._snapshot(pin)
            model = snapshot.models.resolve(req.model)
            if model is None:
                await snapshot.pipeline.run_models(headers, [])
                raise model_not_found(req.model)
            card = model_card(req.model, model, int(snapshot.loaded_at))
            if not await snapshot.pipeline.run_models(headers, [card]):
                raise model_not_found(req.model)  # this caller may not use it: as if it did not exist
            chat = chat_request(req, model.upstream_name)
            tokenize = {"model": chat["model"], "messages": chat["messages"], "add_generation_prompt": True}
            if chat.get("continue_final_message"):  # a prefill: counted as the answer will continue it
                tokenize.update(continue_final_message=True, add_generation_prompt=False)
            if "tools" in chat:
                tokenize["tools"] = chat["tools"]
            if kwargs := template_kwargs(chat):  # thinking disabled, or an effort: rendered as the answer will be
                tokenize["chat_template_kwargs"] = kwargs
            self._allow_list(snapshot.config.limits).check("tokenize", tokenize)
            check_media_urls(chat["messages"])
            # A count is a /tokenize on a worker: metered and bounded as one (request limits, sizes)
            await snapshot.pipeline.run_side(
                SideCall("tokenize", headers, model.name, tokenize, orjson.dumps(tokenize))
            )
            urls = self.services.workers.expand(snapshot.models.worker_urls[model.name])
            status, answer = await call_worker(self.services, urls, "/tokenize", tokenize)
        if status != 200:
            raise endpoint_not_served(status, answer, req.model, "messages/count_tokens") or from_upstream(
                status, answer
            )
        return JSONReply(200, orjson.dumps({"input_tokens": token_count(answer)}))

    @staticmethod
    async def _send_error(error: GatewayError, send: Send, cycle: RequestCycle) -> None:
        """The error in Anthropic's shape: a JSON body, or after SSE headers one ``error`` event."""
        cycle.error = (error.type, error.code)
        if cycle.sent:
            cycle.finished = True
            await send({"type": "http.response.body", "body": anthropic_sse(error.body()["error"]), "more_body": False})
            return
        await send_json(send, cycle, error.status_code, anthropic_json(error), error.headers)
