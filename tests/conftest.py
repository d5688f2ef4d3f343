"""Shared fixtures: a fake worker on a real socket, and gateways built from config dicts."""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Generator, Iterator
from typing import Any

import pytest

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import GatewayApp, create_app
from gateway.server.front_door import http_protocol
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.gateways import ENGINE_ADMIN_TOKEN, REPO, GatewayFactory, RealEngine, base_config, engine_config


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used the real engine reports its workers' last output lines."""
    report: pytest.TestReport = yield
    engine = getattr(item, "funcargs", {}).get("real_engine")
    if report.failed and isinstance(engine, RealEngine):
        for title, text in engine.output_sections():
            report.sections.append((title, text))
    return report


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """No test leaves the process environment or the garbage collector's thresholds changed for the tests
    after it (``gateway serve`` run in-process writes its options into os.environ for uvicorn's factory,
    e.g. GATEWAY_MANAGED_WORKERS)."""
    saved = dict(os.environ)
    thresholds = gc.get_threshold()  # a gateway's start-up sets the collector's (settings.gc_thresholds)
    yield
    gc.set_threshold(*thresholds)
    if os.environ != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def upstream_server() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    fake = FakeUpstream()
    with ServerThread(fake) as server:
        yield fake, server


@pytest.fixture
def upstream(upstream_server: tuple[FakeUpstream, ServerThread]) -> Iterator[FakeUpstream]:
    fake, _ = upstream_server
    fake.reset()
    yield fake
    fake.reset()


@pytest.fixture
def upstream_url(upstream_server: tuple[FakeUpstream, ServerThread]) -> str:
    return upstream_server[1].url


@pytest.fixture
def gateway_factory() -> GatewayFactory:
    """``with gateway_factory(config_dict, plugins={name: cls}) as (app, server): ...``; ``http`` picks
    uvicorn's HTTP implementation: by default what ``gateway serve`` runs (httptools behind the front
    door's bounds, from ``settings``), or ``"h11"``/``"httptools"`` for uvicorn's own."""

    @contextlib.contextmanager
    def factory(
        config: dict[str, Any],
        plugins: dict[str, type[Plugin]] | None = None,
        http: str = "gateway",
        **settings: Any,
    ) -> Iterator[tuple[GatewayApp, ServerThread]]:
        registry = PluginRegistry()
        for name, cls in (plugins or {}).items():
            registry.register(name, cls)
        app = create_app(
            Settings(**settings),
            registry=registry,
            config=GatewayConfig.model_validate(config),
            engine_factory=None,
        )
        protocol = http_protocol(app.state.settings) if http == "gateway" else http
        with ServerThread(app, http=protocol, options=app.state.settings.server_options()) as server:
            yield app, server

    return factory


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> Iterator[ServerThread]:
    """A gateway with the routing plugin in front of the fake worker."""
    with gateway_factory(base_config([upstream_url])) as (_, server):
        yield server


@pytest.fixture(scope="session")
def real_engine() -> Iterator[RealEngine]:
    """Started once per session, on first use (the model is prepared by `make test` beforehand)."""
    port = free_port()
    config = GatewayConfig.model_validate(engine_config(port))
    settings = Settings(model_dir=REPO / "models", admin_token=ENGINE_ADMIN_TOKEN)
    app = create_app(settings, registry=PluginRegistry(), config=config)
    with ServerThread(app, start_timeout_s=900) as server:
        yield RealEngine(gateway_url=server.url, url=f"http://127.0.0.1:{port}", app=app)


@pytest.fixture(scope="session")
def real_worker(real_engine: RealEngine) -> RealEngine:
    """The real vLLM worker (``.url``) serving model ``smollm2``."""
    return real_engine
