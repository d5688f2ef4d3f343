"""What the public ``/metrics`` and ``/version`` tell a caller without a key (issue 30): no worker
address, no model name, and nothing that moves differently for a request naming a model that exists
and one naming a model that does not. The model and worker series are the admin's (admin port or
token), and so are the workers' vLLM versions (``GET /admin/versions``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.attacks.raw import CHAT
from tests.server.attacks.test_public_surface import tenancy_config
from tests.support.fakes import ServerThread, free_port, running
from tests.support.gateways import GatewayFactory
from tests.support.tenancy import prefix
from tests.support.vllm_extras_fake import ExtrasWorker

__all__ = ["prefix"]  # the fixture, used by name

ADMIN = "names-nothing-admin-token"
NAMES = ("m1", "m2", "alias-1")


@pytest.fixture
def worker() -> Iterator[tuple[ExtrasWorker, ServerThread]]:
    fake = ExtrasWorker(name="w", version="0.32.0-fake")
    with running(fake) as server:
        yield fake, server


def series(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by name and labels (creation times left out: they are clocks)."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.name.endswith("_created")
    }


def counted(found: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[Any, float]:
    """The samples an attacker can move on purpose: everything but where a latency falls in buckets."""
    return {k: v for k, v in found.items() if not k[0].endswith(("_bucket", "_sum"))}


def probe(gateway_factory: GatewayFactory, config: dict[str, Any], model: str) -> str:
    """A fresh gateway, one chat request without a key naming ``model``, then its public /metrics."""
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        response = httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "model": model}, timeout=10)
        assert response.status_code == 401, response.text
        return httpx.get(server.url + "/metrics", timeout=10).text


def test_public_metrics_are_the_same_for_a_model_that_exists_and_one_that_does_not(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], prefix: str
) -> None:
    config = tenancy_config(prefix, worker[1].url)
    existing = probe(gateway_factory, config, "m1")
    unknown = probe(gateway_factory, config, "no-such-model")
    assert counted(series(existing)) == counted(series(unknown))
    assert series(existing).keys() == series(unknown).keys()


def test_public_metrics_name_no_worker_and_no_model_but_the_admin_sees_them(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], prefix: str
) -> None:
    admin_port = free_port()
    config = tenancy_config(prefix, worker[1].url)
    with gateway_factory(config, admin_token=ADMIN, admin_port=admin_port) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "m1"}).status_code == 401
        public = httpx.get(server.url + "/metrics", timeout=10).text
        admin = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    labels = {label for key in series(public) for label, _ in key[1]}
    assert not labels & {"model", "worker", "target", "fallback"}, labels
    assert worker[1].url not in public and "127.0.0.1" not in public
    assert not any(f'"{name}"' in public for name in NAMES)
    assert "gateway_plugin_hook_duration_seconds" not in public
    assert "gateway_worker_healthy " in public  # how many workers are healthy, none named
    # The admin side keeps every series.
    assert f'gateway_worker_healthy{{worker="{worker[1].url}"}}' in admin
    assert 'model="m1"' in admin and "gateway_plugin_hook_duration_seconds" in admin


def test_version_names_the_gateway_only_and_the_admin_api_the_workers(
    gateway_factory: GatewayFactory, worker: tuple[ExtrasWorker, ServerThread], prefix: str
) -> None:
    config = tenancy_config(prefix, worker[1].url)
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        public = httpx.get(server.url + "/version", timeout=10)
        admin = httpx.get(server.url + "/admin/versions", headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
        anonymous = httpx.get(server.url + "/admin/versions", timeout=10)
    assert public.status_code == 200
    assert list(public.json()) == ["version"]
    assert "0.32.0-fake" not in public.text and not any(name in public.text for name in NAMES)
    assert admin.status_code == 200, admin.text
    assert admin.json()["vllm"] == {"m1": "0.32.0-fake", "m2": "0.32.0-fake"}
    assert anonymous.status_code == 401
