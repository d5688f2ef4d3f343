"""Stored Responses (``store: true``): the Response object and its expanded input, in Redis.

Conversation state belongs to the gateway, not to a worker: any replica, and any worker behind it, can
continue any conversation (``previous_response_id``), and a worker restart loses nothing.

- One key per response, holding ``{"response": ..., "input_items": [...]}`` as JSON, where
  ``input_items`` is the whole conversation the response answered (earlier turns' input and output,
  then this request's input): a stored response is self-contained, so continuing it is one GET and a
  turn whose ancestors expired still continues.
- Keys are scoped by caller: ``<prefix>:t:<tenant>:<id>`` with tenancy on (the tenant its key belongs
  to, from ``Services.shared[TENANT_OF]``), ``<prefix>:shared:<id>`` without it. A tenant can only name
  keys of its own scope, so another tenant's id reads exactly like an unknown one (404, no oracle).
  Ids are checked against their format first, so no id can reach into another scope's keys.
- Each key expires ``responses.ttl_s`` after it was written.
- Every Redis call is bounded (``responses.redis_timeout_ms``); Redis unreachable is a 503
  ``store_unavailable``, never a silent loss.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
from redis.exceptions import RedisError

from gateway.infra.redis_api import RedisPipeline
from gateway.pipeline.config import ResponsesConfig
from gateway.pipeline.services import TENANT_OF, Services
from gateway.wire.errors import NotFound, ServiceUnavailable

_ID = re.compile(r"resp_[0-9a-f]{48}")
_REDIS_ERRORS = (RedisError, OSError, TimeoutError)


def not_found(response_id: str, param: str | None = None) -> NotFound:
    return NotFound(f"Response with id '{response_id}' not found.", param=param, code="not_found")


class ResponseStore:
    """Save, load and delete stored responses, per caller scope."""

    def __init__(self, services: Services) -> None:
        self.services = services

    async def scope_of(self, headers: dict[str, str]) -> str:
        """The caller's scope: its tenant when a plugin tells tenants apart (else one shared scope).
        Raises the plugin's 401 for a caller without valid credentials."""
        tenant_of = self.services.shared.get(TENANT_OF)
        if tenant_of is None:
            return "shared"
        return "t:" + await tenant_of(headers)

    def _redis(self, config: ResponsesConfig) -> RedisPipeline:
        """Commands of concurrent requests share one write per event-loop turn (auto-pipelining)."""
        timeout_s = config.redis_timeout_ms / 1000
        return self.services.redis_pipeline(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)

    @staticmethod
    def _key(config: ResponsesConfig, scope: str, response_id: str) -> str:
        return f"{config.redis_prefix}:{scope}:{response_id}"

    async def save(
        self, config: ResponsesConfig, scope: str, response: dict[str, Any], input_items: list[dict[str, Any]]
    ) -> None:
        value = orjson.dumps({"response": response, "input_items": input_items})
        try:
            await self._redis(config).execute(
                "SET", self._key(config, scope, response["id"]), value, "EX", config.ttl_s
            )
        except _REDIS_ERRORS as exc:
            raise _unavailable("store", exc) from None

    async def load(self, config: ResponsesConfig, scope: str, response_id: str) -> dict[str, Any] | None:
        """The stored ``{"response", "input_items"}``, or None (unknown, expired, deleted or not this
        caller's: the same answer for each)."""
        if not _ID.fullmatch(response_id):
            return None
        try:
            raw = await self._redis(config).execute("GET", self._key(config, scope, response_id))
        except _REDIS_ERRORS as exc:
            raise _unavailable("read", exc) from None
        if raw is None:
            return None
        stored = orjson.loads(raw)
        return stored if isinstance(stored, dict) else None

    async def delete(self, config: ResponsesConfig, scope: str, response_id: str) -> bool:
        if not _ID.fullmatch(response_id):
            return False
        try:
            return bool(await self._redis(config).execute("DEL", self._key(config, scope, response_id)))
        except _REDIS_ERRORS as exc:
            raise _unavailable("delete", exc) from None


def _unavailable(action: str, exc: BaseException) -> ServiceUnavailable:
    return ServiceUnavailable(
        f"The gateway could not {action} the response: its store (Redis) is unavailable ({type(exc).__name__}); "
        "retry shortly, or send 'store': false for a response that need not be kept.",
        code="store_unavailable",
        headers={"retry-after": "1"},
    )
