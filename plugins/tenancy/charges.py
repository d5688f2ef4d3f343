"""Charges: a settlement's change applied to the counters, without the answer waiting for Redis.

A charge admitted through Redis is queued in this loop turn's batch of Redis commands (one connection,
run in order), ahead of the admission of any later request this gateway makes, so the client's next
request sees it; the answer that caused it does not wait for Redis's reply (a Redis round trip less per
request). The reply is read by a done callback: an error is counted (the answer already went out), and
a script Redis no longer knows (restarted, flushed) is loaded and the charge run again. ``settled()``
waits for every reply still due. A charge admitted by this replica's own limiter (Redis was down and
the deployment fails open) goes to that limiter.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from redis.exceptions import NoScriptError

from plugins.tenancy.admitted import Admitted
from plugins.tenancy.limits import REDIS_ERRORS, LocalLimiter, Plan, RedisLimiter
from plugins.tenancy.metrics import TenancyMetrics

log = logging.getLogger("gateway.tenancy")

#: One charge's arguments for the scripts: (plan, change of the held tokens, prompt, completion).
Charge = tuple[Plan, int, int, int]
#: Told of a Redis call that failed: (operation, the error).
OnRedisError = Callable[[str, BaseException], None]


class Charges:
    """The charges of one tenancy plugin instance, and the replies still due for them."""

    def __init__(
        self, limiter: RedisLimiter, local: LocalLimiter, metrics: TenancyMetrics, on_redis_error: OnRedisError
    ) -> None:
        self.limiter, self.local, self.metrics = limiter, local, metrics
        self._on_redis_error = on_redis_error
        self._due: set[asyncio.Future[Any]] = set()  # charges sent and not answered yet

    @property
    def due(self) -> int:
        """How many charges have not been answered yet (sent, or loading their script again)."""
        return len(self._due)

    def apply(self, tenant: str, admitted: Admitted, delta: int, prompt: int, completion: int) -> None:
        """Count ``prompt`` and ``completion`` tokens for ``tenant`` and change the admission's counters
        by ``delta`` (a settlement of ``admitted``); never waits, never raises for Redis."""
        if prompt > 0:  # a counter: a later refund (an answer refused after it was charged) is not shown
            self.metrics.tokens.labels(tenant, "prompt").inc(prompt)
        if completion > 0:
            self.metrics.tokens.labels(tenant, "completion").inc(completion)
        if not admitted.via_redis:
            self.local.charge(admitted.plan, delta)
            return
        charge: Charge = (admitted.plan, delta, prompt, completion)
        sent = self.limiter.charge_soon(*charge)  # queued: a failure, even a closed pipeline's, is the future's
        self._due.add(sent)
        sent.add_done_callback(partial(self._answered, charge))

    async def settled(self) -> None:
        """Wait for the replies still due (tests; retiring the plugin)."""
        while self._due:
            await asyncio.gather(*list(self._due), return_exceptions=True)

    def _answered(self, charge: Charge, sent: asyncio.Future[Any]) -> None:
        """Redis's reply to a charge (a done callback)."""
        self._due.discard(sent)
        error = sent.exception() if not sent.cancelled() else None
        if error is None:
            return
        if isinstance(error, NoScriptError):
            again = asyncio.get_running_loop().create_task(self._again(charge))
            self._due.add(again)
            again.add_done_callback(self._due.discard)
        elif isinstance(error, REDIS_ERRORS):
            self._on_redis_error("charge", error)
        else:
            log.error("tenancy: a charge failed", exc_info=error)

    async def _again(self, charge: Charge) -> None:
        """The charge once more, awaited: ``charge`` loads a script Redis does not know."""
        try:
            await self.limiter.charge(*charge)
        except REDIS_ERRORS as exc:
            self._on_redis_error("charge", exc)
