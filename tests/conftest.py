"""Shared fixtures: a fake worker on a real socket, and gateways built from config dicts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from gateway.app import GatewayApp, create_app
from gateway.config import GatewayConfig
from gateway.pipeline import Plugin
from gateway.registry import PluginRegistry
from gateway.settings import Settings
from tests.fakes import FakeUpstream, ServerThread


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


def base_config(worker_urls: list[str], plugins: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "models": [{"name": "m1", "aliases": ["alias-1"], "workers": worker_urls}],
        "plugins": plugins if plugins is not None else [{"name": "routing"}],
        "upstream": {"connect_timeout_s": 1, "first_byte_timeout_s": 5, "idle_timeout_s": 2, "health_interval_s": 0.5},
    }
    config.update(extra)
    return config


GatewayFactory = Callable[..., contextlib.AbstractContextManager[tuple[GatewayApp, ServerThread]]]


@pytest.fixture
def gateway_factory() -> GatewayFactory:
    """``with gateway_factory(config_dict, plugins={name: cls}) as (app, server): ...``"""

    @contextlib.contextmanager
    def factory(
        config: dict[str, Any], plugins: dict[str, type[Plugin]] | None = None, **settings: Any
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
        with ServerThread(app) as server:
            yield app, server

    return factory


@pytest.fixture
def gateway(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> Iterator[ServerThread]:
    """A gateway with the routing plugin in front of the fake worker."""
    with gateway_factory(base_config([upstream_url])) as (_, server):
        yield server
