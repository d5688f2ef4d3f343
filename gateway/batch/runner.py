"""The batch runner: one per replica, working off every replica's batches from Redis.

Each round it looks at the batches not yet final and moves each on: validates a new one, finalizes one
that is done, expired or being cancelled, and otherwise claims lines (leases, ``gateway.batch.work``)
while there is idle capacity for them (``gateway.batch.capacity``) and this replica runs fewer than
``max_in_flight``. Each line runs as a task through the live pipeline (``gateway.batch.submit``); its
result is recorded once. A background loop renews the leases of the lines running here; a replica that
dies stops renewing, and the others take its lines over when the leases lapse. A finished line wakes
the loop at once, so a busy batch does not wait for the poll interval between lines; that step only
starts lines of the batches the last round found runnable (a refill: no batch is read), since a whole
round reads every batch not final from Redis and would cost each line as much as there are batches
running. Whole rounds come every ``poll_interval_s`` and when asked (``wake``: a batch was created or
cancelled here); a claim only takes lines of a batch still in progress (``Work.claim``), so a refill
never starts a line of a batch cancelled since.

Lines are stopped midway in three ways, billed as the live request each resembles: a batch cancelled
by its owner stops its lines as a client that hangs up (``LineRun.abandon``: a line that had reached a
worker pays its prompt); a batch that expired, or that an operator cancelled, stops them by the
gateway's own decision, free like a timeout (the completion window is the gateway's promise, not the
owner's choice); and a replica that shuts down gives its lines back (their leases are released) to run
again, here or elsewhere, and be charged then.

A line two replicas both ran (one took over the lapsed lease of the other, still running it) has its
result written once, by whichever run finishes first; the other run's answer is delivered to nobody and
billed so (``gateway.batch.submit``): the tenant pays for one answer per line. Except that a success
replaces an error (``gateway.batch.work``): a batch whose lines all have a result waits to be finalized
while a run that may still replace an error holds its lease.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.batch.capacity import IdleGate
from gateway.batch.jobs import FINAL, Jobs
from gateway.batch.lifecycle import Lifecycle
from gateway.batch.lines import error_line, line_bound, output_line, too_large
from gateway.batch.metrics import BatchMetrics
from gateway.batch.redis_errors import REDIS_ERRORS
from gateway.batch.submit import Keep, LineRun, Outcome, RetryLater, Submitter, hand_over
from gateway.batch.work import Work
from gateway.ops.tasks import cancel_and_wait, stop_if_cancelled
from gateway.pipeline.batch_config import BatchesConfig, BatchLine, Caller
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.wire.errors import GatewayError, ServerError

log = logging.getLogger("gateway.batch")
SWEEP_INTERVAL_S = 60.0  # how often a replica deletes the contents of expired files


@dataclass(frozen=True, slots=True)
class RunningLine:
    """A line this replica runs: its batch, its index in the input file, its model's name, its run."""

    batch_id: str
    index: int
    model: str
    run: LineRun


def rotated_after(runnable: list[tuple[str, Any]], last: str) -> list[tuple[str, Any]]:
    """The batches (sorted by id) starting with the first one after ``last``, wrapping around."""
    start = next((i for i, (batch_id, _) in enumerate(runnable) if batch_id > last), 0)
    return runnable[start:] + runnable[:start]


def cancelled_by_owner(record: dict[str, Any]) -> bool:
    """Whether the batch is being, or was, cancelled by its owner rather than an operator (its lines cut
    midway are then billed as a client that hung up)."""
    return record["status"] in ("cancelling", "cancelled") and record.get("_cancelled_by") != "operator"


def replica_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class Runner:
    def __init__(
        self,
        holder: RuntimeHolder,
        services: Services,
        jobs: Jobs,
        work: Work,
        lifecycle: Lifecycle,
        submitter: Submitter,
        metrics: BatchMetrics,
    ) -> None:
        self.holder, self.services = holder, services
        self.jobs, self.work, self.lifecycle, self.submitter = jobs, work, lifecycle, submitter
        self.metrics = metrics
        self.owner = lifecycle.owner
        self.running: dict[asyncio.Task[None], RunningLine] = {}
        self.gate = IdleGate()
        self._next_sweep = 0.0
        self._last_served = ""  # the batch whose line was started last: the next round starts after it
        self._paused: dict[str, float] = {}  # batch id -> monotonic time before which none of its lines starts
        self._runnable: list[tuple[str, dict[str, Any]]] = []  # the last round's batches with lines to run
        self._round_due = True  # the next step is a whole round (asked for, or the poll interval passed)
        self._next_round = 0.0  # monotonic time of the next whole round
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def _config(self) -> BatchesConfig:
        return self.holder.current.config.batches

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(), name="batch-runner"),
            asyncio.create_task(self._renew_loop(), name="batch-leases"),
        ]

    async def aclose(self) -> None:
        for task in self._tasks:
            await cancel_and_wait(task)
        lines = list(self.running)
        for task in lines:
            task.cancel()
        await asyncio.gather(*lines, return_exceptions=True)

    def wake(self) -> None:
        """Run a whole round now (a batch was created or cancelled here)."""
        self._round_due = True
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            try:
                await self._step()
            except (GatewayError, *REDIS_ERRORS) as exc:
                log.warning("batch runner: %s", getattr(exc, "message", None) or type(exc).__name__)
            except Exception:
                log.exception("batch runner round failed")
            stop_if_cancelled()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, self._next_round - time.monotonic())):
                    await self._wake.wait()
            self._wake.clear()

    async def _step(self) -> None:
        """A whole round when one is due, else a refill: lines started from the last round's batches."""
        if self._round_due or time.monotonic() >= self._next_round:
            self._round_due = False
            self._next_round = time.monotonic() + self._config().poll_interval_s
            await self.tick()
        else:
            await self._dispatch(list(self._runnable), refill=True)

    async def tick(self) -> None:
        """One round over the batches not final yet."""
        active = await self.jobs.active()
        self.metrics.batches.set(len(active))
        await self._stop_finished_elsewhere(active)
        queued = 0
        runnable: list[tuple[str, dict[str, Any]]] = []
        for batch_id in active:
            try:
                record = await self.jobs.load(batch_id)
                if record is None or record["status"] in FINAL:
                    await self.jobs.redis.srem(self.jobs.active_key, batch_id)
                    continue
                pending = await self.work.pending(batch_id) if record["status"] == "in_progress" else 0
                if await self._advance(batch_id, record, pending):
                    runnable.append((batch_id, record))
                queued += pending
            except REDIS_ERRORS:
                raise  # Redis is unreachable: no batch moves on this round
            except Exception:  # one batch's trouble (a bug, a file it cannot write) must not hold the others
                log.exception("batch runner: batch %s was not moved on this round", batch_id)
        self.metrics.queued.set(queued)
        self._runnable = list(runnable)
        await self._dispatch(runnable)
        if time.monotonic() >= self._next_sweep:  # expired output files' contents leave the file store
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL_S
            await self.lifecycle.files.sweep(time.time())

    async def _advance(self, batch_id: str, record: dict[str, Any], pending: int) -> bool:
        """Move the batch on; True when it has lines to run."""
        status = record["status"]
        if status == "cancelling":
            self._stop_local(batch_id, abandoned=cancelled_by_owner(record))
            await self.lifecycle.finalize(batch_id, record, "cancelled")
        elif status in ("validating", "in_progress") and time.time() >= record["expires_at"]:
            self._stop_local(batch_id, abandoned=False)
            await self.lifecycle.finalize(batch_id, record, "expired")
        elif status == "validating":
            await self.lifecycle.validate(batch_id, record)
        elif status == "finalizing":
            await self.lifecycle.finalize(batch_id, record, "completed")
        elif status == "in_progress":
            if pending:
                return True
            if await self.work.running(batch_id):  # a line's second run, whose success may replace an error
                return False
            await self.lifecycle.finalize(batch_id, record, "completed")
        return False

    async def _stop_finished_elsewhere(self, active: list[str]) -> None:
        """Stop this replica's lines of batches no longer unfinished: the replica that took a cancel (or
        saw the window pass) finalizes the batch at once, usually before this one's next round could see
        it ``cancelling``. Their results would be thrown away, and their workers would go on generating."""
        unfinished = set(active)
        for batch_id in {line.batch_id for line in self.running.values()} - unfinished:
            record = await self.jobs.load(batch_id)
            if record is not None and record["status"] not in FINAL:
                continue
            self._stop_local(batch_id, abandoned=record is not None and cancelled_by_owner(record))

    def _stop_local(self, batch_id: str, *, abandoned: bool) -> None:
        """Cancel this replica's lines of the batch (their worker requests are closed, vLLM aborts them);
        ``abandoned``: the batch's owner stopped them (it cancelled the batch), billed as a client gone."""
        for task, line in list(self.running.items()):
            if line.batch_id == batch_id:
                if abandoned:
                    line.run.abandon()
                task.cancel()

    async def _dispatch(self, runnable: list[tuple[str, dict[str, Any]]], *, refill: bool = False) -> None:
        """Claim lines one per batch in turn (no batch starves another) while this replica has room and
        the lines' models have idle capacity.

        The turn carries over between rounds: a round starts with the batch after the one served last,
        so with room for one line at a time (a round per finished line) the batches still alternate.
        """
        config = self._config()
        now = time.monotonic()
        self._paused = {batch_id: until for batch_id, until in self._paused.items() if until > now}
        runnable = rotated_after(runnable, self._last_served)
        while runnable and len(self.running) < config.max_in_flight:
            batch_id, record = runnable.pop(0)
            if batch_id in self._paused:  # one of its lines was refused for now (before or during this step)
                continue
            if await self._start_one(batch_id, record, config, refill):
                self._last_served = batch_id
                runnable.append((batch_id, record))

    async def _start_one(self, batch_id: str, record: dict[str, Any], config: BatchesConfig, refill: bool) -> bool:
        """Claim and start one line of the batch; False when it has none free or no capacity now."""
        claimed = await self.work.claim(batch_id, self.owner, 1)
        if not claimed:
            self._drained(batch_id, refill)
            return False
        index, raw = claimed[0]
        snapshot = self.holder.current
        limit = snapshot.config.limits.max_body_bytes
        if len(raw) > line_bound(limit):  # loaded within an earlier, larger limit: not parsed on the loop now
            code, message = too_large(limit)
            written_off = error_line(None, code, f"Line {index + 1}: {message}")
            await self.work.record(batch_id, index, written_off, ok=False, tokens=(0, 0), owner=self.owner)
            return True
        line = orjson.loads(raw)
        model = snapshot.models.resolve(line["body"]["model"])
        in_flight = Counter(line.model for line in self.running.values())
        if model is not None and not self.gate.has_room(self.services, snapshot.config, model, config, in_flight):
            await self.work.release(batch_id, self.owner, [index])
            return False
        caller = Caller(**record["_caller"])
        run = LineRun()
        expires_at = float(record["expires_at"])
        task = asyncio.create_task(
            self._run(batch_id, index, line, caller, run, expires_at), name=f"batch-line-{index}"
        )
        self.running[task] = RunningLine(batch_id, index, model.name if model is not None else "", run)
        self.metrics.running.set(len(self.running))
        task.add_done_callback(self._line_finished)
        return True

    def _drained(self, batch_id: str, refill: bool) -> None:
        """The batch had no line to claim (all done or held, or it is no longer in progress): refills stop
        trying it, and when a refill found that and none of its lines runs here, a whole round comes next,
        to finalize it if it is done (at most once per round: it is out of the refills' list until the next
        round, and a round finding it so asks for no other)."""
        if not refill or not any(batch_id == b for b, _ in self._runnable):
            return
        self._runnable = [item for item in self._runnable if item[0] != batch_id]
        if not any(line.batch_id == batch_id for line in self.running.values()):
            self._round_due = True
            self._wake.set()

    def _line_finished(self, task: asyncio.Task[None]) -> None:
        self.running.pop(task, None)
        self.metrics.running.set(len(self.running))
        self._wake.set()

    async def _run(
        self, batch_id: str, index: int, line: dict[str, Any], caller: Caller, run: LineRun, expires_at: float
    ) -> None:
        custom_id = line["custom_id"]
        whose = BatchLine(caller, batch_id, custom_id)
        keep = functools.partial(self._keep, batch_id, index, custom_id)
        try:
            await self.submitter.submit(line["url"], line["body"], whose, run, keep)
        except RetryLater as later:
            await self._retry_later(batch_id, index, expires_at, later, run, keep)
        except asyncio.CancelledError:
            with contextlib.suppress(*REDIS_ERRORS):
                await self.work.release(batch_id, self.owner, [index])
            raise
        except Exception:  # a fault of the gateway's: the line fails once rather than running forever
            log.exception("batch %s: line %d failed", batch_id, index)
            if run.kept is None:
                failure = ServerError("The gateway failed to run this line; it has been logged.", code="internal_error")
                await keep(Outcome(failure.status_code, failure.body(), ""))

    async def _retry_later(
        self, batch_id: str, index: int, expires_at: float, later: RetryLater, run: LineRun, keep: Keep
    ) -> None:
        """A line refused for now (a rate limit: a tenant's batch goes at the pace its limits allow, rather
        than failing every line past them): given back, and no line of its batch starts here until the wait
        is over, so a batch of many lines costs one refused attempt per wait, not one per line. A wait that
        outlasts the batch's window (a monthly budget) cannot help: the refusal is the line's result."""
        if time.time() + later.wait_s >= expires_at:
            await hand_over(run, keep, later.outcome)
            return
        until = time.monotonic() + later.wait_s
        self._paused[batch_id] = max(until, self._paused.get(batch_id, 0.0))
        self.metrics.deferred.inc()
        with contextlib.suppress(*REDIS_ERRORS):  # else its lease lapses, and the line is claimed then
            await self.work.release(batch_id, self.owner, [index])

    async def _keep(self, batch_id: str, index: int, custom_id: str, outcome: Outcome) -> bool:
        """Write what a run of the line got as its result, unless another run's was written first (a lease
        taken over from a slow replica): whether this run's was. The submitter calls it before the line's
        request is over, so a run whose answer was not written is billed as delivering nothing."""
        ok = outcome.status == 200
        result = output_line(custom_id, outcome.status, outcome.request_id, outcome.body)
        try:
            recorded = await self.work.record_outcome(
                batch_id, index, result, ok=ok, tokens=outcome.tokens, owner=self.owner
            )
        except REDIS_ERRORS as exc:  # the lease lapses and the line runs again, here or elsewhere
            log.warning("batch %s: line %d's result could not be recorded (%s)", batch_id, index, exc)
            return False
        if recorded.written:
            self.metrics.run_tokens(outcome.tokens)
        if recorded.final is not None:
            self.metrics.line_final(recorded.final)
        return recorded.written

    async def _renew_loop(self) -> None:
        while True:
            await asyncio.sleep(self.lifecycle.config.lease_s / 3)
            held: dict[str, list[int]] = {}
            for line in self.running.values():
                held.setdefault(line.batch_id, []).append(line.index)
            for batch_id, indexes in held.items():
                try:
                    await self.work.renew(batch_id, self.owner, indexes)
                except REDIS_ERRORS as exc:
                    log.warning("batch %s: leases not renewed (%s)", batch_id, exc)
                    stop_if_cancelled()
