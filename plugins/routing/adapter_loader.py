"""Loading LoRA adapters on workers when a request needs them, and unloading the least recently used.

``ensure(worker, model, settings)`` returns once the worker holds the adapter: at once when it does
already, else after ``POST /v1/load_lora_adapter``. Concurrent requests for the same adapter on the same
worker share one load (single flight per (worker, adapter)), and placement sends a request that arrives
during a load to the worker that is loading (``WorkerAdapters.loading`` counts as held). Loads on one
worker run one at a time, so that counting its free slots and evicting (``POST /v1/unload_lora_adapter``
of the least recently used adapter that is neither pinned nor in use) stays exact.

A load is shared by requests that came from several config snapshots, so the loader lives in the
routing plugin's process-wide state (``RoutingShared``). Failures become OpenAI errors: a worker that
cannot be reached is an ``UpstreamFailure`` the core retries elsewhere; a worker that refuses the adapter
(path missing, rank too large, LoRA or run-time loading not enabled) is a 502 saying what to fix.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import orjson

from gateway.ops.metrics import Metrics, remove_series
from gateway.pipeline.adapters import AdapterConfig, LoraSettings
from gateway.upstream.client import UpstreamClient, UpstreamFailure
from gateway.upstream.workers import Worker
from gateway.wire.errors import BadGateway, GatewayError, GatewayTimeout, from_upstream

log = logging.getLogger("gateway.routing.adapters")

LOAD_PATH = "/v1/load_lora_adapter"
UNLOAD_PATH = "/v1/unload_lora_adapter"
#: The first sentence of vLLM's answer to a load of an adapter it already holds under that name.
ALREADY_LOADED = "The lora adapter '{name}' has already been loaded."


class AdapterLoader:
    """Single-flight loads and LRU evictions on the workers of this process."""

    def __init__(
        self,
        upstream: UpstreamClient,
        metrics: Metrics,
        *,
        timeout_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream
        self.metrics = metrics
        self.timeout_s = timeout_s
        self._clock = clock
        self._flights: dict[tuple[str, str], asyncio.Task[None]] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._users: dict[str, int] = {}  # url -> loads and unloads holding or awaiting its lock
        self._gone: set[str] = set()  # removed from the worker table while a load or unload was at it

    async def ensure(
        self,
        worker: Worker,
        adapter: AdapterConfig,
        settings: LoraSettings,
        starting: Callable[[], None] | None = None,
    ) -> None:
        """Return once ``worker`` holds ``adapter`` (loading it, and evicting to make room, if needed).

        Registers the load before its first wait, so a request placed right after this one is called
        sees the worker as loading it. ``starting`` is called, with nothing sent yet, when this call is
        about to start a load of an adapter the worker does not hold (not when it joins another request's
        load, nor for a reload in place, which takes no other slot): what it raises refuses the load."""
        state = worker.adapters
        name = adapter.upstream_name
        key = (worker.url, name)
        # Held from another path (the adapter's path changed in a reload): loaded again, in place. A load
        # joined here may be one from the old path: looked at again once it lands.
        while not state.holds_from(name, adapter.path):
            flight = self._flights.get(key)
            if flight is None:
                if starting is not None and name not in state.held:
                    starting()
                self._gone.discard(worker.url)  # back in the table (the same address): its series stay
                state.loading.add(name)
                flight = asyncio.create_task(self._load(worker, adapter, settings), name=f"lora-load {name}")
                self._flights[key] = flight
                flight.add_done_callback(lambda task: self._landed(key, task))
            # Shielded: a client that goes away must not cancel a load other requests are waiting for.
            await asyncio.shield(flight)
        state.touch(name, self._clock())

    def _landed(self, key: tuple[str, str], task: asyncio.Task[None]) -> None:
        self._flights.pop(key, None)
        if not task.cancelled():
            task.exception()  # retrieved here too: every waiter may have gone away

    def lock(self, url: str) -> asyncio.Lock:
        lock = self._locks.get(url)
        if lock is None:
            lock = self._locks[url] = asyncio.Lock()
        return lock

    @asynccontextmanager
    async def holding(self, url: str) -> AsyncIterator[None]:
        """Hold the worker's lock (its loads and unloads run one at a time), counted so that a worker
        removed meanwhile is forgotten once the last holder is done."""
        self._users[url] = self._users.get(url, 0) + 1
        try:
            async with self.lock(url):
                yield
        finally:
            left = self._users.pop(url) - 1
            if left:
                self._users[url] = left
            elif url in self._gone:
                self._gone.discard(url)
                self._forget(url)

    def forget(self, url: str) -> None:
        """The worker table's ``on_removed``: ``url`` left it for good. Its lock goes (one per address
        ever seen would pile up as pods come and go); a load or unload still at it drops the lock, and
        the adapter series it recorded for the gone worker, when it ends."""
        if url in self._users:
            self._gone.add(url)
        else:
            self._locks.pop(url, None)  # its series went with the table's other on_removed callbacks

    def _forget(self, url: str) -> None:
        self._locks.pop(url, None)
        metrics = self.metrics
        for metric in (
            metrics.adapter_loads,
            metrics.adapter_evictions,
            metrics.adapter_load_seconds,
            metrics.adapter_retries,
        ):
            remove_series(metric, "worker", url)

    async def _load(self, worker: Worker, adapter: AdapterConfig, settings: LoraSettings) -> None:
        state = worker.adapters
        name = adapter.upstream_name
        try:
            async with self.holding(worker.url):
                while state.occupied() > settings.max_loras:  # this load is counted among the occupied
                    victim = state.lru_victim()
                    if victim is None:  # all pinned or busy: vLLM keeps extra adapters in its CPU cache
                        break
                    await self.unload(worker, victim, "lru")
                started = self._clock()
                payload: dict[str, object] = {"lora_name": name, "lora_path": adapter.path}
                if name in state.held:  # from another path: vLLM replaces it only when asked to
                    payload["load_inplace"] = True
                status, body = await self._post(worker.url, LOAD_PATH, payload)
                # A load that finds the adapter there (another replica, a state forgotten on a health flap)
                # is as good as done.
                if status != 200 and not already_loaded(name, status, body):
                    self.metrics.adapter_loads.labels(worker.url, name, "error").inc()
                    raise load_refused(name, worker.url, status, body)
                state.added(name, self._clock(), adapter.path)
                self.metrics.adapter_loads.labels(worker.url, name, "ok").inc()
                self.metrics.adapter_load_seconds.labels(worker.url).observe(self._clock() - started)
                log.info("loaded adapter %s on %s", name, worker.url)
        finally:
            state.loading.discard(name)

    async def unload(self, worker: Worker, name: str, reason: str) -> None:
        """Unload ``name`` from ``worker`` (call with ``holding(worker.url)``); an adapter the worker
        does not know is gone already."""
        state = worker.adapters
        last_use, path = state.held.get(name), state.paths.get(name)
        # Not held from now on: a request arriving during the unload loads it again (after this one, on
        # the worker's lock) instead of being sent to a worker about to drop it.
        state.removed(name)
        state.unloading.add(name)  # and a read of the worker's models meanwhile does not list it back
        gone = False
        try:
            status, body = await self._post(worker.url, UNLOAD_PATH, {"lora_name": name})
            if status not in (200, 404):
                raise load_refused(name, worker.url, status, body, action="unload")
            gone = True
        finally:
            state.unloading.discard(name)
            if not gone and last_use is not None:  # not known to be gone: held as before
                state.added(name, last_use, path)
        state.pinned.discard(name)
        self.metrics.adapter_evictions.labels(worker.url, name, reason).inc()
        log.info("unloaded adapter %s from %s (%s)", name, worker.url, reason)

    async def _post(self, url: str, path: str, payload: dict[str, object]) -> tuple[int, bytes]:
        """POST ``payload`` to the worker at ``url``: its status and body, within ``timeout_s`` (else a 504
        ``adapter_load_timeout``). An unreachable worker, a broken answer or one longer than
        ``upstream.max_small_answer_bytes`` is an ``UpstreamFailure`` (``AnswerTooLarge`` for the last)."""
        max_bytes = self.upstream.config.max_small_answer_bytes
        try:
            async with asyncio.timeout(self.timeout_s):
                response = await self.upstream.open(url, path, orjson.dumps(payload))
                return response.status, await response.read_at_most(max_bytes)
        except TimeoutError:
            log.warning("%s on %s took longer than %g s", path, url, self.timeout_s)
            raise GatewayTimeout(
                f"Loading a LoRA adapter on a model worker took longer than {self.timeout_s:g} s.",
                code="adapter_load_timeout",
            ) from None
        except UpstreamFailure:
            raise  # unreachable worker: the core counts it against the worker and tries another


def already_loaded(name: str, status: int, body: bytes) -> bool:
    """Whether a worker's answer to a load of ``name`` says it holds that adapter already: vLLM's 400
    ``The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, ...``
    (``vllm/entrypoints/openai/models/serving.py``). Matched on that sentence for that name only: a load
    refused for another reason may mention "already" (in the adapter's name or path, or the worker's
    words), and counting it as done would send requests to a worker that does not hold the adapter."""
    return status == 400 and from_upstream(status, body).message.startswith(ALREADY_LOADED.format(name=name))


def load_refused(name: str, url: str, status: int, body: bytes, action: str = "load") -> GatewayError:
    """A worker's refusal to load (or unload) an adapter, as an error that says what to fix. The worker's
    address is logged, not told to the client (the public port names no worker)."""
    worker_says = from_upstream(status, body).message
    if status in (404, 405) and worker_says in ("Not Found", "Method Not Allowed"):  # no such route
        hint = (
            "the worker does not allow run-time adapter loading: start it with --enable-lora and "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True (see docs/adapters.md)"
        )
    elif status == 404:
        hint = "the worker cannot find the adapter's files: check the adapter's path in config.yaml"
    else:
        hint = worker_says
    log.warning("worker %s refused to %s adapter %s: %s %s", url, action, name, status, worker_says)
    message = f"LoRA adapter '{name}' could not be {action}ed on a model worker: {hint}"
    return BadGateway(message, code="adapter_load_failed")
