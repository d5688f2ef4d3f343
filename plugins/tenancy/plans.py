"""Which counters a request touches (its ``Plan``): the key's and the tenant's rate-limit buckets and
budgets, with their Redis keys.

A plan only changes with the key's or the tenant's limits and with the UTC hour (the shortest budget
window: the hourly usage counter is another key each hour), so ``Plans`` builds one per key, tenant
and hour and keeps it: building it per request was a third of tenancy's admission CPU.
"""

from __future__ import annotations

from collections.abc import Callable

from plugins.tenancy.budgets import budgets_for, scope_prefix
from plugins.tenancy.config import NO_LIMITS, Limits, TenancyConfig
from plugins.tenancy.keys import KeyInfo
from plugins.tenancy.limits import Bucket, Plan

_HOUR_S = 3600
_CACHE_SIZE = 10_000  # (key, tenant) pairs whose plans are kept


class Plans:
    """The plans of one tenancy configuration, by key (None: an anonymous request) and tenant."""

    def __init__(self, config: TenancyConfig, clock: Callable[[], float]) -> None:
        self._config = config
        self._clock = clock
        self._kept: dict[tuple[KeyInfo | None, str], tuple[Plan, float]] = {}  # -> (plan, end of its hour)

    def of(self, info: KeyInfo | None, tenant: str) -> Plan:
        now = self._clock()
        kept = self._kept.get((info, tenant))
        if kept is not None and kept[1] - _HOUR_S <= now < kept[1]:
            return kept[0]
        plan = self._build(info, tenant, now)
        hour = next(b for b in plan.budgets if b.period == "hour")
        if len(self._kept) >= _CACHE_SIZE:
            self._kept.clear()  # many keys: rebuilt as they come back
        self._kept[(info, tenant)] = (plan, hour.resets_at)
        return plan

    def _build(self, info: KeyInfo | None, tenant: str, now: float) -> Plan:
        prefix = self._config.redis_prefix
        base = scope_prefix(prefix, tenant)
        scopes: list[tuple[str, str, Limits]] = []
        if info is not None:
            scopes.append(("key", info.id, info.limits))
        scopes.append(("tenant", tenant, self._config.tenants.get(tenant, NO_LIMITS)))
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
