"""Admission control per model: a bounded number of requests at the workers, a bounded priority queue
in front of them with a maximum wait, and a fast 429 beyond that.

A client told to come back later (429 with ``Retry-After``) can retry elsewhere or slow down; a request
left to queue into a timeout wastes both the client's time and the worker's. The gate counts requests
from admission until their last attempt finishes (``release``); a retry of an admitted request takes its
slot back without queueing (``reacquire``). Higher ``priority`` waiters are admitted first; within a
priority the queue is fair across tenants (start-time fair queueing): each waiter is tagged with the
later of the queue's virtual time and its tenant's previous tag plus one, and the lowest tag goes
first. A tenant that queues a burst of 100 requests takes tags t..t+99; another tenant's request that
arrives meanwhile is tagged t (or so) and is admitted within a slot or two, not after the burst.
The priority comes from the tenant's config (``RequestContext.priority``), never from the client alone.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Callable

from gateway.wire.errors import RateLimited
from plugins.routing.config import AdmissionConfig


class ModelGate:
    """The in-flight slots and waiting queue of one model. Lives across config reloads (limits are
    updated in place) so requests admitted under the old config still count."""

    __slots__ = ("_heap", "_last_tag", "_on_queue", "_queued", "_seq", "_vtime", "in_flight", "limits", "model")

    def __init__(self, model: str, limits: AdmissionConfig, on_queue: Callable[[str, int], None] | None = None) -> None:
        self.model = model
        self.limits = limits
        self.in_flight = 0
        self._heap: list[tuple[int, int, int, asyncio.Future[None]]] = []
        self._queued = 0
        self._seq = itertools.count()
        self._vtime = 0  # the tag of the waiter admitted last
        self._last_tag: dict[str, int] = {}  # tenant -> tag of its latest waiter
        #: Told the queue length whenever it changes (the core's gateway_queued_requests gauge, which
        #: the autoscaler reads).
        self._on_queue = on_queue

    @property
    def queued(self) -> int:
        return self._queued

    def _queue_changed(self, delta: int) -> None:
        self._queued += delta
        if self._on_queue is not None:
            self._on_queue(self.model, self._queued)

    def _refuse(self, why: str) -> RateLimited:
        retry_after = self.limits.retry_after_s
        return RateLimited(
            f"Model '{self.model}' is at capacity ({why}); retry after {retry_after} s.",
            code="model_overloaded",
            headers={"retry-after": str(retry_after)},
        )

    async def acquire(self, priority: int = 0, tenant: str = "") -> float:
        """Take a slot, waiting in the queue if allowed (fairly across ``tenant``s). Returns the seconds
        waited; raises ``RateLimited`` when the queue is full or the wait runs over ``max_queue_time_s``."""
        limit = self.limits.max_in_flight
        if limit is None or (self.in_flight < limit and not self._queued):
            self.in_flight += 1
            return 0.0
        if self._queued >= self.limits.max_queue:
            raise self._refuse(f"{self.in_flight} requests in flight, {self._queued} waiting")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        tag = max(self._vtime, self._last_tag.get(tenant, -1) + 1)
        self._last_tag[tenant] = tag
        heapq.heappush(self._heap, (-priority, tag, next(self._seq), future))
        self._queue_changed(1)
        started = loop.time()
        try:
            async with asyncio.timeout(self.limits.max_queue_time_s):
                await future
        except BaseException as exc:
            if future.done() and not future.cancelled():
                self.release()  # the slot was handed over just as we gave up: pass it on
            else:
                future.cancel()
                self._queue_changed(-1)
            if isinstance(exc, TimeoutError):
                raise self._refuse(f"waited {self.limits.max_queue_time_s:g} s for a slot") from None
            raise
        return loop.time() - started

    def reacquire(self) -> None:
        """A retry of an already admitted request: it does not queue again."""
        self.in_flight += 1

    def release(self) -> None:
        """A request (or one attempt of it) is done: hand its slot to the best waiter, if any."""
        limit = self.limits.max_in_flight
        while self._heap and (limit is None or self.in_flight <= limit):
            _, tag, _, future = heapq.heappop(self._heap)
            if future.done():  # gave up waiting (timed out or cancelled); already uncounted
                continue
            self._vtime = max(self._vtime, tag)
            if not self._heap:  # nobody waits: no tenant has a backlog to remember
                self._last_tag.clear()
            elif len(self._last_tag) > 4 * len(self._heap) + 64:
                self._last_tag = {t: v for t, v in self._last_tag.items() if v >= self._vtime}
            self._queue_changed(-1)
            future.set_result(None)  # the slot passes to the waiter: in_flight stays the same
            return
        self.in_flight -= 1
