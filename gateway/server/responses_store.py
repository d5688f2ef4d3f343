"""Stored Responses (``store: true``): each turn's own record in Redis, linked to the turn it continued.

Conversation state belongs to the gateway, not to a worker: any replica, and any worker behind it, can
continue any conversation (``previous_response_id``), and a worker restart loses nothing.

- One key per response, holding ``{"response", "input_items", "ancestors", "conversation_bytes"}`` as
  JSON: ``input_items`` is the turn's own input only (what the worker saw of it: safety's redactions
  applied), ``ancestors`` the ids of the earlier turns of its conversation, oldest first. So turn N never
  rewrites turns 1..N-1 (a chain of n turns stores O(n) bytes), and continuing one is a GET and one MGET.
  Storing a turn refreshes its ancestors' expiry: a conversation lives as long as its newest turn.
- Bounds, each refused before any worker is asked (and checked again, atomically, when the turn is
  saved): a record over ``max_response_bytes`` is a 413, a tenant over ``max_tenant_bytes`` a 429
  (``gateway.server.responses_ledger`` keeps the count), a chain over ``max_conversation_turns`` or
  ``max_conversation_bytes`` a 400. History is never dropped to make room.
- Keys are scoped by caller: ``<prefix>:t:<tenant>:<id>`` with tenancy on (the tenant its key belongs
  to, from ``Services.shared[TENANT_OF]``), ``<prefix>:shared:<id>`` without it. A tenant can only name
  keys of its own scope, so another tenant's id reads exactly like an unknown one (404, no oracle).
  Ids are checked against their format first, so no id can reach into another scope's keys.
- Every Redis call is bounded (``responses.redis_timeout_ms``); Redis unreachable is a 503
  ``store_unavailable``, never a silent loss.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway.pipeline.config import ResponsesConfig
from gateway.pipeline.services import TENANT_OF, Services
from gateway.server.responses_ledger import Ledger, Usage, scopes
from gateway.wire.errors import GatewayError, InvalidRequest, NotFound, PayloadTooLarge, RateLimited, ServiceUnavailable
from gateway.wire.responses_items import output_as_input

_ID = re.compile(r"resp_[0-9a-f]{48}")
_REDIS_ERRORS = (RedisError, OSError, TimeoutError)


def not_found(response_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param=param, code="not_found")


@dataclass(slots=True)
class Chain:
    """The conversation a turn continues: its earlier items, the ids of its turns and their stored bytes."""

    items: list[dict[str, Any]] = field(default_factory=list)
    ids: list[str] = field(default_factory=list)  # oldest first; the last is previous_response_id
    bytes: int = 0


class ResponseStore:
    """Save, load and delete stored responses, per caller scope."""

    def __init__(self, services: Services) -> None:
        self.services = services
        self._ledgers: dict[float, Ledger] = {}

    async def scope_of(self, headers: dict[str, str]) -> str:
        """The caller's scope: its tenant when a plugin tells tenants apart (else one shared scope).
        Raises the plugin's 401 for a caller without valid credentials."""
        tenant_of = self.services.shared.get(TENANT_OF)
        if tenant_of is None:
            return "shared"
        return "t:" + await tenant_of(headers)

    def _ledger(self, config: ResponsesConfig) -> Ledger:
        """Commands of concurrent requests share one write per event-loop turn (auto-pipelining)."""
        timeout_s = config.redis_timeout_ms / 1000
        ledger = self._ledgers.get(timeout_s)
        if ledger is None:
            client = self.services.redis(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
            pipeline = self.services.redis_pipeline(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
            ledger = self._ledgers[timeout_s] = Ledger(client, pipeline)
        return ledger

    def _pipeline(self, config: ResponsesConfig) -> Any:
        timeout_s = config.redis_timeout_ms / 1000
        return self.services.redis_pipeline(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)

    # -- reading ---------------------------------------------------------------------------------------

    async def load(self, config: ResponsesConfig, scope: str, response_id: str) -> dict[str, Any] | None:
        """The stored record, or None (unknown, expired, deleted or not this caller's: the same answer
        for each)."""
        if not _ID.fullmatch(response_id):
            return None
        try:
            raw = await self._pipeline(config).execute("GET", f"{config.redis_prefix}:{scope}:{response_id}")
        except _REDIS_ERRORS as exc:
            raise _unavailable("read", exc) from None
        stored = orjson.loads(raw) if raw is not None else None
        return stored if isinstance(stored, dict) else None

    async def chain(
        self, config: ResponsesConfig, scope: str, record: dict[str, Any], param: str | None, *, output: bool = True
    ) -> Chain:
        """Every item of the conversation ``record`` ends (its ancestors' input and output, then its own
        input and, with ``output``, its output), in order. An ancestor that is gone (deleted) is a 404
        naming it: history is never skipped."""
        ancestors: list[str] = list(record.get("ancestors") or [])
        response_id = record["response"]["id"]
        if len(ancestors) + 1 > config.max_conversation_turns:
            raise _too_long(f"{len(ancestors) + 1} turns", f"{config.max_conversation_turns} turns", param)
        records: list[dict[str, Any]] = []
        if ancestors:
            keys = [f"{config.redis_prefix}:{scope}:{a}" for a in ancestors]
            try:
                raws = await self._pipeline(config).execute("MGET", *keys)
            except _REDIS_ERRORS as exc:
                raise _unavailable("read", exc) from None
            for ancestor, raw in zip(ancestors, raws, strict=True):
                if raw is None:
                    raise NotFound(
                        f"Response '{ancestor}', an earlier turn of the conversation of '{response_id}', was deleted "
                        "or has expired, so that conversation cannot be continued or listed; start a new one.",
                        param=param,
                        code="not_found",
                    )
                records.append(orjson.loads(raw))
        out = Chain(ids=[*ancestors, response_id], bytes=_stored_bytes(record))
        for turn in records:
            out.items += turn["input_items"]
            out.items += output_as_input(turn["response"]["output"])
        out.items += record["input_items"]
        if output:
            out.items += output_as_input(record["response"]["output"])
        return out

    async def usage(self, config: ResponsesConfig, scope: str) -> Usage:
        try:
            return await self._ledger(config).usage(config.redis_prefix, scope)
        except _REDIS_ERRORS as exc:
            raise _unavailable("read", exc) from None

    async def tenants(self, config: ResponsesConfig) -> list[tuple[str, Usage]]:
        """Every scope holding stored responses and its usage (the admin view)."""
        timeout_s = config.redis_timeout_ms / 1000
        client = self.services.redis(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        try:
            names = await scopes(client, config.redis_prefix)
        except _REDIS_ERRORS as exc:
            raise _unavailable("read", exc) from None
        usages = await asyncio.gather(*(self.usage(config, name) for name in names))  # one pipelined batch
        return list(zip(names, usages, strict=True))

    # -- bounds ----------------------------------------------------------------------------------------

    async def check_room(self, config: ResponsesConfig, scope: str, own_bytes: int, chain: Chain) -> None:
        """Refuse, before any worker is asked, a turn the store could not keep: its own record already
        over ``max_response_bytes`` (413), the conversation over its bounds (400), or the tenant without
        room for it (429)."""
        if own_bytes > config.max_response_bytes:
            raise _record_too_large(own_bytes, config.max_response_bytes)
        if chain.ids and chain.bytes + own_bytes > config.max_conversation_bytes:
            raise _too_long(
                f"{chain.bytes + own_bytes} bytes", f"{config.max_conversation_bytes} bytes", "previous_response_id"
            )
        if len(chain.ids) + 1 > config.max_conversation_turns:
            raise _too_long(
                f"{len(chain.ids) + 1} turns", f"{config.max_conversation_turns} turns", "previous_response_id"
            )
        used = await self.usage(config, scope)
        if used.bytes + own_bytes > config.max_tenant_bytes:
            raise _tenant_full(used.bytes, own_bytes, config.max_tenant_bytes)

    # -- writing ---------------------------------------------------------------------------------------

    async def save(
        self,
        config: ResponsesConfig,
        scope: str,
        response: dict[str, Any],
        input_items: list[dict[str, Any]],
        chain: Chain,
    ) -> None:
        """Keep the turn (its own input items, the response, its place in the chain), within the bounds."""
        record: dict[str, Any] = {"response": response, "input_items": input_items, "ancestors": chain.ids}
        own = len(orjson.dumps(record))
        if own > config.max_response_bytes:
            raise _record_too_large(own, config.max_response_bytes)
        if chain.ids and chain.bytes + own > config.max_conversation_bytes:  # the output counts too
            raise _too_long(
                f"{chain.bytes + own} bytes", f"{config.max_conversation_bytes} bytes", "previous_response_id"
            )
        record["conversation_bytes"] = chain.bytes + own
        value = orjson.dumps(record)
        try:
            stored, total = await self._ledger(config).save(
                config.redis_prefix, scope, response["id"], value, config.ttl_s, config.max_tenant_bytes, chain.ids
            )
        except _REDIS_ERRORS as exc:
            raise _unavailable("store", exc) from None
        if not stored:
            raise _tenant_full(total, len(value), config.max_tenant_bytes)

    async def delete(self, config: ResponsesConfig, scope: str, response_id: str) -> bool:
        if not _ID.fullmatch(response_id):
            return False
        try:
            return await self._ledger(config).delete(config.redis_prefix, scope, response_id)
        except _REDIS_ERRORS as exc:
            raise _unavailable("delete", exc) from None


def _stored_bytes(record: dict[str, Any]) -> int:
    """The bytes of the whole chain a record ends (records stored before chains were kept: their own)."""
    value = record.get("conversation_bytes")
    return value if isinstance(value, int) else len(orjson.dumps(record))


def _record_too_large(size: int, bound: int) -> GatewayError:
    return PayloadTooLarge(
        f"This response would be stored as {size} bytes; the gateway stores at most {bound} per response "
        "(responses.max_response_bytes). Send a shorter input, or 'store': false if it need not be kept.",
        param="input",
        code="response_too_large",
    )


def _too_long(size: str, bound: str, param: str | None) -> GatewayError:
    return InvalidRequest(
        f"This conversation would hold {size}; the gateway keeps at most {bound} in one previous_response_id "
        "chain (responses.max_conversation_turns / max_conversation_bytes). Start a new conversation (send the "
        "context you need as 'input' without 'previous_response_id').",
        param=param,
        code="conversation_too_long",
    )


def _tenant_full(used: int, size: int, bound: int) -> GatewayError:
    return RateLimited(
        f"Storing this response ({size} bytes) would take your stored responses past {bound} bytes (now "
        f"{used}). Delete stored responses you no longer need, wait for them to expire, or send 'store': false.",
        code="stored_bytes_exceeded",
    )


def _unavailable(action: str, exc: BaseException) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"The gateway could not {action} the response: its store (Redis) is unavailable ({type(exc).__name__}); "
        "retry shortly, or send 'store': false for a response that need not be kept.",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )
