"""One ``POST /v1/responses`` after it was translated: the chat request runs through the ``Proxy`` like any
other (every plugin, the chosen worker), and its answer comes back as a Response object or, for a stream,
as OpenAI's Responses events translated chunk by chunk (``gateway.wire.responses_events``). The finished
response is handed to a ``save`` callable (the route's store) before ``response.completed`` is sent.
Each turn records its own metrics and access log line, as the inference endpoints do
(``gateway.proxy.translated_turn``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from gateway.ops.metrics import Metrics
from gateway.pipeline.context import RequestContext
from gateway.proxy.forward import JSONReply, Proxy
from gateway.proxy.translated_turn import TranslatedTurn
from gateway.wire.responses_chat import instructions_as_seen
from gateway.wire.responses_events import EventStream
from gateway.wire.responses_items import new_id
from gateway.wire.responses_output import response_from_chat, response_object
from gateway.wire.responses_request import ResponsesRequest


class ResponsesTurn(TranslatedTurn):
    """One ``POST /v1/responses``: the proxied chat request and its translation back."""

    route = "responses"

    def __init__(
        self,
        proxy: Proxy,
        metrics: Metrics,
        req: ResponsesRequest,
        ctx: RequestContext,
        save: Callable[[dict[str, Any]], Awaitable[None]] | None,
    ) -> None:
        super().__init__(proxy, metrics, ctx)
        self.req = req
        self.save = save  # stores the finished Response (with the conversation it answered); None: store=false
        self.response_id = new_id("resp")
        self.created_at = int(time.time())

    def _echo_instructions(self) -> None:
        """The Response echoes the instructions the worker was given (a redaction shows), not the raw ones."""
        self.req.echo["instructions"] = instructions_as_seen(self.req, self.ctx.body)

    async def translate_json(self, reply: JSONReply) -> JSONReply:
        self._echo_instructions()
        if reply.status != 200:  # already an OpenAI error (a refusal, the worker's 4xx, ...)
            return reply
        chat = orjson.loads(reply.body)
        response = response_from_chat(self.req, self.response_id, self.req.model, self.created_at, chat)
        if self.save is not None:
            await self.save(response)
        return JSONReply(200, orjson.dumps(response), reply.headers)

    def translator(self) -> EventStream:
        self._echo_instructions()
        return EventStream(
            response_object(self.req, self.response_id, self.req.model, self.created_at, "in_progress", [])
        )

    async def finish(self, out: EventStream) -> bytes:
        if self.save is not None:
            await self.save(out.response)
        return out.completed()

    def log_fields(self) -> dict[str, Any]:
        return {"response_id": self.response_id}
