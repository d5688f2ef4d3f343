"""The engine manager: every managed worker of a config, prepared, started, watched and stopped together.

``EngineManager(specs, models_dir)`` is owned by the app's lifespan::

    engine = EngineManager(config.engine.workers, models_dir=settings.model_dir, on_event=metrics_hook)
    await engine.start()      # prepares models (in a thread), starts every worker, waits until all are ready
    ...                       # engine.status() for the admin API; on_event(name, event) for metrics
    await engine.stop()       # stops every worker's process group; idempotent

``start()`` either returns with every worker ready or raises ``EngineStartError`` (or ``ModelPrepError``)
after stopping whatever it had started, also when it is cancelled. Workers are restarted after a crash by
their ``WorkerProcess`` (see its contract). Nothing here is global: two managers can run side by side.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path

from gateway.engine.launch import build_launch, find_preload_libs, worker_python
from gateway.engine.model_prep import ModelPrepError, prepare_model
from gateway.engine.spec import ManagedWorkerSpec
from gateway.engine.worker_process import EventHook, RestartPolicy, WorkerProcess, WorkerStartError, WorkerState

__all__ = [
    "EngineManager",
    "EngineStartError",
    "ModelPrepError",
    "RestartPolicy",
    "WorkerProcess",
    "WorkerStartError",
    "WorkerState",
]

PreloadFinder = Callable[[str], list[str]]


class EngineStartError(RuntimeError):
    """One or more managed workers did not start; the message holds each worker's reason."""


class EngineManager:
    def __init__(
        self,
        specs: Sequence[ManagedWorkerSpec],
        models_dir: Path,
        *,
        ready_timeout_s: float = 600.0,
        stop_grace_s: float = 20.0,
        restart: RestartPolicy | None = None,
        on_event: EventHook | None = None,
        progress: Callable[[str], None] | None = None,
        logger: logging.Logger | None = None,
        preload_finder: PreloadFinder = find_preload_libs,
        pip_args: Sequence[str] = (),
    ) -> None:
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"managed worker names must be unique: {names}")
        self.specs = list(specs)
        self.models_dir = Path(models_dir)
        self._ready_timeout_s, self._stop_grace_s = ready_timeout_s, stop_grace_s
        self._restart = restart or RestartPolicy()
        self._on_event = on_event
        self._log = logger or logging.getLogger("gateway.engine")
        self._progress = progress or (lambda message: self._log.info("[model] %s", message))
        self._preload_finder = preload_finder
        self._pip_args = list(pip_args)
        self._workers: dict[str, WorkerProcess] = {}

    @property
    def workers(self) -> dict[str, WorkerProcess]:
        return dict(self._workers)

    def status(self) -> list[dict[str, object]]:
        """One entry per worker: name, url, pid, state, restarts, last_exit_code, model."""
        served = {s.name: s.served_model_name or s.model for s in self.specs}
        return [{**w.status(), "model": served[name]} for name, w in self._workers.items()]

    async def start(self) -> None:
        if any(w.state is not WorkerState.STOPPED for w in self._workers.values()):
            raise RuntimeError("the engine is already started")
        self._workers = {}
        try:
            models = await self._prepare_models()
            for spec in self.specs:
                python = worker_python(spec)
                preload = self._preload_finder(python) if spec.device == "cpu" else []
                command = build_launch(spec, models[spec.name], preload=preload, inherited=os.environ)
                self._log.info("[worker %s] command: %s", spec.name, command.shell())
                self._workers[spec.name] = WorkerProcess(
                    spec.name, command, host=spec.host, port=spec.port, logger=self._log,
                    ready_timeout_s=spec.ready_timeout_s or self._ready_timeout_s,
                    stop_grace_s=self._stop_grace_s, restart=self._restart, on_event=self._on_event,
                )  # fmt: skip
            results = await asyncio.gather(*(w.start() for w in self._workers.values()), return_exceptions=True)
            failures = [r for r in results if isinstance(r, BaseException)]
            for failure in failures:
                if not isinstance(failure, Exception):
                    raise failure  # cancellation or interpreter exit: clean up below and pass it on
            if failures:
                reasons = "\n".join(str(f) for f in failures)
                raise EngineStartError(f"{len(failures)} of {len(results)} managed workers did not start:\n{reasons}")
        except BaseException:
            await asyncio.shield(self.stop())
            raise

    async def stop(self) -> None:
        """Stop every worker (their whole process groups). Safe to call twice or after a failed start."""
        await asyncio.gather(*(w.stop() for w in self._workers.values()), return_exceptions=True)

    async def __aenter__(self) -> EngineManager:
        await self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    async def _prepare_models(self) -> dict[str, Path | str]:
        """Prepare each distinct model once, off the event loop (downloads and conversion block)."""
        prepared: dict[tuple[str, str], Path | str] = {}
        models: dict[str, Path | str] = {}
        for spec in self.specs:
            key = (spec.model, worker_python(spec))
            if key not in prepared:
                prepared[key] = await asyncio.to_thread(
                    prepare_model, spec.model, self.models_dir, self._progress,
                    python=key[1], pip_args=self._pip_args,
                )  # fmt: skip
            models[spec.name] = prepared[key]
        return models
