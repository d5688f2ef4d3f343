"""The console's time series: the live figures of the last minutes, kept in memory at a fixed resolution.

A timer (``LiveSeries.run``) takes one sample of the metric objects every ``interval_s`` seconds
(``gateway.ops.stats.take_sample``, the same read ``GET /admin/stats`` makes) and writes the figures
between it and the previous sample into fixed-size rings: nothing is added to the request path, which
already counts everything into the metrics. So the charts work without Prometheus.

Bounded: one ring of ``points`` slots per model (``MODEL_FIELDS`` floats each: requests/s, errors/s,
refusals/s, tokens/s, in flight, queued, cache hit rate, TTFT and latency p50/p95/p99) and per worker
(``WORKER_FIELDS``), allocated once; at most ``max_models`` models and ``max_workers`` workers are
tracked (a later one is counted in ``dropped``, not stored). With the defaults (5 s x 180 = 15 min) a
model's ring is 180 x 15 doubles: ``bench/bench_series_memory.py`` measures it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from array import array
from collections.abc import Callable
from typing import Any

from gateway.ops.metrics import Metrics
from gateway.ops.stats import Sample, report, take_sample
from gateway.ops.tasks import cancel_and_wait

MODEL_FIELDS = (
    "requests_per_s",
    "errors_per_s",
    "refusals_per_s",
    "tokens_per_s",
    "in_flight",
    "queued",
    "cache_hit_rate",
    "ttft_p50_s",
    "ttft_p95_s",
    "ttft_p99_s",
    "latency_p50_s",
    "latency_p95_s",
    "latency_p99_s",
)
#: Per worker. The worker table will report cached KV blocks and adapters held: they join here as
#: fields (``cached_blocks``, ``adapters``) when it does, and the console's workers view shows them.
WORKER_FIELDS = ("in_flight", "errors_per_s")
_NAN = math.nan
log = logging.getLogger("gateway.console")
_UPSTREAM_ERRORS = "gateway_upstream_errors"


class Ring:
    """``points`` rows of ``len(fields)`` floats in one preallocated array; NaN where nothing was seen."""

    __slots__ = ("fields", "values")

    def __init__(self, fields: tuple[str, ...], points: int) -> None:
        self.fields = fields
        self.values = array("d", [_NAN]) * (points * len(fields))

    def write(self, slot: int, row: dict[str, Any]) -> None:
        base = slot * len(self.fields)
        for i, name in enumerate(self.fields):
            value = row.get(name)
            self.values[base + i] = _NAN if value is None else float(value)

    def clear(self, slot: int) -> None:
        base = slot * len(self.fields)
        for i in range(len(self.fields)):
            self.values[base + i] = _NAN

    def empty(self) -> bool:
        """True when no slot holds a value (nothing seen for the whole window)."""
        return all(math.isnan(value) for value in self.values)

    def column(self, index: int, slots: list[int]) -> list[float | None]:
        width = len(self.fields)
        out: list[float | None] = []
        for slot in slots:
            value = self.values[slot * width + index]
            out.append(None if math.isnan(value) else value)
        return out


class LiveSeries:
    """The rings of every tracked model and worker, and the timer that fills them.

    ``workers_in_flight`` answers each worker's requests in flight now (the worker table's count; a
    callable, so this layer needs no upstream import)."""

    def __init__(
        self,
        metrics: Metrics,
        workers_in_flight: Callable[[], dict[str, int]],
        *,
        interval_s: float = 5.0,
        points: int = 180,
        max_models: int = 32,
        max_workers: int = 128,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.metrics = metrics
        self.workers_in_flight = workers_in_flight
        self.interval_s = interval_s
        self.points = points
        self.max_models = max_models
        self.max_workers = max_workers
        self.clock = clock
        self.times = array("d", [_NAN]) * points  # epoch seconds of each slot's sample
        self.models: dict[str, Ring] = {}
        self.workers: dict[str, Ring] = {}
        self.dropped: set[str] = set()  # names past the caps (as many as the caps at most)
        self._next = 0  # the slot the next tick writes
        self._previous: Sample | None = None
        self._task: asyncio.Task[None] | None = None

    def tick(self) -> None:
        """Sample now and record the figures since the previous sample (the first sample only sets the
        starting point)."""
        now = self.clock()
        sample = take_sample(self.metrics, now)
        previous, self._previous = self._previous, sample
        if previous is None:
            return
        slot = self._next
        self._next = (slot + 1) % self.points
        self.times[slot] = now
        figures = report(previous, sample)["models"]
        self._write(self.models, MODEL_FIELDS, self.max_models, slot, figures)
        seconds = max(sample.at - previous.at, 1e-6)
        errors = _errors_by_worker(previous, sample)
        rows = {url: {"in_flight": n, "errors_per_s": errors.get(url, 0.0) / seconds} for url, n in
                self.workers_in_flight().items()}  # fmt: skip
        self._write(self.workers, WORKER_FIELDS, self.max_workers, slot, rows)

    def _write(
        self, rings: dict[str, Ring], fields: tuple[str, ...], cap: int, slot: int, rows: dict[str, Any]
    ) -> None:
        gone = []
        for name, quiet in rings.items():
            if name not in rows:
                quiet.clear(slot)  # a model or worker gone quiet: a gap, not its old value
                if quiet.empty():
                    gone.append(name)
        for name in gone:  # nothing left to chart (a worker replaced by one at a new address): its place
            del rings[name]  # goes to a newcomer, or the cap would fill with the dead for good
        for name, row in rows.items():
            ring = rings.get(name)
            if ring is None:
                if len(rings) >= cap:
                    if len(self.dropped) < self.max_models + self.max_workers:
                        self.dropped.add(name)
                    continue
                ring = rings[name] = Ring(fields, self.points)
                self.dropped.discard(name)
            ring.write(slot, row)

    def as_json(self) -> dict[str, Any]:
        """Oldest first: ``t`` (epoch seconds) and, per model and per worker, one list per field
        (null where nothing was recorded)."""
        slots = [(self._next + i) % self.points for i in range(self.points)]
        slots = [s for s in slots if not math.isnan(self.times[s])]
        return {
            "interval_s": self.interval_s,
            "points": self.points,
            "t": [self.times[s] for s in slots],
            "models": {name: _columns(ring, slots) for name, ring in sorted(self.models.items())},
            "workers": {name: _columns(ring, slots) for name, ring in sorted(self.workers.items())},
            "dropped": sorted(self.dropped),
        }

    async def run(self) -> None:
        while True:
            try:
                self.tick()
            except Exception:  # a failed read (say, a multiprocess file mid-write) must not end the charts
                log.exception("console series: a sample failed; the next one is taken as usual")
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run(), name="live-series")

    async def aclose(self) -> None:
        task, self._task = self._task, None
        await cancel_and_wait(task)


def _columns(ring: Ring, slots: list[int]) -> dict[str, list[float | None]]:
    return {name: ring.column(i, slots) for i, name in enumerate(ring.fields)}


def _errors_by_worker(old: Sample, new: Sample) -> dict[str, float]:
    """Upstream failures per worker between two samples (every kind summed)."""
    out: dict[str, float] = {}
    for (name, labels), value in new.totals.items():
        if name == _UPSTREAM_ERRORS:
            worker = labels[-1]  # labels sorted by name: (kind, worker)
            change = value - old.totals.get((name, labels), 0.0)
            out[worker] = out.get(worker, 0.0) + max(change, 0.0)
    return out
