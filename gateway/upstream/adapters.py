"""The LoRA adapters each worker holds, learnt from the worker itself.

Every ``Worker`` carries a ``WorkerAdapters``: the adapters registered on it (by the name the worker
knows, with when each was last used, for least-recently-used eviction), the ones being loaded now, the
ones an operator pinned, and the requests using each. The truth is the worker's own ``GET /v1/models``,
where vLLM lists every registered adapter with ``parent`` naming the base model: ``AdapterSync`` polls it
and ``reconcile`` makes the table match, so a restarted worker (which lost its run-time adapters) is
noticed, as are adapters another gateway replica loaded. A worker that turns unhealthy is forgotten at
once (``forget``): it may be restarting, and a load that finds an adapter already there counts as done.

Routing (``plugins.routing``) reads this state to place requests and changes it when it loads or evicts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import orjson

from gateway.ops.tasks import cancel_and_wait

#: ``get(url, timeout_s) -> (status, body)``: the upstream client's small bounded GET.
Getter = Callable[[str, float], Awaitable[tuple[int, bytes]]]

log = logging.getLogger("gateway.adapters")


@dataclass(slots=True)
class WorkerAdapters:
    """One worker's adapters (names as the worker knows them: the adapters' served names)."""

    held: dict[str, float] = field(default_factory=dict)  # name -> last use (monotonic)
    learnt: dict[str, float] = field(default_factory=dict)  # name -> when the gateway learnt it held it
    paths: dict[str, str] = field(default_factory=dict)  # name -> the path this gateway loaded it from
    loading: set[str] = field(default_factory=set)
    unloading: set[str] = field(default_factory=set)  # not held, though the worker may list them a while
    pinned: set[str] = field(default_factory=set)
    active: dict[str, int] = field(default_factory=dict)  # name -> requests using it now
    synced_at: float = 0.0  # last successful read of the worker's /v1/models (monotonic), 0: never

    def holds(self, name: str) -> bool:
        """Registered on the worker, or being loaded there now (a request may wait for that load)."""
        return name in self.held or name in self.loading

    def occupied(self) -> int:
        return len(self.held.keys() | self.loading)  # an adapter reloaded in place is in both

    def holds_from(self, name: str, path: str) -> bool:
        """Held, and not known to be loaded from another path (one learnt from the worker is taken as is)."""
        return name in self.held and self.paths.get(name, path) == path

    def touch(self, name: str, now: float) -> None:
        if name in self.held:
            self.held[name] = now

    def added(self, name: str, now: float, path: str | None = None) -> None:
        self.loading.discard(name)
        self.held[name] = now
        self.learnt[name] = now
        if path is not None:
            self.paths[name] = path

    def removed(self, name: str) -> None:
        self.held.pop(name, None)
        self.learnt.pop(name, None)
        self.paths.pop(name, None)

    def lru_victim(self) -> str | None:
        """The least recently used adapter that may be unloaded: not pinned, no request using it."""
        candidates = [(used, name) for name, used in self.held.items() if name not in self.pinned]
        idle = [c for c in candidates if not self.active.get(c[1])]
        return min(idle)[1] if idle else None

    def acquire(self, name: str) -> None:
        self.active[name] = self.active.get(name, 0) + 1

    def release(self, name: str) -> None:
        left = self.active.get(name, 0) - 1
        if left > 0:
            self.active[name] = left
        else:
            self.active.pop(name, None)

    def describe(self, now: float) -> list[dict[str, object]]:
        """For operators (admin API, console): each adapter held or being loaded, by name."""
        rows: list[dict[str, object]] = [
            {
                "name": name,
                "state": "held",
                "pinned": name in self.pinned,
                "in_use": self.active.get(name, 0),
                "idle_s": round(now - used, 3) if used else None,
            }
            for name, used in sorted(self.held.items())
        ]
        rows += [
            {"name": name, "state": "loading", "pinned": name in self.pinned, "in_use": 0, "idle_s": None}
            for name in sorted(self.loading)
        ]
        return rows

    def forget(self) -> None:
        """The worker may have restarted: what it held is unknown until the next read."""
        self.held.clear()
        self.learnt.clear()
        self.paths.clear()
        self.synced_at = 0.0

    def reconcile(
        self, listed: Iterable[str] | Mapping[str, str | None], asked_at: float, now: float
    ) -> tuple[list[str], list[str]]:
        """Match the worker's own list, read by a request sent at ``asked_at``: adapters it no longer lists
        are dropped (unless learnt after the request was sent: a load that raced the read), ones it lists
        that were unknown are added as least recently used, with the path the worker says it read each
        from when ``listed`` maps names to paths. Returns (added, dropped)."""
        roots = listed if isinstance(listed, Mapping) else {}
        listed = set(listed)
        dropped = [n for n in self.held if n not in listed and self.learnt.get(n, 0.0) <= asked_at]
        for name in dropped:
            self.removed(name)
        added = [n for n in listed if n not in self.held and n not in self.loading and n not in self.unloading]
        for name in added:
            self.held[name] = 0.0
            self.learnt[name] = now
            root = roots.get(name)
            if root:  # loaded from another path than the configured one: loaded again before use
                self.paths[name] = root
        self.synced_at = now
        return added, dropped


def listed_adapters(body: bytes) -> dict[str, str | None] | None:
    """The adapters in a vLLM ``/v1/models`` answer (cards with a ``parent``: the base model they adapt),
    each with its ``root``, the path the worker read it from; None when the body is not such an answer."""
    try:
        data = orjson.loads(body).get("data")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    if not isinstance(data, list):
        return None
    return {
        c["id"]: c["root"] if isinstance(c.get("root"), str) else None
        for c in data
        if isinstance(c, dict) and c.get("parent") and isinstance(c.get("id"), str)
    }


class HoldsAdapters(Protocol):
    """A worker as the sync sees it (``gateway.upstream.workers.Worker``)."""

    url: str
    adapters: WorkerAdapters


class AdapterSync:
    """Reads ``/v1/models`` of the workers ``workers()`` returns every ``interval_s`` and reconciles
    each one's ``WorkerAdapters``."""

    def __init__(
        self,
        get: Getter,
        workers: Callable[[], Sequence[HoldsAdapters]],
        *,
        interval_s: float,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._get = get
        self._workers = workers
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._clock = clock
        self._task: asyncio.Task[None] | None = None

    async def sync_one(self, worker: HoldsAdapters) -> bool:
        """Read one worker's list and reconcile; False when it could not be read."""
        url, state = worker.url, worker.adapters
        asked_at = self._clock()
        try:
            status, body = await self._get(url + "/v1/models", self.timeout_s)
        except Exception as exc:  # unreachable, restarting, too slow (aiohttp's errors included)
            log.debug("adapters of %s not read: %s", url, exc)
            return False
        names = listed_adapters(body) if status == 200 else None
        if names is None:
            return False
        added, dropped = state.reconcile(names, asked_at, self._clock())
        if dropped:
            log.warning("worker %s no longer holds adapters %s (restarted?)", url, ", ".join(sorted(dropped)))
        if added:
            log.info("worker %s holds adapters %s", url, ", ".join(sorted(added)))
        return True

    async def sync_all(self) -> None:
        workers = self._workers()
        await asyncio.gather(*(self.sync_one(w) for w in workers))

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="adapter-sync")

    async def _loop(self) -> None:
        while True:
            try:
                await self.sync_all()
            except Exception:
                log.exception("reading the workers' adapters failed")
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        await cancel_and_wait(self._task)
        self._task = None
