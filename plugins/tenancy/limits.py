"""Requests- and tokens-per-minute limits (GCRA) checked together with token budgets, atomically.

Each limit is a GCRA bucket (the "generic cell rate algorithm" used by redis-cell and Stripe): one
number per bucket, the theoretical arrival time (TAT). A limit of N per minute lets N arrive at once
and then refills one every 60/N seconds; a cost of k tokens moves the TAT k intervals forward. One
Lua script checks every bucket and budget of a request (key and tenant, requests and tokens, day and
month) and either counts all of them or none, so concurrent requests on any number of replicas can
never be admitted past a limit. The time is Redis's own (``TIME``), so replica clocks do not matter.

Admission reserves a request's worst case (``admit``); asked to clamp, the same script reserves as
many tokens as every bucket and budget has left, but no fewer than the request's least, in one step.
Asked not to reserve, it is a dry run (``check``): the same decision, with nothing but a refusal counted.
The charge is settled later by a second script (``charge``): it moves the token buckets by the
difference between what was reserved and what was delivered (a refund when negative) and adds the
usage to the budget counters (an hourly counter among them, for the usage history; a refusal is
counted there too, by the same call). So a limit is passed at most by the difference between a request's
reservation and its true cost, which only a prompt longer than its estimate can make positive.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from gateway.infra.redis_api import RedisPipeline
from gateway.infra.redis_script import ScriptCall
from plugins.tenancy.budgets import Budget, format_duration

Kind = Literal["requests", "tokens"]
#: What a call to Redis may raise: Redis's own errors, a connection's, a timeout.
REDIS_ERRORS = (RedisError, OSError, TimeoutError)
PERIOD_MS = 60_000

_ADMIT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
-- ARGV: what changes per request first (want, least, reserve), then the plan's: nb, per bucket (limit,
-- period, counts requests?), per budget (limit or -1, ttl). With reserve '0' (a dry run) the decision is
-- the same, but an admitted request is not counted: only a refusal is written.
local want, least, nb = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local reserve = ARGV[3] == '1'
local status, which, retry = 0, 0, 0
local tats = {}
-- the tokens to reserve: want, or (clamping) as many as every token bucket and budget has left,
-- but never fewer than least (a request that cannot get least is refused below)
local grant = want
for i = 1, nb do
  local limit, period = tonumber(ARGV[3*i+2]), tonumber(ARGV[3*i+3])
  local tat = tonumber(redis.call('GET', KEYS[i])) or now
  if tat < now then tat = now end
  tats[i] = tat
  if ARGV[3*i+4] == '0' then
    local room = math.floor((now + period - tat) * limit / period)
    if room < grant then grant = room end
  end
end
local base = 3 * nb + 4
local used = {}
for j = 1, #KEYS - nb do
  local budget = tonumber(ARGV[base + 2*j - 1])
  used[j] = tonumber(redis.call('HGET', KEYS[nb + j], 'tokens')) or 0
  if budget >= 0 and budget - used[j] < grant then grant = budget - used[j] end
end
if grant < least then grant = least end
local news = {}
for i = 1, nb do
  local limit, period = tonumber(ARGV[3*i+2]), tonumber(ARGV[3*i+3])
  local cost = grant
  if ARGV[3*i+4] == '1' then cost = 1 end
  local new = tats[i] + cost * period / limit
  news[i] = new
  if status == 0 then
    if cost > limit then status, which = 3, i
    elseif new - period > now then status, which, retry = 1, i, new - period - now end
  end
end
for j = 1, #KEYS - nb do
  local budget = tonumber(ARGV[base + 2*j - 1])
  if status == 0 and budget >= 0 and used[j] + grant > budget then status, which = 2, j end
end
-- what is left is reported as it is after this call: after the reservation, or as it was without one
local counted = status == 0 and reserve
local out = {status, which, math.ceil(retry), grant}
for i = 1, nb do
  local limit, period = tonumber(ARGV[3*i+2]), tonumber(ARGV[3*i+3])
  local level = tats[i]
  if counted then
    level = news[i]
    redis.call('SET', KEYS[i], tostring(level), 'PX', math.ceil(level - now) + 1000)
  end
  out[#out + 1] = math.floor((period - (level - now)) * limit / period)
  out[#out + 1] = math.ceil(level - now)
end
for j = 1, #KEYS - nb do
  if counted then
    local ttl = tonumber(ARGV[base + 2*j])
    redis.call('HINCRBY', KEYS[nb + j], 'tokens', grant)
    redis.call('HINCRBY', KEYS[nb + j], 'requests', 1)
    redis.call('EXPIRE', KEYS[nb + j], ttl)
    used[j] = used[j] + grant
  end
  out[#out + 1] = used[j]
end
-- a refusal is counted in every usage hash of the request (key and tenant; hour, day, month), dry run
-- or not
if status ~= 0 then
  for j = 1, #KEYS - nb do
    redis.call('HINCRBY', KEYS[nb + j], 'refusals', 1)
    redis.call('EXPIRE', KEYS[nb + j], tonumber(ARGV[base + 2*j]))
  end
end
return out
"""

_CHARGE = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
-- ARGV: what changes per request first (delta, prompt, completion), then the plan's: nb, per token
-- bucket (limit, period), per budget its ttl
local delta, prompt, completion = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local nb = tonumber(ARGV[4])
for i = 1, nb do
  local limit, period = tonumber(ARGV[2*i+3]), tonumber(ARGV[2*i+4])
  local tat = tonumber(redis.call('GET', KEYS[i])) or now
  if tat < now then tat = now end
  local new = tat + delta * period / limit
  if new > now then
    redis.call('SET', KEYS[i], tostring(new), 'PX', math.ceil(new - now) + 1000)
  else
    redis.call('DEL', KEYS[i])
  end
end
local base = 2 * nb + 4
for j = 1, #KEYS - nb do
  local k = KEYS[nb + j]
  redis.call('HINCRBY', k, 'tokens', delta)
  redis.call('HINCRBY', k, 'prompt_tokens', prompt)
  redis.call('HINCRBY', k, 'completion_tokens', completion)
  redis.call('EXPIRE', k, tonumber(ARGV[base + j]))
end
return 1
"""


# Identity equality: each request's decision keys its counters by them (a field-by-field hash per lookup
# was a measurable share of admission); a plan builds each once.
@dataclass(frozen=True, slots=True, eq=False)
class Bucket:
    scope: str  # "key" | "tenant"
    name: str
    kind: Kind
    limit: int
    redis_key: str


@dataclass(frozen=True, slots=True)
class Plan:
    """Every counter one request touches."""

    buckets: list[Bucket]
    budgets: list[Budget]
    #: The limiter's script calls for this plan, by script SHA, made on first use: a plan is kept for
    #: its hour (``plans.Plans``), so their fixed parts are packed once for all its requests.
    calls: dict[str, ScriptCall] = field(default_factory=dict, compare=False, repr=False)


@dataclass(slots=True)
class Decision:
    """The outcome of one admission: refused or not, and what headers describe the limits now."""

    status: int  # 0 admitted, 1 over a rate limit, 2 over a budget, 3 larger than a limit
    bucket: Bucket | None = None
    budget: Budget | None = None
    retry_after_ms: int = 0
    granted: int = 0  # tokens reserved (or, refused, the least the request needed)
    remaining: dict[Bucket, tuple[int, int]] = field(default_factory=dict)  # bucket -> (remaining, reset ms)
    used: dict[Budget, int] = field(default_factory=dict)

    @property
    def admitted(self) -> bool:
        return self.status == 0

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers, for the tightest bucket of each kind."""
        # kind -> (bucket, remaining, reset ms) of the bucket with least left (the later reset on a tie)
        tightest: dict[str, tuple[Bucket, int, int]] = {}
        for bucket, (remaining, reset_ms) in self.remaining.items():
            known = tightest.get(bucket.kind)
            if known is None or remaining < known[1] or (remaining == known[1] and reset_ms > known[2]):
                tightest[bucket.kind] = (bucket, remaining, reset_ms)
        out: dict[str, str] = {}
        for kind, (limit_name, remaining_name, reset_name) in _HEADER_NAMES.items():
            found = tightest.get(kind)
            if found is not None:
                bucket, remaining, reset_ms = found
                out[limit_name] = str(bucket.limit)
                out[remaining_name] = str(max(0, min(bucket.limit, remaining)))
                out[reset_name] = format_duration(reset_ms)
        return out


#: The headers of each kind of bucket, in the order they are sent (built once, not per request).
_HEADER_NAMES = {
    kind: (f"x-ratelimit-limit-{kind}", f"x-ratelimit-remaining-{kind}", f"x-ratelimit-reset-{kind}")
    for kind in ("requests", "tokens")
}


def _admit_call(script: AsyncScript, plan: Plan) -> ScriptCall:
    """The admission script for ``plan``: every bucket and budget, each with its limits (ARGV after the
    request's own ``want``, ``least`` and ``reserve``)."""
    keys = [b.redis_key for b in plan.buckets] + [g.redis_key for g in plan.budgets]
    fixed: list[int] = [len(plan.buckets)]
    for b in plan.buckets:
        fixed += [b.limit, PERIOD_MS, 1 if b.kind == "requests" else 0]
    for g in plan.budgets:
        fixed += [g.limit if g.limit is not None else -1, g.ttl_s]
    return ScriptCall(script, keys, fixed)


def _charge_call(script: AsyncScript, plan: Plan) -> ScriptCall:
    """The charge script for ``plan``: its token buckets and budgets (ARGV after the request's delta,
    prompt and completion tokens)."""
    token_buckets = [b for b in plan.buckets if b.kind == "tokens"]
    keys = [b.redis_key for b in token_buckets] + [g.redis_key for g in plan.budgets]
    fixed: list[int] = [len(token_buckets)]
    for b in token_buckets:
        fixed += [b.limit, PERIOD_MS]
    fixed += [g.ttl_s for g in plan.budgets]
    return ScriptCall(script, keys, fixed)


def _plan_call(plan: Plan, script: AsyncScript, make: Callable[[AsyncScript, Plan], ScriptCall]) -> ScriptCall:
    """``plan``'s call of ``script``, made by ``make`` the first time (kept on the plan for its hour)."""
    call = plan.calls.get(script.sha)
    if call is None:
        call = plan.calls[script.sha] = make(script, plan)
    return call


class RedisLimiter:
    """Admission and charging against Redis. Redis errors propagate; the plugin applies its policy."""

    def __init__(self, redis: aioredis.Redis, pipeline: RedisPipeline) -> None:
        self._admit = redis.register_script(_ADMIT)
        self._charge = redis.register_script(_CHARGE)
        self._pipeline = pipeline  # concurrent requests' admissions and charges share one round trip

    async def admit(self, plan: Plan, tokens: int, least: int | None = None) -> Decision:
        """Reserve ``tokens`` in every token bucket and budget of ``plan`` (and one request in each
        request bucket), all or nothing. With ``least`` below ``tokens``, reserve as many as all of them
        have left but at least ``least`` (``Decision.granted`` says how many)."""
        call = _plan_call(plan, self._admit, _admit_call)
        raw = await self._pipeline.run_script(call, (tokens, tokens if least is None else least, 1))
        return _decision(plan, raw)

    async def check(self, plan: Plan, tokens: int) -> Decision:
        """What ``admit(plan, tokens)`` would decide now, reserving nothing (a refusal is counted in the
        usage history, as ``admit`` counts one): for a request whose own admission comes later, when
        refusing it early saves work. The admission script itself decides, as a dry run (``reserve`` 0),
        so the two cannot disagree."""
        call = _plan_call(plan, self._admit, _admit_call)
        return _decision(plan, await self._pipeline.run_script(call, (tokens, tokens, 0)))

    async def charge(self, plan: Plan, delta: int, prompt: int, completion: int) -> None:
        await self._pipeline.run_script(_plan_call(plan, self._charge, _charge_call), (delta, prompt, completion))

    def charge_soon(self, plan: Plan, delta: int, prompt: int, completion: int) -> asyncio.Future[Any]:
        """``charge`` queued in this loop turn's batch for a caller that does not wait for it: the future
        gets the reply or the error (``NoScriptError`` too: then ``charge`` loads the script)."""
        return self._pipeline.submit_script(_plan_call(plan, self._charge, _charge_call), (delta, prompt, completion))


def _decision(plan: Plan, answer: list[int]) -> Decision:
    """The admission script's answer for ``plan`` (a dry run's too), read. Its numbers are Redis integer
    replies, ints already (converting each again was more than half of this function's time, per request)."""
    status, which = answer[0], answer[1]
    decision = Decision(status, retry_after_ms=answer[2], granted=answer[3])
    remaining, at = decision.remaining, 4
    for bucket in plan.buckets:
        remaining[bucket] = (answer[at], answer[at + 1])
        at += 2
    used = decision.used
    for budget in plan.budgets:
        used[budget] = answer[at]
        at += 1
    if status in (1, 3):
        decision.bucket = plan.buckets[which - 1]
    elif status == 2:
        decision.budget = plan.budgets[which - 1]
    return decision


class LocalLimiter:
    """The same GCRA buckets in process memory: the fail_open fallback while Redis is unreachable.

    Each replica then enforces ``share`` of every rate limit on its own (budgets are not enforced:
    their counters live in Redis). Bounded: the table is cleared when it grows past ``max_entries``.
    """

    def __init__(self, share: float, max_entries: int = 100_000, clock: object = time.monotonic) -> None:
        self._share = share
        self._max_entries = max_entries
        self._clock = clock
        self._tat: dict[str, float] = {}

    def _limit(self, bucket: Bucket) -> int:
        return max(1, math.floor(bucket.limit * self._share))

    def admit(self, plan: Plan, tokens: int, least: int | None = None) -> Decision:
        now = self._clock() * 1000  # type: ignore[operator]
        news: list[tuple[Bucket, float, float]] = []
        if least is not None and least < tokens:
            for bucket in plan.buckets:
                if bucket.kind == "tokens":
                    level = max(self._tat.get(bucket.redis_key, now), now)
                    room = math.floor((now + PERIOD_MS - level) * self._limit(bucket) / PERIOD_MS)
                    tokens = max(least, min(tokens, room))
        decision = Decision(0, granted=tokens)
        for bucket in plan.buckets:
            limit = self._limit(bucket)
            cost = 1 if bucket.kind == "requests" else tokens
            tat = max(self._tat.get(bucket.redis_key, now), now)
            new = tat + cost * PERIOD_MS / limit
            news.append((bucket, tat, new))
            if decision.status == 0 and cost > limit:
                decision.status, decision.bucket = 3, bucket
            elif decision.status == 0 and new - PERIOD_MS > now:
                decision.status, decision.bucket = 1, bucket
                decision.retry_after_ms = math.ceil(new - PERIOD_MS - now)
        if len(self._tat) > self._max_entries:
            self._tat.clear()
        for bucket, tat, new in news:
            level = new if decision.admitted else tat
            if decision.admitted:
                self._tat[bucket.redis_key] = new
            limit = self._limit(bucket)
            remaining = math.floor((PERIOD_MS - (level - now)) * limit / PERIOD_MS)
            decision.remaining[bucket] = (remaining, math.ceil(level - now))
        return decision

    def charge(self, plan: Plan, delta: int) -> None:
        now = self._clock() * 1000  # type: ignore[operator]
        for bucket in plan.buckets:
            if bucket.kind == "tokens" and bucket.redis_key in self._tat:
                tat = max(self._tat[bucket.redis_key], now)
                self._tat[bucket.redis_key] = max(now, tat + delta * PERIOD_MS / self._limit(bucket))
