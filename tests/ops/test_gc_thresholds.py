"""Once start-up objects are frozen, the gateway sets the garbage collector's thresholds from
``GATEWAY_GC_THRESHOLDS`` (default [10000, 10, 10]: bench/README.md has the measurement behind it)."""

from __future__ import annotations

import gc

import pytest

from gateway.ops.settings import Settings
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config


def test_the_gateway_sets_the_collector_thresholds_once_started(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    gc.set_threshold(700, 10, 10)
    with gateway_factory(base_config([upstream_url]), gc_thresholds=(12_345, 11, 12)):
        assert gc.get_threshold() == (12_345, 11, 12)


def test_thresholds_come_from_the_environment_as_a_json_list(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings().gc_thresholds == (10_000, 10, 10)
    monkeypatch.setenv("GATEWAY_GC_THRESHOLDS", "[700, 10, 100]")
    assert Settings().gc_thresholds == (700, 10, 100)
    monkeypatch.setenv("GATEWAY_GC_THRESHOLDS", "[700, 10]")
    with pytest.raises(ValueError, match="gc_thresholds"):
        Settings()
