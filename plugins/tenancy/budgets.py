"""Token budgets per key and per tenant, per UTC day and UTC month, and the hourly usage counters.

Usage is counted in Redis hashes named after the period they cover
(``{prefix}:{t:TENANT}:usage:key:ID:d20250131``), so a budget resets by itself at the UTC boundary:
the first request of a new day or month counts into a new, empty hash. Old hashes expire after a
while (35 days / 400 days) so usage stays queryable for that long. The admission script
(``plugins.tenancy.limits``) checks and counts budgets atomically with the rate limits.

An hour is a counter of the same shape with no limit (``...:h2025013114``, kept 31 days), counted by
the same scripts in the same call: the usage history (``plugins.tenancy.history``) reads hours and days.
Each hash holds ``requests`` (admitted), ``refusals`` (refused by a limit or budget), ``prompt_tokens``
and ``completion_tokens`` (charged), and ``tokens`` (reserved, then settled to their sum).
"""

from __future__ import annotations

import calendar
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

import redis.asyncio as aioredis

from gateway.wire.errors import RateLimited
from plugins.tenancy.config import Limits

Period = Literal["day", "month", "hour"]
_TTL_S = {"day": 35 * 86400, "month": 400 * 86400, "hour": 31 * 86400}
_FIELDS = ("requests", "tokens", "prompt_tokens", "completion_tokens")
#: What the usage history shows of each hash.
HISTORY_FIELDS = ("requests", "refusals", "prompt_tokens", "completion_tokens")
_TWO_DIGITS = tuple(f"{i:02d}" for i in range(100))  # format specs cost more than a lookup, twice a request


@dataclass(frozen=True, slots=True, eq=False)  # identity equality, as limits.Bucket
class Budget:
    """One usage counter for one scope and period; ``limit`` None means counted but unlimited."""

    scope: str  # "key" | "tenant"
    name: str
    period: Period
    limit: int | None
    redis_key: str
    resets_at: float  # epoch seconds of the next UTC boundary
    ttl_s: int


def windows(now: float) -> dict[Period, tuple[str, float]]:
    """For each period: (id of the one containing ``now``, epoch seconds when it ends), in UTC.

    One ``gmtime`` and arithmetic, no ``datetime``: it runs twice per request (key and tenant). Epoch
    time has no leap seconds, so hours and days are whole multiples of 3600 and 86400 seconds."""
    at = time.gmtime(now)
    y, m, d, h = str(at.tm_year), _TWO_DIGITS[at.tm_mon], _TWO_DIGITS[at.tm_mday], _TWO_DIGITS[at.tm_hour]
    next_month = calendar.timegm((at.tm_year + at.tm_mon // 12, at.tm_mon % 12 + 1, 1, 0, 0, 0))
    day = "d" + y + m + d
    return {
        "day": (day, now - now % 86400 + 86400),
        "month": ("m" + y + m, float(next_month)),
        "hour": ("h" + day[1:] + h, now - now % 3600 + 3600),
    }


def window(period: Period, now: float) -> tuple[str, float]:
    """(id of the period containing ``now``, epoch seconds when it ends), both in UTC."""
    return windows(now)[period]


def scope_prefix(prefix: str, tenant: str) -> str:
    """Everything of one tenant shares a Redis Cluster hash slot, so one script can touch it all."""
    return f"{prefix}:{{t:{tenant}}}"


def usage_key(prefix: str, tenant: str, scope: str, name: str, period_id: str) -> str:
    return f"{scope_prefix(prefix, tenant)}:usage:{scope}:{name}:{period_id}"


def budgets_for(prefix: str, tenant: str, scope: str, name: str, limits: Limits, now: float) -> list[Budget]:
    """The day and month budgets of one scope, then its hour (never limited: counted for the history)."""
    out = []
    ids = windows(now)
    for period, limit in (("day", limits.tokens_per_day), ("month", limits.tokens_per_month), ("hour", None)):
        period_id, resets_at = ids[period]  # type: ignore[index]
        key = usage_key(prefix, tenant, scope, name, period_id)
        out.append(Budget(scope, name, period, limit, key, resets_at, _TTL_S[period]))  # type: ignore[arg-type]
    return out


def exhausted(budget: Budget, used: int, requested: int, now: float) -> RateLimited:
    """The 429 for a spent budget: which budget, how much is used, and when it resets."""
    wait = max(1, int(budget.resets_at - now + 0.999))
    label = "daily" if budget.period == "day" else "monthly"
    resets = datetime.fromtimestamp(budget.resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    message = (
        f"The {label} token budget of {budget.scope} '{budget.name}' is exhausted: used {used} of"
        f" {budget.limit} tokens, this request needs about {requested}. It resets at {resets}"
        f" (in {format_duration(wait * 1000)})."
    )
    return RateLimited(
        message,
        code="insufficient_quota",
        headers={"retry-after": str(wait)},
    )


#: A second's fraction as ``format_duration`` writes it, by its milliseconds: "", ".001", ..., ".5", ..., ".999".
_FRACTIONS = tuple(f".{ms:03d}".rstrip("0") if ms else "" for ms in range(1000))


def format_duration(ms: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``, ``1h2m3s``."""
    if type(ms) is int and 0 <= ms < 3_600_000:
        # A reset from Redis: whole milliseconds, under an hour. Integer arithmetic and the fractions'
        # table give the general path's text (tests/plugins/tenancy/test_format_duration.py) in 0.17-0.22
        # against 0.26-1.52 µs; each admitted request writes two, in its x-ratelimit-reset-* headers.
        whole_minutes, under_a_minute = divmod(ms, 60_000)
        if not whole_minutes and under_a_minute < 1000:
            return f"{under_a_minute}ms"
        whole, frac = divmod(under_a_minute, 1000)
        return f"{whole_minutes}m{whole}{_FRACTIONS[frac]}s" if whole_minutes else f"{whole}{_FRACTIONS[frac]}s"
    ms = max(0.0, ms)
    if ms < 1000:
        return f"{int(ms)}ms"
    total = ms / 1000
    hours, rest = divmod(total, 3600)
    minutes, seconds = divmod(rest, 60)
    sec = f"{seconds:.3f}".rstrip("0").rstrip(".") + "s"
    if hours >= 1:
        return f"{int(hours)}h{int(minutes)}m{sec}"
    if minutes >= 1:
        return f"{int(minutes)}m{sec}"
    return sec


async def usage_report(
    redis: aioredis.Redis, prefix: str, tenant: str, scope: str, name: str, limits: Limits, clock: Any = time.time
) -> dict[str, Any]:
    """Usage of one key or tenant in the current day and month, with its budgets and reset times."""
    now = clock()
    budgets = [b for b in budgets_for(prefix, tenant, scope, name, limits, now) if b.period != "hour"]
    async with redis.pipeline(transaction=False) as pipe:
        for budget in budgets:
            pipe.hmget(budget.redis_key, list(_FIELDS))
        rows = await pipe.execute()
    out: dict[str, Any] = {"scope": scope, "name": name, "tenant": tenant}
    for budget, row in zip(budgets, rows, strict=True):
        counts = {f: int(v) if v is not None else 0 for f, v in zip(_FIELDS, row, strict=True)}
        out[budget.period] = {
            **counts,
            "budget_tokens": budget.limit,
            "resets_at": datetime.fromtimestamp(budget.resets_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        }
    return out
