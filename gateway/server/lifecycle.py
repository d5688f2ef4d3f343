"""What the app does when it starts and stops (its lifespan), in order, and undoes in reverse.

Start: managed workers (when this gateway runs its own), the config and its plugins, logging, the
batch runner, health checks, the reloader, the console's series, the admin port, a frozen GC, the
SIGTERM drain. Stop: drain first, then each of those closed, the engine's workers last but for the
shared clients and the tracer (flushed).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from gateway.batch.service import BatchService
from gateway.ops.logs import apply_logging
from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig, load_config
from gateway.pipeline.services import Services
from gateway.server.admin_port import AdminServer
from gateway.server.drain import install_sigterm_drain
from gateway.server.routes import files
from gateway.server.state import AppState

log = logging.getLogger("gateway")

EngineFactory = Callable[[AppState, GatewayConfig], Any]


# Worker events that mean it is not serving (or stopped trying): worth a warning in the logs.
_BAD_WORKER_EVENTS = frozenset({"exited", "restarting", "restart_failed", "failed"})


def _engine_event_hook(metrics: Metrics) -> Callable[[str, str], None]:
    """The managed workers' ``on_event``: count each event and log it (it must not block or raise)."""

    def on_event(worker: str, event: str) -> None:
        metrics.engine_worker_events.labels(worker, event).inc()
        log.log(logging.WARNING if event in _BAD_WORKER_EVENTS else logging.INFO, "engine worker %s: %s", worker, event)

    return on_event


def default_engine(state: AppState, config: GatewayConfig) -> Any:
    from gateway.engine.supervisor import EngineManager

    return EngineManager(
        config.managed_workers(),  # with LoRA enabled where a model serves adapters
        models_dir=state.settings.model_dir,
        ready_timeout_s=config.engine.ready_timeout_s,
        on_event=_engine_event_hook(state.services.metrics),
    )


class Lifecycle:
    """The app's lifespan. ``config`` overrides reading ``settings.config_path`` (and then the file is
    not watched); ``engine_factory=None`` never starts managed workers."""

    def __init__(
        self,
        state: AppState,
        config: GatewayConfig | None,
        engine_factory: EngineFactory | None,
        admin_server: AdminServer | None,
    ) -> None:
        self.state = state
        self.config = config
        self.engine_factory = engine_factory
        self.admin_server = admin_server
        self._restore_sigterm: Callable[[], None] | None = None

    @asynccontextmanager
    async def lifespan(self, _: FastAPI) -> AsyncIterator[None]:
        initial = self.config or load_config(self.state.settings.config_path)
        await self.start_engine(initial)
        try:
            await self.start(initial)
            yield
        finally:
            await self.stop()

    async def start_engine(self, initial: GatewayConfig) -> None:
        """The managed workers, when this gateway runs its own (before anything that may route to them)."""
        state = self.state
        if self.engine_factory is not None and state.settings.managed_workers and initial.engine.workers:
            state.engine = self.engine_factory(state, initial)
            await state.engine.start()

    async def start(self, initial: GatewayConfig) -> None:
        state, settings, services = self.state, self.state.settings, self.state.services
        await state.holder.load(initial)
        apply_logging(initial.logging, override=settings.log_level)
        if initial.batches.enabled:  # a restart resumes every replica's unfinished batches from Redis
            batch_service = state.extras[files.SERVICE_KEY] = BatchService(state.holder, services, initial.batches)
            batch_service.runner.start()
        upstream = state.holder.current.config.upstream
        services.workers.start_health_checks(
            lambda url: _probe(services, url),
            upstream.health_interval_s,
            timeouts_before_unhealthy=upstream.health_timeouts_before_unhealthy,
        )
        state.reloader.start(watch=self.config is None)  # watch the file only when the config came from it
        state.live_series.start()
        if self.admin_server is not None:
            await self.admin_server.start()
        gc.collect()
        gc.freeze()  # start-up objects never need collecting; keeps GC pauses short under load
        gc.set_threshold(*settings.gc_thresholds)
        self._restore_sigterm = install_sigterm_drain(state, settings.drain_delay_s)
        if state.engine is not None:  # a person ran `make run`: tell them where to point a client
            sys.stderr.write(ready_banner(settings, initial) + "\n")

    async def stop(self) -> None:
        state, services = self.state, self.state.services
        state.draining = True
        if self._restore_sigterm is not None:
            self._restore_sigterm()
            self._restore_sigterm = None
        await state.reloader.aclose()
        await state.live_series.aclose()
        if files.SERVICE_KEY in state.extras:
            await state.extras[files.SERVICE_KEY].runner.aclose()
        if self.admin_server is not None:
            await self.admin_server.stop()
        await state.holder.aclose()
        if state.engine is not None:
            await state.engine.stop()
        await services.aclose()
        if services.tracing is not None:
            await asyncio.to_thread(services.tracing.shutdown)  # flushes, bounded by the exporter timeout


async def _probe(services: Services, url: str) -> str | None:
    """None when the worker answers /health with 200, else a short reason; TimeoutError when it does not
    answer within 2 s (the health loop counts those before it believes them)."""
    try:
        status, _ = await services.upstream.get(url + "/health", timeout_s=2.0)
    except TimeoutError:
        raise
    except Exception as exc:
        return type(exc).__name__
    return None if status == 200 else f"/health answered {status}"


def ready_banner(settings: Settings, config: GatewayConfig) -> str:
    """What a person who just ran `make run` needs: where to point a client, and how."""
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::") else settings.host
    base_url = f"http://{host}:{settings.port}/v1"
    model = config.models[0].name
    body = f'{{"model": "{model}", "messages": [{{"role": "user", "content": "Say hello"}}]}}'
    sdk = (
        f"from openai import OpenAI; c = OpenAI(base_url='{base_url}', api_key='unused'); "
        f"print(c.chat.completions.create(model='{model}', "
        "messages=[{'role': 'user', 'content': 'Say hello'}]).choices[0].message.content)"
    )
    return (
        f"ready: OpenAI-compatible API at {base_url}\n"
        f"  curl -s {base_url}/chat/completions -H 'content-type: application/json' -d '{body}'\n"
        f'  python -c "{sdk}"'
    )
