"""The running configuration as an immutable snapshot, and the holder that swaps it.

Reload is prepare-then-swap: ``prepare`` parses nothing itself but validates every plugin's config,
builds and starts the plugins (any failure closes what was built and raises ``ConfigError``, leaving
the live snapshot untouched); ``swap`` is one reference assignment, after which the new plugins'
``went_live`` runs. Each request pins the snapshot it started with; a retired snapshot's plugins are
closed once its last pinned request finishes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from gateway.ops.tracing import HookObserver
from gateway.pipeline.chain import BoundPlugin, Pipeline
from gateway.pipeline.config import ConfigError, GatewayConfig, config_version
from gateway.pipeline.models import ModelTable
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.services import Services
from gateway.pipeline.validate import resolve_plugins

log = logging.getLogger("gateway.runtime")


@dataclass(eq=False)
class RuntimeSnapshot:
    config: GatewayConfig
    version: str
    loaded_at: float
    pipeline: Pipeline
    models: ModelTable
    in_flight: int = 0
    retired: asyncio.Event = field(default_factory=asyncio.Event)
    drained: asyncio.Event = field(default_factory=asyncio.Event)


async def build_snapshot(config: GatewayConfig, registry: PluginRegistry, services: Services) -> RuntimeSnapshot:
    """Validate plugin configs, construct and start plugins. Raises ConfigError naming the field."""
    resolved = resolve_plugins(config, registry)
    bound: list[BoundPlugin] = []
    try:
        for item in resolved:
            entry, cls = item.entry, item.cls
            plugin = cls(item.config, services)
            try:
                plugin.prepare(config)
                await plugin.start()
            except Exception as exc:
                await plugin.aclose()
                raise ConfigError([f"plugins[{item.index}] ({entry.name}): could not start: {exc}"]) from exc
            timeout_ms = entry.timeout_ms if entry.timeout_ms is not None else cls.default_timeout_ms
            bound.append(
                BoundPlugin(
                    name=entry.name,
                    plugin=plugin,
                    on_error=entry.on_error or cls.default_on_error,
                    timeout_s=timeout_ms / 1000 if timeout_ms else None,
                )
            )
    except BaseException:
        await Pipeline(bound).aclose()
        raise
    return RuntimeSnapshot(
        config=config,
        version=config_version(config),
        loaded_at=time.time(),
        pipeline=Pipeline(bound, observe=_hook_observer(services)),
        models=ModelTable(config, [b.plugin.model_moves() for b in bound]),
    )


def _went_live(snapshot: RuntimeSnapshot) -> None:
    """Tell the live snapshot's plugins it is live. The swap is done: a plugin that fails here is logged
    and the config stays live."""
    for bound in snapshot.pipeline.plugins:
        try:
            bound.plugin.went_live()
        except Exception:
            log.exception("plugin '%s' failed on going live with config %s", bound.name, snapshot.version)


def _hook_observer(services: Services) -> HookObserver:
    metrics = services.metrics
    return metrics if services.tracing is None else services.tracing.hook_observer(metrics)


class RuntimeHolder:
    """Holds the live snapshot; serializes reloads; retires old snapshots after they drain."""

    def __init__(self, registry: PluginRegistry, services: Services) -> None:
        self.registry = registry
        self.services = services
        self._current: RuntimeSnapshot | None = None
        self._lock = asyncio.Lock()
        self._retiring: set[asyncio.Task[None]] = set()

    @property
    def current(self) -> RuntimeSnapshot:
        if self._current is None:
            raise RuntimeError("no config loaded yet")
        return self._current

    @property
    def loaded(self) -> bool:
        return self._current is not None

    @contextmanager
    def pin(self) -> Iterator[RuntimeSnapshot]:
        """The snapshot a request uses from start to end."""
        snapshot = self.current
        snapshot.in_flight += 1
        try:
            yield snapshot
        finally:
            snapshot.in_flight -= 1
            if snapshot.in_flight == 0 and snapshot.retired.is_set():
                snapshot.drained.set()

    async def load(self, config: GatewayConfig) -> tuple[RuntimeSnapshot, bool]:
        """Prepare and swap. Returns (live snapshot, changed). Raises ConfigError, old config intact."""
        async with self._lock:
            if self._current is not None and config_version(config) == self._current.version:
                return self._current, False
            snapshot = await build_snapshot(config, self.registry, self.services)
            old, self._current = self._current, snapshot
            self._apply(snapshot)
            _went_live(snapshot)
            if old is not None:
                self._retire(old)
            log.info("config %s is live", snapshot.version)
            return snapshot, True

    def _apply(self, snapshot: RuntimeSnapshot) -> None:
        self.services.upstream.reconfigure(snapshot.config.upstream)
        self.services.workers.sync(snapshot.models.all_worker_urls())
        self.services.metrics.set_config_version(snapshot.version)
        self.services.metrics.declare_models([model.name for model in snapshot.models.models])

    def _retire(self, old: RuntimeSnapshot) -> None:
        old.retired.set()
        if old.in_flight == 0:
            old.drained.set()

        async def close_when_drained() -> None:
            await old.drained.wait()
            await old.pipeline.aclose()

        task = asyncio.create_task(close_when_drained(), name=f"retire-{old.version}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def aclose(self) -> None:
        """Shutdown: close the live snapshot and whatever is still draining."""
        if self._current is not None:
            self._retire(self._current)
            self._current = None
        if self._retiring:
            await asyncio.wait(self._retiring, timeout=30)
