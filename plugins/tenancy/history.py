"""The usage history of one key or tenant: requests, refusals and tokens per UTC hour or day.

Read from the counters the admission and charge scripts keep (``plugins.tenancy.budgets``): one hash
per scope and hour (kept 31 days) and per scope and day (35 days), all read in one pipelined round trip.
A period with no hash (nothing happened, or it expired) is a row of zeros, so every answer has one row
per period, oldest first.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import redis.asyncio as aioredis

from plugins.tenancy.budgets import HISTORY_FIELDS, usage_key, window

HistoryPeriod = Literal["hour", "day"]
MAX_DAYS = 30


def periods(period: HistoryPeriod, days: int, now: float) -> list[datetime]:
    """The starts of the periods covering the last ``days`` days up to the one containing ``now``."""
    at = datetime.fromtimestamp(now, UTC)
    if period == "hour":
        last, step, count = at.replace(minute=0, second=0, microsecond=0), timedelta(hours=1), days * 24
    else:
        last, step, count = at.replace(hour=0, minute=0, second=0, microsecond=0), timedelta(days=1), days
    return [last - step * i for i in range(count - 1, -1, -1)]


async def usage_history(
    redis: aioredis.Redis,
    prefix: str,
    tenant: str,
    scope: str,
    name: str,
    period: HistoryPeriod,
    days: int,
    now: float,
) -> dict[str, Any]:
    """``{"scope", "name", "tenant", "period", "fields", "rows": [{"start", "start_unix", field: n}]}``."""
    starts = periods(period, days, now)
    async with redis.pipeline(transaction=False) as pipe:
        for start in starts:
            period_id = window(period, start.timestamp())[0]
            pipe.hmget(usage_key(prefix, tenant, scope, name, period_id), list(HISTORY_FIELDS))
        raw = await pipe.execute()
    rows = []
    for start, values in zip(starts, raw, strict=True):
        row: dict[str, Any] = {"start": start.strftime("%Y-%m-%dT%H:%M:%SZ"), "start_unix": int(start.timestamp())}
        row.update({f: int(v) if v is not None else 0 for f, v in zip(HISTORY_FIELDS, values, strict=True)})
        rows.append(row)
    return {
        "scope": scope,
        "name": name,
        "tenant": tenant,
        "period": period,
        "fields": list(HISTORY_FIELDS),
        "rows": rows,
    }
