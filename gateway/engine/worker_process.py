"""One supervised worker subprocess: start, wait until ready, restart after a crash, stop.

Contract of ``WorkerProcess``:

- ``start()`` refuses a port already in use, starts the command in its own process group (which dies with
  the gateway, see ``procgroup``), relays each output line to the logger as ``[worker NAME] ...`` and polls
  ``GET url/health`` until it answers 200. It raises ``WorkerStartError`` (with the last output lines)
  when the process exits first or ``ready_timeout_s`` passes; nothing is left running then.
- Once ready, a watcher restarts the worker whenever it exits: its leftover children are killed, then it
  waits ``RestartPolicy.delay(n)`` (exponential backoff; ``n`` = consecutive failed runs, reset by a run
  that stayed up ``stable_after_s``), and starts it again. ``restarts`` counts restart attempts.
  After ``max_restarts`` consecutive failures the state becomes ``failed`` and it stops trying.
- ``stop()`` SIGTERMs the whole group, SIGKILLs it after ``stop_grace_s``; idempotent.
- ``on_event(name, event)`` is called for ``ready``, ``exited``, ``restarting``, ``restarted``,
  ``restart_failed``, ``failed`` and ``stopped``; use it for metrics. It must not block or raise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import httpx

from gateway.engine import procgroup
from gateway.engine.launch import LaunchCommand

EventHook = Callable[[str, str], None]
STREAM_LIMIT = 1 << 20  # bytes per output line; vLLM prints its whole config on one line


class WorkerStartError(RuntimeError):
    """A worker did not become ready; the message says why and shows its last output lines."""


class WorkerState(StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    RESTARTING = "restarting"
    FAILED = "failed"
    STOPPING = "stopping"


@dataclass(frozen=True)
class RestartPolicy:
    initial_delay_s: float = 1.0
    max_delay_s: float = 30.0
    multiplier: float = 2.0
    stable_after_s: float = 60.0
    max_restarts: int | None = None

    def delay(self, failures: int) -> float:
        """Seconds to wait before restart number ``failures`` (1-based) of a run of failures."""
        return float(min(self.max_delay_s, self.initial_delay_s * self.multiplier ** max(0, failures - 1)))


def _stop_if_cancelled() -> None:
    """Raise ``CancelledError`` when the current task was asked to stop: ``gateway.ops.tasks.stop_if_cancelled``,
    which this package (the bottom layer, below ``ops``) cannot import. Called after catching an error that a
    cancellation may have been turned into, so the loop that caught it does not go on with it swallowed."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def _level(line: str) -> int:
    head = line[:80]
    if " ERROR " in head or "Traceback" in head or " CRITICAL " in head:
        return logging.ERROR
    if " WARNING " in head:
        return logging.WARNING
    return logging.INFO


class WorkerProcess:
    def __init__(
        self,
        name: str,
        command: LaunchCommand,
        *,
        host: str,
        port: int,
        logger: logging.Logger | None = None,
        ready_timeout_s: float = 600.0,
        stop_grace_s: float = 20.0,
        restart: RestartPolicy | None = None,
        on_event: EventHook | None = None,
        health_path: str = "/health",
        poll_interval_s: float = 0.5,
        log_tail: int = 40,
    ) -> None:
        self.name, self.command, self.host, self.port = name, command, host, port
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.url = f"http://{probe_host}:{port}"
        self._log = logger or logging.getLogger("gateway.engine")
        self._ready_timeout_s, self._stop_grace_s = ready_timeout_s, stop_grace_s
        self._policy = restart or RestartPolicy()
        self._on_event = on_event
        self._health_url = self.url + health_path
        self._poll_interval_s = poll_interval_s
        self._tail: deque[str] = deque(maxlen=log_tail)
        self._proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._ready_at = 0.0
        self._stopping = False
        self.state = WorkerState.STOPPED
        self.restarts = 0
        self.last_exit_code: int | None = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    def status(self) -> dict[str, object]:
        return {"name": self.name, "url": self.url, "pid": self.pid, "state": str(self.state),
                "restarts": self.restarts, "last_exit_code": self.last_exit_code}  # fmt: skip

    def last_lines(self) -> list[str]:
        return list(self._tail)

    async def start(self) -> None:
        if self._watcher is not None:
            raise RuntimeError(f"worker {self.name} is already started")
        self._stopping = False
        await self._launch_until_ready()
        self._watcher = asyncio.create_task(self._watch(), name=f"worker {self.name} watcher")

    async def stop(self) -> None:
        self._stopping = True
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
            self._watcher = None
        if self._proc is not None:
            self.state = WorkerState.STOPPING
            await procgroup.terminate_group(self._proc.pid, self._proc, self._stop_grace_s)
            await self._drain_output()
            self.last_exit_code = self._proc.returncode
            self.state = WorkerState.STOPPED
            self._proc = None
            self._log.info("[worker %s] stopped", self.name)
            self._emit("stopped")

    def _emit(self, event: str) -> None:
        if self._on_event is not None:
            self._on_event(self.name, event)

    async def _launch_until_ready(self) -> None:
        """Spawn and wait for readiness; on any failure (or cancellation) leave nothing running."""
        if procgroup.port_in_use(self.host, self.port):
            raise WorkerStartError(
                f"worker {self.name}: port {self.port} on {self.host} is already in use by another process; "
                "stop it or give the worker another port"
            )
        self.state = WorkerState.STARTING
        self._tail.clear()
        argv = procgroup.die_with_parent(self.command.argv)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, env={**os.environ, **self.command.env}, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                start_new_session=True, limit=STREAM_LIMIT,
            )  # fmt: skip
        except OSError as exc:
            raise WorkerStartError(f"worker {self.name}: cannot run {self.command.argv[0]}: {exc}") from exc
        self._proc = proc
        self._pump = asyncio.create_task(self._relay_output(proc), name=f"worker {self.name} output")
        self._log.info("[worker %s] started pid %d, waiting for %s", self.name, proc.pid, self._health_url)
        try:
            await self._wait_ready(proc)
        except BaseException:
            procgroup.kill_group_now(proc.pid)
            with contextlib.suppress(BaseException):
                await asyncio.shield(self._reap(proc))
            raise
        self._ready_at = time.monotonic()
        self.state = WorkerState.READY
        self._log.info("[worker %s] ready at %s", self.name, self.url)
        self._emit("ready")

    async def _reap(self, proc: asyncio.subprocess.Process) -> None:
        await procgroup.wait_exit(proc, 5.0)
        self.last_exit_code = proc.returncode
        await procgroup.wait_group_gone(proc.pid, 5.0)
        await self._drain_output()

    async def _wait_ready(self, proc: asyncio.subprocess.Process) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        async with httpx.AsyncClient(timeout=httpx.Timeout(5.0), trust_env=False) as client:
            while True:
                if proc.returncode is not None:
                    raise self._start_error(f"exited with code {proc.returncode} before it was ready")
                try:
                    if (await client.get(self._health_url)).status_code == 200:
                        return
                except httpx.HTTPError:  # not listening yet, or still starting up
                    _stop_if_cancelled()  # a probe cancelled mid-request may raise httpx's error instead
                if time.monotonic() >= deadline:
                    raise self._start_error(f"was not ready after {self._ready_timeout_s:.0f}s")
                await procgroup.wait_exit(proc, self._poll_interval_s, interval_s=0.05)

    def _start_error(self, what: str) -> WorkerStartError:
        tail = "\n".join(f"    {line}" for line in self._tail) or "    (no output)"
        return WorkerStartError(f"worker {self.name} ({self.url}) {what}. Last output lines:\n{tail}")

    async def _relay_output(self, proc: asyncio.subprocess.Process) -> None:
        assert proc.stdout is not None
        while True:
            try:
                raw = await proc.stdout.readline()
            except ValueError:  # a line longer than STREAM_LIMIT; its bytes were dropped
                continue
            if not raw:
                return
            # progress bars redraw with carriage returns: keep the last state only
            line = raw.decode(errors="replace").rstrip().rsplit("\r", 1)[-1]
            if line:
                self._tail.append(line)
                self._log.log(_level(line), "[worker %s] %s", self.name, line)

    async def _drain_output(self) -> None:
        if self._pump is not None:
            with contextlib.suppress(TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._pump, 5.0)
            self._pump = None

    async def _watch(self) -> None:
        failures = 0
        while self._proc is not None:
            await procgroup.wait_exit(self._proc, None, interval_s=0.2)
            code = self.last_exit_code = self._proc.returncode
            self.state = WorkerState.RESTARTING
            uptime = time.monotonic() - self._ready_at
            failures = 1 if uptime >= self._policy.stable_after_s else failures + 1
            self._log.warning("[worker %s] exited with code %s after %.0fs", self.name, code, uptime)
            self._emit("exited")
            await procgroup.terminate_group(self._proc.pid, None, 5.0)  # its orphaned children
            await self._drain_output()
            _stop_if_cancelled()  # _drain_output takes a CancelledError for the pump's own, so it swallows ours
            while True:
                if self._policy.max_restarts is not None and failures > self._policy.max_restarts:
                    self.state = WorkerState.FAILED
                    self._log.error("[worker %s] gave up after %d failed restarts", self.name, failures - 1)
                    self._emit("failed")
                    return
                delay = self._policy.delay(failures)
                self.state = WorkerState.RESTARTING
                self.restarts += 1
                self._log.warning("[worker %s] restart #%d in %.1fs", self.name, self.restarts, delay)
                self._emit("restarting")
                await asyncio.sleep(delay)
                try:
                    await self._launch_until_ready()
                except WorkerStartError as exc:
                    self._log.error("%s", exc)
                    self._emit("restart_failed")
                    failures += 1
                    continue
                self._emit("restarted")
                break
