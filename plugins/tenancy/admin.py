"""Operator actions of the tenancy plugin (``POST /admin/plugins/tenancy/{action}``).

- ``create_key`` ``{"tenant", "id"?, "models"?, "limits"?}``: stores a new key and returns it, the only
  time it is ever shown. An id config.yaml declares, or that a key created here has or had (a revoked
  id is never reused), is a 400 ``key_exists``.
- ``revoke_key`` ``{"id"}``: deletes a key created here; every replica refuses it within a second, and
  its id stays taken. A key config.yaml declares is removed there; a created key whose id the running
  config declares too (created on a replica whose config did not, meanwhile; it no longer authenticates)
  is still revoked here (the config's key stays, and the answer says so).
- ``list_keys``: ids, tenants and where each key is defined (never keys or digests).
- ``usage`` ``{"key_id"}`` or ``{"tenant"}``: tokens and requests in the current UTC day and month,
  with the budgets and when they reset.
- ``usage_history`` ``{"key_id"}`` or ``{"tenant"}``, ``"period": "hour" | "day"``, ``"days": 1..30``:
  requests, refusals, prompt and completion tokens per UTC hour or day, oldest first (the console's
  usage charts and CSV).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import redis.asyncio as aioredis
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from gateway.pipeline.config import format_validation_error
from gateway.wire.errors import InvalidRequest, NotFound, ServiceUnavailable
from plugins.tenancy.budgets import usage_report
from plugins.tenancy.config import NAME_PATTERN, Limits, TenancyConfig
from plugins.tenancy.history import MAX_DAYS, usage_history
from plugins.tenancy.keys import KeyExists, KeyStore
from plugins.tenancy.limits import REDIS_ERRORS

M = TypeVar("M", bound=BaseModel)


class CreateKey(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tenant: str = Field(pattern=NAME_PATTERN)
    id: str | None = Field(None, pattern=NAME_PATTERN)
    models: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    limits: Limits | None = None


class KeyRef(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=NAME_PATTERN)


class UsageQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key_id: str | None = Field(None, pattern=NAME_PATTERN)
    tenant: str | None = Field(None, pattern=NAME_PATTERN)


class HistoryQuery(UsageQuery):
    period: Literal["hour", "day"] = "day"
    days: int = Field(MAX_DAYS, ge=1, le=MAX_DAYS)


def _parse(model: type[M], body: dict[str, Any]) -> M:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        problems = format_validation_error(exc)
        raise InvalidRequest("; ".join(problems), param=problems[0].split(":", 1)[0]) from None


class TenancyAdmin:
    def __init__(
        self, config: TenancyConfig, redis: aioredis.Redis, keys: KeyStore, clock: Callable[[], float]
    ) -> None:
        self._config = config
        self._redis = redis
        self._keys = keys
        self._clock = clock

    async def handle(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        handlers = {
            "create_key": self.create_key,
            "revoke_key": self.revoke_key,
            "list_keys": self.list_keys,
            "usage": self.usage,
            "usage_history": self.usage_history,
        }
        handler = handlers.get(action)
        if handler is None:
            raise NotFound(
                f"The 'tenancy' plugin has no admin action '{action}' (known: {', '.join(handlers)}).", param="action"
            )
        try:
            return await handler(body)
        except REDIS_ERRORS:
            raise ServiceUnavailable(
                "Redis is unreachable, so keys and usage cannot be read or changed; try again shortly.",
                code="tenancy_unavailable",
            ) from None

    async def create_key(self, body: dict[str, Any]) -> dict[str, Any]:
        req = _parse(CreateKey, body)
        key_id = req.id or f"key_{secrets.token_hex(8)}"
        limits = req.limits if req.limits is not None else self._config.default_key_limits
        try:
            key, info = await self._keys.create(key_id, req.tenant, req.models, limits)
        except KeyExists:
            raise InvalidRequest(
                f"A key with id '{key_id}' exists or existed (the id of a revoked key, or of one a config "
                "declared, is not reused).",
                param="id",
                code="key_exists",
            ) from None
        return {
            "id": info.id,
            "key": key,
            "tenant": info.tenant,
            "models": list(info.models),
            "limits": info.limits.model_dump(),
            "note": "Store this key now: the gateway keeps only its hash and cannot show it again.",
        }

    async def revoke_key(self, body: dict[str, Any]) -> dict[str, Any]:
        """Revoke the key created here under ``id``. The running config.yaml may declare a key with the
        same id (a config declaring a created id is refused when it loads, but another replica may have
        created it meanwhile): the created key is revoked all the same, and the answer says the config's
        stays; a config key alone is a 400."""
        ref = _parse(KeyRef, body)
        declared = self._keys.config_key(ref.id) is not None
        if await self._keys.revoke(ref.id):
            if not declared:
                return {"id": ref.id, "revoked": True}
            return {
                "id": ref.id,
                "revoked": True,
                "note": f"config.yaml also declares a key '{ref.id}': it stays valid until removed there and reloaded.",
            }
        if declared:
            raise InvalidRequest(
                f"Key '{ref.id}' is defined in config.yaml; remove it there and reload.", param="id", code="config_key"
            )
        raise NotFound(f"No key with id '{ref.id}'.", param="id", code="key_not_found")

    async def list_keys(self, body: dict[str, Any]) -> dict[str, Any]:
        return {"keys": await self._keys.list()}

    async def _scope(self, query: UsageQuery) -> tuple[str, str, str, Limits]:
        """(tenant, scope, name, limits) of the key or tenant a usage query names."""
        if (query.key_id is None) == (query.tenant is None):
            raise InvalidRequest("Give exactly one of 'key_id' or 'tenant'.", param="key_id")
        if query.key_id is not None:
            info = await self._keys.by_id(query.key_id)
            if info is None:
                raise NotFound(f"No key with id '{query.key_id}'.", param="key_id", code="key_not_found")
            return info.tenant, "key", info.id, info.limits
        assert query.tenant is not None
        return query.tenant, "tenant", query.tenant, self._config.tenants.get(query.tenant, Limits())

    async def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        tenant, scope, name, limits = await self._scope(_parse(UsageQuery, body))
        return await usage_report(self._redis, self._config.redis_prefix, tenant, scope, name, limits, self._clock)

    async def usage_history(self, body: dict[str, Any]) -> dict[str, Any]:
        query = _parse(HistoryQuery, body)
        tenant, scope, name, _ = await self._scope(query)
        prefix = self._config.redis_prefix
        return await usage_history(self._redis, prefix, tenant, scope, name, query.period, query.days, self._clock())
