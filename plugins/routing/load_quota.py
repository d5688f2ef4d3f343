"""A bound on the LoRA adapter loads this gateway replica starts on each tenant's behalf.

A load takes a worker 70-200 ms and, on a worker that holds ``max_loras`` adapters already, evicts the
least recently used one, maybe another tenant's. A key allowed more adapters than the fleet has slots could
ask for them in turn and force a load, and an eviction, on nearly every request. So each tenant
(``ctx.tenant``, as the tenancy plugin sets it; ``-`` for every caller when nothing sets it) has a token
bucket of ``adapters.tenant_loads_per_minute`` tokens, refilled at that rate: a load a request starts takes
one. A request past its bound goes to a worker that holds its adapter (or is loading it), or is refused
with a 429 before anything reaches a worker (``AdapterPlan``).

The buckets are this process's, in memory: every replica (every process of ``gateway serve --workers N``)
bounds the loads it starts itself. At most
``max_tenants`` are kept; the least recently used is dropped past that (it comes back full).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from gateway.wire.errors import RateLimited

#: Tenants whose buckets are kept at once (least recently used dropped beyond).
MAX_TENANTS = 10_000
#: The tenant of requests that no plugin names one for.
ANONYMOUS = "-"


class TenantLoadBuckets:
    """Token buckets by tenant: ``per_minute`` tokens each at most, ``per_minute`` / 60 more a second."""

    __slots__ = ("_buckets", "clock", "max_tenants", "per_minute")

    def __init__(
        self, per_minute: int, *, max_tenants: int = MAX_TENANTS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.per_minute = per_minute  # the live config's (0: unbounded); a reload keeps the buckets' levels
        self.max_tenants = max_tenants
        self.clock = clock
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tenant -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def _level(self, tenant: str, now: float) -> float:
        capacity = float(self.per_minute)
        kept = self._buckets.get(tenant)
        if kept is None:
            return capacity
        tokens, at = kept
        return min(capacity, tokens + max(0.0, now - at) * capacity / 60.0)

    def ready(self, tenant: str) -> bool:
        """Whether ``tenant`` has a token now (none taken); always, with no bound."""
        return not self.per_minute or self._level(tenant, self.clock()) >= 1.0

    def take(self, tenant: str) -> float:
        """Take one of ``tenant``'s tokens: 0 when taken (or with no bound: a reload may have lifted it
        since the request's quota was made), else the seconds until it has one (none taken)."""
        if not self.per_minute:
            return 0.0
        now = self.clock()
        tokens = self._level(tenant, now)
        if tokens < 1.0:
            return (1.0 - tokens) * 60.0 / self.per_minute
        buckets = self._buckets
        buckets[tenant] = (tokens - 1.0, now)
        buckets.move_to_end(tenant)
        while len(buckets) > self.max_tenants:
            buckets.popitem(last=False)
        return 0.0


@dataclass(slots=True)
class LoadQuota:
    """One request's tenant bucket: whether it may start a load, and the charge (or the 429) when it does."""

    buckets: TenantLoadBuckets
    tenant: str
    on_refused: Callable[[str], None]  # counts a refusal of a load of that model

    def ready(self) -> bool:
        return self.buckets.ready(self.tenant)

    def charge(self, model: str) -> None:
        """This request starts a load of ``model``: one token, or a 429 saying when there is one."""
        wait = self.buckets.take(self.tenant)
        if wait <= 0:
            return
        self.on_refused(model)
        retry_after = max(1, math.ceil(wait))
        raise RateLimited(
            f"Too many LoRA adapter loads for this tenant (at most {self.buckets.per_minute} a minute on this "
            f"gateway), and model '{model}' is not loaded on any worker that can take the request now. Retry "
            f"after {retry_after} s, or use an adapter that is loaded already.",
            code="adapter_load_rate_exceeded",
            headers={"retry-after": str(retry_after)},
        )
