"""One ``POST /v1/messages`` (Anthropic's Messages API) after it was translated into a chat completions
request (``gateway.wire.anthropic_request``): the chat request runs through the ``Proxy`` like any other,
so every plugin sees the one body it knows (safety screens it and the streamed answer, tenancy charges it,
the cache may answer it, routing places it, a stream cut midway is resumed elsewhere), and its answer comes
back as a Message or as Anthropic's stream events (``gateway.wire.anthropic_output``). An error comes back
in Anthropic's shape, whether the gateway refused the request or the worker did.
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.ops.metrics import Metrics
from gateway.pipeline.context import RequestContext
from gateway.proxy.forward import JSONReply, Proxy
from gateway.proxy.translated_turn import TranslatedTurn
from gateway.wire.anthropic_output import MessageStream, message_from_chat, new_message_id
from gateway.wire.errors import anthropic_from_openai


class MessagesTurn(TranslatedTurn):
    """One ``POST /v1/messages``: the proxied chat request and its translation back. ``model`` is the
    name the client asked for (echoed on the Message)."""

    route = "messages"

    def __init__(self, proxy: Proxy, metrics: Metrics, ctx: RequestContext, model: str) -> None:
        super().__init__(proxy, metrics, ctx)
        self.model = model
        self.message_id = new_message_id()

    async def translate_json(self, reply: JSONReply) -> JSONReply:
        if reply.status != 200:  # an OpenAI-shaped error (a refusal, the worker's 4xx): Anthropic's shape
            return JSONReply(reply.status, anthropic_from_openai(reply.status, reply.body), reply.headers)
        message = message_from_chat(self.message_id, self.model, orjson.loads(reply.body))
        return JSONReply(200, orjson.dumps(message), reply.headers)

    def translator(self) -> MessageStream:
        return MessageStream(self.message_id, self.model)

    async def finish(self, out: MessageStream) -> bytes:
        return out.end()

    def log_fields(self) -> dict[str, Any]:
        return {"message_id": self.message_id}
