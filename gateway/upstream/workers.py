"""The workers the gateway knows, their health and load.

Worker state lives outside the config snapshot: a reload that keeps a worker keeps its health and load
counters. Active health checks (``GET /health``) run in the background; passive signals (connect errors,
5xx, resets, a slow first byte) come from the upstream path through ``report_failure`` /
``report_success``, which eject a failing worker for a growing interval.

Only the worker's own failures count, and no single tenant can eject a worker that serves others:
a failure that a request's content could have caused (a 5xx, a reset, a slow first byte) names its
``source`` (the tenant), and ejection then needs failures from ``min_sources`` distinct tenants, or
from every tenant that used the worker lately when fewer did. A refused connection names no source
(no request content reached the worker) and always counts. What counts as the worker's failure is
decided by the caller (``gateway.proxy``): a non-streamed request's slow first byte is its own long
generation, not the worker's fault.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from functools import cached_property

from gateway.ops.tasks import cancel_and_wait
from gateway.upstream.adapters import WorkerAdapters
from gateway.upstream.kv_feed import KvFeed
from gateway.upstream.worker_load import LoadPoller

log = logging.getLogger("gateway.workers")
_RECENT_S = 60.0  # how long a tenant counts as one of a worker's users


@dataclass(eq=False, slots=True)
class Worker:
    url: str
    healthy: bool = True  # optimistic until the first check says otherwise
    in_flight: int = 0
    consecutive_failures: int = 0
    health_timeouts: int = 0  # consecutive /health checks that timed out
    ejected_until: float = 0.0
    ejections: int = 0
    last_error: str | None = None
    checked_at: float = 0.0
    labels: dict[str, str] = field(default_factory=dict)
    failure_sources: set[str] = field(default_factory=set)  # tenants behind the current failure run
    recent_sources: dict[str, float] = field(default_factory=dict)  # tenant -> last request (monotonic)
    recent_cap: int = 64  # recent_sources is pruned when it grows past this
    adapters: WorkerAdapters = field(default_factory=WorkerAdapters)  # LoRA adapters it holds

    def seen(self, source: str, now: float) -> None:
        """Note a request of ``source`` (a tenant). Stale tenants are dropped only when the table has
        doubled since the last pruning, so a request costs O(1) however many tenants there are."""
        recent = self.recent_sources
        recent[source] = now
        if len(recent) > self.recent_cap:
            for name in [n for n, at in recent.items() if now - at > _RECENT_S]:
                del recent[name]
            self.recent_cap = max(64, 2 * len(recent))

    def users(self, now: float) -> int:
        """The distinct tenants with a request in the last ``_RECENT_S`` (asked on failures only)."""
        return sum(1 for at in self.recent_sources.values() if now - at <= _RECENT_S)

    def available(self, now: float | None = None) -> bool:
        if not self.healthy:
            return False
        return self.ejected_until <= (now if now is not None else time.monotonic())


class WorkerTable:
    """All workers by URL, with outlier ejection and a background health loop."""

    def __init__(
        self,
        *,
        eject_after_failures: int = 3,
        base_ejection_s: float = 2.0,
        max_ejection_s: float = 60.0,
    ) -> None:
        self._workers: dict[str, Worker] = {}
        self.eject_after_failures = eject_after_failures
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self._task: asyncio.Task[None] | None = None
        self.on_change: list[Callable[[Worker], None]] = []
        #: Called with a worker's URL when it leaves the table for good (no longer configured or
        #: discovered, and its last request finished): what is kept per worker elsewhere (its metric
        #: series) can go. Not called for a worker that is only unhealthy or ejected.
        self.on_removed: list[Callable[[str], None]] = []
        self._static: list[str] = []
        self._discovered: dict[str, list[str]] = {}
        # Workers no longer configured that still had requests in flight: dropped once those finish.
        self._leaving: set[str] = set()
        #: Bumped whenever the set of workers changes, so callers can cache what they derive from it.
        self.generation = 0
        self._first_byte_s: dict[str, float] = {}  # model -> moving average of a stream's first byte

    def sync(self, urls: Iterable[str]) -> None:
        """Make the table hold exactly ``urls`` plus the discovered workers (new ones start optimistic;
        kept ones keep state)."""
        self._static = list(dict.fromkeys(urls))
        self._rebuild()

    def set_discovered(self, ref: str, urls: Iterable[str]) -> bool:
        """A discovery source says ``ref`` (e.g. ``dns://name:port``) now means ``urls``; they join the
        table and its health checks. Returns True when that changed anything."""
        new = list(dict.fromkeys(urls))
        if self._discovered.get(ref) == new:
            return False
        self._discovered[ref] = new
        self._rebuild()
        return True

    def retain_discovered(self, refs: Iterable[str]) -> None:
        """Forget discovered refs that are not in ``refs`` (no longer named by any model)."""
        keep = set(refs)
        stale = [ref for ref in self._discovered if ref not in keep]
        for ref in stale:
            del self._discovered[ref]
        if stale:
            self._rebuild()

    def expand(self, refs: Iterable[str]) -> list[str]:
        """Worker refs as URLs: a discovered ref becomes its current addresses (none until resolved)."""
        out: list[str] = []
        for ref in refs:
            if ref.startswith("dns://"):
                out.extend(self._discovered.get(ref, ()))
            else:
                out.append(ref)
        return out

    def _rebuild(self) -> None:
        wanted = dict.fromkeys([*self._static, *(u for urls in self._discovered.values() for u in urls)])
        self._leaving = {url for url in self._workers if url not in wanted}
        self._drop_idle_leavers()
        for url in wanted:
            self._workers.setdefault(url, Worker(url=url))
        self.generation += 1

    def _drop_idle_leavers(self) -> bool:
        """Forget the unconfigured workers whose requests have finished; True if any went."""
        gone = [url for url in self._leaving if url not in self._workers or self._workers[url].in_flight == 0]
        for url in gone:
            self._workers.pop(url, None)
            self._leaving.discard(url)
            for callback in self.on_removed:
                callback(url)
        return bool(gone)

    def get(self, url: str) -> Worker:
        worker = self._workers.get(url)
        if worker is None:
            worker = self._workers[url] = Worker(url=url)
        return worker

    def all(self) -> list[Worker]:
        """Every configured worker, and removed ones while they still have requests in flight."""
        if self._leaving and self._drop_idle_leavers():
            self.generation += 1
        return list(self._workers.values())

    def report_success(self, worker: Worker, source: str | None = None) -> None:
        if source is not None:
            worker.seen(source, time.monotonic())
        if worker.consecutive_failures or worker.ejected_until:
            worker.consecutive_failures = 0
            worker.failure_sources.clear()
            worker.ejected_until = 0.0
            worker.ejections = 0
            self._changed(worker)

    def report_failure(self, worker: Worker, reason: str, source: str | None = None, min_sources: int = 1) -> None:
        """A failure of the worker's. After a few in a row the worker is ejected for a while, longer
        each time it is ejected again without a success in between. With a ``source`` (the tenant
        whose request failed), the run must span ``min_sources`` tenants, or all of the worker's
        recent ones if fewer: one tenant's requests alone cannot eject a worker others use."""
        worker.consecutive_failures += 1
        worker.last_error = reason
        if source is not None:
            now = time.monotonic()
            worker.seen(source, now)
            worker.failure_sources.add(source)
            if len(worker.failure_sources) < min(min_sources, worker.users(now)):
                return
        if worker.consecutive_failures >= self.eject_after_failures:
            worker.ejections += 1
            hold = min(self.base_ejection_s * (2 ** (worker.ejections - 1)), self.max_ejection_s)
            worker.ejected_until = time.monotonic() + hold
            worker.consecutive_failures = 0
            worker.failure_sources.clear()
            log.warning("worker %s ejected for %.1fs after repeated failures (%s)", worker.url, hold, reason)
            self._changed(worker)

    def observe_first_byte(self, model: str, seconds: float) -> float | None:
        """Fold one stream's time to first byte into the model's usual one; returns the usual one as it
        was before (None for the first). Slow outliers move it only a little (a moving average)."""
        usual = self._first_byte_s.get(model)
        self._first_byte_s[model] = seconds if usual is None else usual + 0.05 * (min(seconds, 4 * usual) - usual)
        return usual

    def set_health(self, worker: Worker, healthy: bool, reason: str | None = None) -> None:
        worker.checked_at = time.monotonic()
        if healthy != worker.healthy:
            worker.healthy = healthy
            worker.last_error = None if healthy else reason
            if not healthy:  # it may be restarting: run-time adapters do not survive that
                worker.adapters.forget()
            log.log(
                logging.INFO if healthy else logging.WARNING,
                "worker %s is %s%s",
                worker.url,
                "healthy" if healthy else "unhealthy",
                f" ({reason})" if reason else "",
            )
            self._changed(worker)

    def _changed(self, worker: Worker) -> None:
        for callback in self.on_change:
            callback(worker)

    def start_health_checks(
        self, probe: Callable[[str], Awaitable[str | None]], interval_s: float, *, timeouts_before_unhealthy: int = 1
    ) -> None:
        """Run ``probe(url) -> None (healthy) | reason`` for every worker each ``interval_s``.

        A probe that raises ``TimeoutError`` marks its worker unhealthy only at the
        ``timeouts_before_unhealthy``-th in a row, and leaves its health as it was before that: a worker
        whose server is busy (one core running a long prefill, a burst of streams) answers /health late
        while it still serves, and calling it unhealthy would turn every request away from it and drop
        its KV index and adapters. A dead process refuses the connection, which counts at once."""

        async def loop() -> None:
            while True:
                workers = self.all()
                results = await asyncio.gather(*(probe(w.url) for w in workers), return_exceptions=True)
                for worker, result in zip(workers, results, strict=True):
                    self._health_result(worker, result, timeouts_before_unhealthy)
                await asyncio.sleep(interval_s)

        self._task = asyncio.create_task(loop(), name="worker-health")

    def _health_result(self, worker: Worker, result: str | BaseException | None, timeouts_allowed: int) -> None:
        if isinstance(result, TimeoutError):
            worker.health_timeouts += 1
            if worker.health_timeouts >= timeouts_allowed:
                self.set_health(worker, False, "health check timed out")
            return
        worker.health_timeouts = 0
        if isinstance(result, BaseException):
            self.set_health(worker, False, f"{type(result).__name__}")
        else:
            self.set_health(worker, result is None, result)

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
        await self.close_signals()

    # -- per-worker state from the workers' own signals (KV cache events, load), for routing ---------

    @cached_property
    def kv(self) -> KvFeed:
        """The blocks each followed worker holds, from its KV cache events (``gateway.upstream.kv_feed``).
        A worker that fails its health check may come back as a new process: its entries are dropped."""
        feed = KvFeed()
        self.on_change.append(lambda worker: None if worker.healthy else feed.drop(worker.url, "unhealthy"))
        return feed

    @cached_property
    def load(self) -> LoadPoller:
        """Each polled worker's own load: running and waiting requests, KV cache use (its /metrics)."""
        return LoadPoller()

    def kv_blocks(self, url: str) -> int | None:
        """The KV blocks indexed for worker ``url`` (None while no worker's events are followed)."""
        return self.kv.index.blocks(url) if "kv" in self.__dict__ else None

    async def close_signals(self) -> None:
        if "kv" in self.__dict__:
            await self.kv.aclose()
        if "load" in self.__dict__:
            await self.load.aclose()
