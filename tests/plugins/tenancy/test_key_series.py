"""A gone key's series leave /metrics, against real Redis: revoked on this replica, found revoked on
another, dropped from config.yaml by a reload. Keys are created and revoked at will, so series kept for
every key ever seen would grow /metrics without bound; the tenant's other keys go on being counted."""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from tests.plugins.tenancy.test_key_ids import CONFIG_KEY, declared, reload, write
from tests.plugins.tenancy.test_keys import ADMIN, admin, chat, tenancy
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory
from tests.support.tenancy import prefix

__all__ = ["prefix"]  # the fixture, used by name


def admitted(server: ServerThread) -> dict[str, float]:
    """``gateway_tenancy_requests_total`` by key id, as the admin's scrape of /metrics shows it."""
    text = httpx.get(server.url + "/metrics", headers={"authorization": f"Bearer {ADMIN}"}).text
    found = {}
    for line in text.splitlines():
        if line.startswith("gateway_tenancy_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            key_id = labels.split('key_id="', 1)[1].split('"', 1)[0]
            found[key_id] = float(value)
    return found


def created(server: ServerThread, key_id: str, tenant: str = "team-a") -> str:
    answer = admin(server, "create_key", {"tenant": tenant, "id": key_id})
    assert answer.status_code == 200, answer.text
    key: str = answer.json()["result"]["key"]
    return key


def test_a_revoked_keys_series_leaves_metrics_and_the_tenants_next_key_is_counted(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    with gateway_factory(tenancy(prefix, upstream_url), admin_token=ADMIN) as (_, server):
        old, kept = created(server, "old"), created(server, "kept")
        for key in (old, old, kept):
            assert chat(server, key).status_code == 200
        assert admitted(server) == {"old": 2.0, "kept": 1.0}

        assert admin(server, "revoke_key", {"id": "old"}).status_code == 200
        assert admitted(server) == {"kept": 1.0}
        assert chat(server, old).status_code == 401  # refused, and counted nowhere
        assert admitted(server) == {"kept": 1.0}

        fresh = created(server, "fresh")  # the same tenant
        assert chat(server, fresh).status_code == 200
        assert chat(server, kept).status_code == 200
        assert admitted(server) == {"kept": 2.0, "fresh": 1.0}


def test_a_key_revoked_on_another_replica_loses_its_series_here_once_found_revoked(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url)
    with (
        gateway_factory(config, admin_token=ADMIN) as (_, a),
        gateway_factory(config, admin_token=ADMIN) as (_, b),
    ):
        key, other = created(a, "ci"), created(a, "other")
        assert chat(b, key).status_code == 200 and chat(b, other).status_code == 200
        assert admitted(b) == {"ci": 1.0, "other": 1.0}
        assert admin(a, "revoke_key", {"id": "ci"}).status_code == 200
        time.sleep(1.0)  # replica b reads the key again after key_cache_ttl_s (<= 1 s)
        assert chat(b, key).status_code == 401
        assert admitted(b) == {"other": 1.0}
        assert chat(b, other).status_code == 200
        assert admitted(b) == {"other": 2.0}


def test_a_config_key_dropped_by_a_reload_loses_its_series(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, tmp_path: Path
) -> None:
    path = tmp_path / "config.yaml"
    kept_key = CONFIG_KEY + "-kept"
    both = tenancy(prefix, upstream_url, keys=[declared("dropped"), declared("kept", kept_key)])
    write(path, both)
    with gateway_factory(both, admin_token=ADMIN, config_path=path, config_watch_s=0) as (_, server):
        assert chat(server, CONFIG_KEY).status_code == 200 and chat(server, kept_key).status_code == 200
        assert reload(server).status_code == 200  # the same keys: both series stay
        assert admitted(server) == {"dropped": 1.0, "kept": 1.0}
        write(path, tenancy(prefix, upstream_url, keys=[declared("kept", kept_key)]))
        assert reload(server).status_code == 200
        assert admitted(server) == {"kept": 1.0}
        assert chat(server, kept_key).status_code == 200
        assert admitted(server) == {"kept": 2.0}
