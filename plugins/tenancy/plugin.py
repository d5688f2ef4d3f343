"""TenancyPlugin: who is calling (API key -> tenant), may they use this model, and are they within
their rate limits and budgets. Runs first in the plugin order, so a refused request costs nothing
downstream and the cache can namespace by ``ctx.tenant``.

Per request: one HMAC of the key, a key lookup (config, or Redis behind a sub-second local cache),
one Redis script for every limit and budget on the way in, and one on the way back to charge the
tokens the worker reported. Refusals: 401 ``invalid_api_key``, 404 ``model_not_found`` (what OpenAI
answers for a model the key may not use, so a key cannot probe which models exist), 429 with
``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, 503 when Redis is unreachable and the
deployment chose ``redis_down: fail_closed``.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from redis.exceptions import RedisError

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.services import Services
from gateway.wire.errors import AuthenticationFailed, GatewayError, NotFound, RateLimited, ServiceUnavailable
from plugins.tenancy import estimate
from plugins.tenancy.admin import TenancyAdmin
from plugins.tenancy.budgets import budgets_for, exhausted, format_duration, scope_prefix
from plugins.tenancy.config import Limits, TenancyConfig
from plugins.tenancy.keys import KeyInfo, KeyStore
from plugins.tenancy.limits import Bucket, Decision, LocalLimiter, Plan, RedisLimiter
from plugins.tenancy.metrics import TenancyMetrics

log = logging.getLogger("gateway.tenancy")
REDIS_ERRORS = (RedisError, OSError, TimeoutError)
VERIFY_KEY = "tenancy.verify_key"
_NO_LIMITS = Limits()
_RATE_NAMES = {"requests": "requests per min (RPM)", "tokens": "tokens per min (TPM)"}


@dataclass(slots=True)
class Admitted:
    """What on_response needs to settle the request's token charge."""

    plan: Plan
    reserved: int  # tokens counted on admission
    prompt_estimate: int
    via_redis: bool


class TenancyPlugin(Plugin):
    name = "tenancy"
    Config = TenancyConfig
    default_on_error = "fail_closed"
    #: Wall clock (epoch seconds) that decides budget periods; a test subclass may replace it.
    clock: ClassVar[Callable[[], float]] = staticmethod(time.time)

    config: TenancyConfig

    def __init__(self, config: TenancyConfig, services: Services) -> None:
        super().__init__(config, services)
        timeout_s = config.redis_timeout_ms / 1000
        self.redis = services.redis(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        self._pepper_set = bool(os.environ.get(config.pepper_env))
        pepper = os.environ.get(config.pepper_env, "").encode()
        self.keys = KeyStore(
            self.redis,
            config.redis_prefix,
            pepper,
            config.keys,
            ttl_s=config.key_cache_ttl_s,
            max_entries=config.key_cache_size,
        )
        self.limiter = RedisLimiter(
            self.redis, services.redis_pipeline(socket_timeout_s=timeout_s, connect_timeout_s=timeout_s)
        )
        self.local = LocalLimiter(config.fail_open_share)
        self.metrics = TenancyMetrics.of(services)
        self.admin = TenancyAdmin(config, self.redis, self.keys, type(self).clock)

    async def start(self) -> None:
        if self.config.auth and not self._pepper_set:
            log.warning("tenancy: %s is not set; key digests are unpeppered HMACs", self.config.pepper_env)
        self.services.shared[VERIFY_KEY] = self.verify_key

    async def aclose(self) -> None:
        if self.services.shared.get(VERIFY_KEY) == self.verify_key:
            del self.services.shared[VERIFY_KEY]

    async def verify_key(self, token: str) -> dict[str, str] | None:
        """For the admin routes: the id and tenant of a valid client key, else None (never raises)."""
        try:
            info = await self.keys.lookup(self.keys.digest(token))
        except REDIS_ERRORS:
            return None
        return {"id": info.id, "tenant": info.tenant} if info is not None else None

    async def on_admin(self, action: str, body: dict[str, Any]) -> dict[str, Any]:
        return await self.admin.handle(action, body)

    # -- the way in -------------------------------------------------------------------------------

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        info: KeyInfo | None = None
        if self.config.auth:
            info = await self._authenticate(ctx.headers)
            if not info.allows(ctx.requested_model, ctx.model.name):
                self.metrics.refusals.labels(info.tenant, "model_not_allowed").inc()
                raise NotFound(
                    f"The model '{ctx.requested_model}' does not exist or you do not have access to it.",
                    param="model",
                    code="model_not_found",
                )
            ctx.tenant, ctx.api_key_id = info.tenant, info.id
            ctx.log["api_key_id"] = info.id
        else:
            ctx.tenant = self.config.anonymous_tenant
        tenant = ctx.tenant
        plan = self._plan(info, tenant)
        prompt = estimate.prompt_tokens(ctx.endpoint, ctx.body)
        reserved = prompt + (estimate.reserved_completion(ctx.body) if self.config.reserve_max_tokens else 0)
        decision, via_redis = await self._admit(plan, reserved, tenant)
        if not decision.admitted:
            raise self._refusal(decision, reserved, tenant)
        ctx.response_headers.update(decision.headers())
        ctx.state[self.name] = Admitted(plan, reserved, prompt, via_redis)
        self.metrics.admitted.labels(tenant, info.id if info else "-").inc()
        return None

    async def on_models(self, headers: dict[str, str], models: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """With auth on, listing models needs a valid key, and lists only what that key may use."""
        if not self.config.auth:
            return models
        info = await self._authenticate(headers)
        return [card for card in models if info.allows(card["id"], card.get("parent", card["id"]))]

    async def _authenticate(self, headers: dict[str, str]) -> KeyInfo:
        scheme, _, token = headers.get("authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            self.metrics.refusals.labels("-", "missing_api_key").inc()
            raise AuthenticationFailed(
                "You didn't provide an API key. You need to provide your API key in an Authorization header"
                " using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                code="invalid_api_key",
            )
        digest = self.keys.digest(token)
        try:
            info = await self.keys.lookup(digest)
        except REDIS_ERRORS as exc:
            self._redis_failed("lookup", exc)
            info = self.keys.stale(digest) if self.config.redis_down == "fail_open" else None
            if info is None:
                raise self._unavailable() from None
        if info is None:
            self.metrics.refusals.labels("-", "invalid_api_key").inc()
            raise AuthenticationFailed(
                "Incorrect API key provided. Ask the administrator of this gateway for a valid key.",
                code="invalid_api_key",
            )
        return info

    def _plan(self, info: KeyInfo | None, tenant: str) -> Plan:
        now = type(self).clock()
        prefix = self.config.redis_prefix
        base = scope_prefix(prefix, tenant)
        scopes: list[tuple[str, str, Limits]] = []
        if info is not None:
            scopes.append(("key", info.id, info.limits))
        scopes.append(("tenant", tenant, self.config.tenants.get(tenant, _NO_LIMITS)))
        buckets: list[Bucket] = []
        budgets = []
        for scope, name, limits in scopes:
            key = f"{base}:rl:{scope}:{name}"
            if limits.requests_per_minute:
                buckets.append(Bucket(scope, name, "requests", limits.requests_per_minute, key + ":rpm"))
            if limits.tokens_per_minute:
                buckets.append(Bucket(scope, name, "tokens", limits.tokens_per_minute, key + ":tpm"))
            budgets += budgets_for(prefix, tenant, scope, name, limits, now)
        return Plan(buckets, budgets)

    async def _admit(self, plan: Plan, tokens: int, tenant: str) -> tuple[Decision, bool]:
        try:
            return await self.limiter.admit(plan, tokens), True
        except REDIS_ERRORS as exc:
            self._redis_failed("admit", exc)
            if self.config.redis_down == "fail_closed":
                self.metrics.refusals.labels(tenant, "redis_unavailable").inc()
                raise self._unavailable() from None
            return self.local.admit(plan, tokens), False

    def _refusal(self, decision: Decision, requested: int, tenant: str) -> GatewayError:
        headers = decision.headers()
        if decision.budget is not None:
            budget = decision.budget
            self.metrics.refusals.labels(tenant, f"tokens_per_{budget.period}").inc()
            error = exhausted(budget, decision.used.get(budget, 0), requested, type(self).clock())
            error.headers.update(headers)
            return error
        bucket = decision.bucket
        assert bucket is not None
        cost = 1 if bucket.kind == "requests" else requested
        where = f"{bucket.scope} '{bucket.name}'"
        if decision.status == 3:
            self.metrics.refusals.labels(tenant, "request_too_large").inc()
            return RateLimited(
                f"Request too large for {_RATE_NAMES[bucket.kind]} on {where}: Limit {bucket.limit}, Requested"
                f" {cost}. Send a shorter prompt or a lower max_tokens.",
                code="rate_limit_exceeded",
                headers=headers,
            )
        self.metrics.refusals.labels(tenant, f"{bucket.kind}_per_minute").inc()
        wait_ms = max(1, decision.retry_after_ms)
        return RateLimited(
            f"Rate limit reached for {_RATE_NAMES[bucket.kind]} on {where}: Limit {bucket.limit}, Requested {cost}."
            f" Please try again in {format_duration(wait_ms)}.",
            code="rate_limit_exceeded",
            headers={**headers, "retry-after": str(-(-wait_ms // 1000)), "retry-after-ms": str(wait_ms)},
        )

    def _redis_failed(self, op: str, exc: BaseException) -> None:
        self.metrics.redis_errors.labels(op).inc()
        log.warning("tenancy: Redis %s failed (%s); policy %s", op, type(exc).__name__, self.config.redis_down)

    @staticmethod
    def _unavailable() -> ServiceUnavailable:
        return ServiceUnavailable(
            "The gateway cannot check API keys and limits right now (its Redis is unreachable); try again shortly.",
            code="tenancy_unavailable",
            headers={"retry-after": "1"},
        )

    # -- the way back -----------------------------------------------------------------------------

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        admitted: Admitted | None = ctx.state.get(self.name)
        if admitted is None or response.status != 200:
            return None
        usage = estimate.reported_usage(response.json)
        if usage is None:
            return None
        prompt = usage[0] if usage[0] is not None else admitted.prompt_estimate
        completion = usage[1]
        tenant = ctx.tenant or "-"
        self.metrics.tokens.labels(tenant, "prompt").inc(prompt)
        self.metrics.tokens.labels(tenant, "completion").inc(completion)
        delta = prompt + completion - admitted.reserved
        if admitted.via_redis:
            try:
                await self.limiter.charge(admitted.plan, delta, prompt, completion)
            except REDIS_ERRORS as exc:  # the answer is already paid for: deliver it, count the miss
                self._redis_failed("charge", exc)
        else:
            self.local.charge(admitted.plan, delta)
        return None
