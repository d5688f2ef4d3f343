"""A key id names one key for good, against real Redis: a revoked id is never created again (its usage,
history and batches stay its own; a batch it made runs as nobody else), nor is an id a config.yaml once
declared; a config declaring an id the admin API created (in use or revoked) is refused on reload naming
the id, and a created key whose id the running config declares anyway does not authenticate."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
import redis.asyncio as aioredis

from gateway.pipeline.batch_config import BatchLine, Caller
from gateway.wire.errors import AuthenticationFailed
from plugins.tenancy.batch_lines import line_key
from plugins.tenancy.config import ConfigKey, Limits
from plugins.tenancy.keys import KeyExists, KeyStore, hash_key
from tests.plugins.tenancy.test_keys import ADMIN, admin, chat, tenancy
from tests.support.batches import batch_names, batches_section, chat_line, start
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory
from tests.support.tenancy import PEPPER, prefix
from tests.wire.test_error_shape import assert_error_shape

__all__ = ["batch_names", "prefix"]  # the fixtures, used by name

CONFIG_KEY = "sk-gw-declared-in-config-0001"


def store(prefix: str, config_keys: list[Any] | None = None) -> tuple[aioredis.Redis, KeyStore]:
    client = aioredis.Redis()
    return client, KeyStore(client, prefix, PEPPER.encode(), config_keys or [], ttl_s=1.0, max_entries=100)


def declared(key_id: str, key: str = CONFIG_KEY) -> dict[str, Any]:
    return {"id": key_id, "tenant": "team-a", "hash": hash_key(key, PEPPER.encode())}


# -- a revoked id stays taken --------------------------------------------------------------------------


def test_a_revoked_id_is_never_created_again_and_looks_unknown_everywhere(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str
) -> None:
    config = tenancy(prefix, upstream_url, redis_timeout_ms=2000)
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        first = admin(server, "create_key", {"tenant": "team-a", "id": "ci"}).json()["result"]
        assert chat(server, first["key"]).status_code == 200
        assert admin(server, "revoke_key", {"id": "ci"}).status_code == 200
        for tenant in ("team-a", "team-b"):  # the same tenant would inherit the usage; another, even more
            again = assert_error_shape(admin(server, "create_key", {"tenant": tenant, "id": "ci"}), 400)
            assert (again["param"], again["code"]) == ("id", "key_exists") and "'ci'" in again["message"]
        assert chat(server, first["key"]).status_code == 401
        assert admin(server, "list_keys", {}).json()["result"]["keys"] == []
        for action in ("usage", "usage_history"):
            unknown = assert_error_shape(admin(server, action, {"key_id": "ci"}), 404)
            assert unknown["code"] == "key_not_found"
        assert assert_error_shape(admin(server, "revoke_key", {"id": "ci"}), 404)["code"] == "key_not_found"
        other = admin(server, "create_key", {"tenant": "team-a", "id": "ci-2"})
        assert other.status_code == 200  # other ids are unaffected
        assert [k["id"] for k in admin(server, "list_keys", {}).json()["result"]["keys"]] == ["ci-2"]


async def test_a_revoked_keys_batch_lines_find_no_key_even_after_a_create_with_its_id(prefix: str) -> None:
    client, keys = store(prefix)
    try:
        await keys.create("batcher", "acme", ["*"], Limits())
        assert await keys.revoke("batcher")
        with pytest.raises(KeyExists):
            await keys.create("batcher", "acme", ["*"], Limits())
        assert await keys.by_id("batcher") is None
        with pytest.raises(AuthenticationFailed):
            await line_key(keys, BatchLine(Caller("acme", "batcher"), "batch_1", "line-1"))
    finally:
        await client.aclose()


def test_a_queued_batch_line_of_a_revoked_key_is_refused_and_its_id_stays_taken(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    config = tenancy(prefix, upstream_url, redis_timeout_ms=2000)
    config["batches"] = batches_section(batch_names, max_in_flight=1)  # one line at a time: the second waits
    upstream.behavior.hold = threading.Event()
    with gateway_factory(config, admin_token=ADMIN) as (_, server):
        created = admin(server, "create_key", {"tenant": "acme", "id": "batcher"}).json()["result"]
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=created["key"], max_retries=0)
        try:
            batch = start(client, [chat_line("first", "one"), chat_line("second", "two")])
            while len(upstream.requests) < 1:  # the first line is at the worker, the second queued
                time.sleep(0.01)
            assert admin(server, "revoke_key", {"id": "batcher"}).status_code == 200
            again = admin(server, "create_key", {"tenant": "acme", "id": "batcher"})
            assert assert_error_shape(again, 400)["code"] == "key_exists"
        finally:
            upstream.behavior.hold.set()
        done = settled(server, batch.id)
    assert (done["status"], done["key_id"]) == ("completed", "batcher")
    assert (done["request_counts"]["completed"], done["request_counts"]["failed"]) == (1, 1)
    assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["one"]  # the second never ran


def settled(server: Any, batch_id: str, timeout_s: float = 60) -> dict[str, Any]:
    """The batch as operators see it (its owner's key is revoked) once it ended (a bound, not a speed)."""
    deadline = time.monotonic() + timeout_s
    while True:
        reply = httpx.get(f"{server.url}/admin/batches/{batch_id}", headers={"authorization": f"Bearer {ADMIN}"})
        assert reply.status_code == 200, reply.text
        batch: dict[str, Any] = reply.json()
        if batch["status"] in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return batch
        time.sleep(0.05)


# -- config ids and created ids ------------------------------------------------------------------------


def write(path: Path, config: dict[str, Any]) -> None:
    path.write_bytes(orjson.dumps(config))


def reload(server: Any) -> httpx.Response:
    return httpx.post(server.url + "/admin/reload", headers={"authorization": f"Bearer {ADMIN}"})


@pytest.mark.parametrize("revoked", [False, True])
def test_a_reload_declaring_a_created_id_is_refused_naming_it(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    tmp_path: Path,
    revoked: bool,
) -> None:
    path = tmp_path / "config.yaml"
    config = tenancy(prefix, upstream_url, redis_timeout_ms=2000)
    write(path, config)
    with gateway_factory(config, admin_token=ADMIN, config_path=path, config_watch_s=0) as (_, server):
        created = admin(server, "create_key", {"tenant": "team-a", "id": "shared"}).json()["result"]
        if revoked:
            assert admin(server, "revoke_key", {"id": "shared"}).status_code == 200
        live = httpx.get(server.url + "/admin/config", headers={"authorization": f"Bearer {ADMIN}"}).json()["version"]
        write(
            path,
            tenancy(
                prefix, upstream_url, redis_timeout_ms=2000, keys=[declared("shared"), declared("x", CONFIG_KEY + "x")]
            ),
        )
        refused = assert_error_shape(reload(server), 400)
        assert refused["code"] == "config_invalid"
        assert "'shared'" in refused["message"] and "'x'" not in refused["message"]
        assert (
            "created through the admin API" in refused["message"]
            and f"(version {live}) stays live" in refused["message"]
        )
        assert chat(server, CONFIG_KEY).status_code == 401  # the refused config's key never went live
        assert chat(server, created["key"]).status_code == (401 if revoked else 200)

        write(path, tenancy(prefix, upstream_url, redis_timeout_ms=2000, keys=[declared("shared-2")]))
        assert reload(server).status_code == 200  # another id: the config loads
        assert chat(server, CONFIG_KEY).status_code == 200


def test_a_config_keys_id_stays_taken_once_the_config_drops_it(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, prefix: str, tmp_path: Path
) -> None:
    """A key removed from config.yaml leaves its usage and history under its id: a key created later must
    not take the id over. The same config loads again (its own ids are no clash), on another gateway too."""
    path = tmp_path / "config.yaml"
    declaring = tenancy(prefix, upstream_url, redis_timeout_ms=2000, keys=[declared("team-key")])
    write(path, declaring)
    with gateway_factory(declaring, admin_token=ADMIN, config_path=path, config_watch_s=0) as (_, server):
        assert chat(server, CONFIG_KEY).status_code == 200
        assert reload(server).status_code == 200  # the same ids again: no clash with themselves
        write(path, tenancy(prefix, upstream_url, redis_timeout_ms=2000))
        assert reload(server).status_code == 200  # the key is gone from config.yaml
        assert chat(server, CONFIG_KEY).status_code == 401
        taken = assert_error_shape(admin(server, "create_key", {"tenant": "team-b", "id": "team-key"}), 400)
        assert (taken["param"], taken["code"]) == ("id", "key_exists")
        for action in ("usage", "usage_history"):
            assert assert_error_shape(admin(server, action, {"key_id": "team-key"}), 404)["code"] == "key_not_found"
        assert admin(server, "list_keys", {}).json()["result"]["keys"] == []  # the id's entry is no key
        assert admin(server, "create_key", {"tenant": "team-b", "id": "other"}).status_code == 200
    with gateway_factory(declaring, admin_token=ADMIN) as (_, again):  # a restart with the old config
        assert chat(again, CONFIG_KEY).status_code == 200


async def test_a_created_key_whose_id_the_running_config_declares_does_not_authenticate(
    prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Created on a replica whose config did not declare the id yet, or with Redis away when this config
    loaded: the config's key keeps the id, the created one is refused (and a log line names the id)."""
    client, other_replica = store(prefix)
    try:
        key, _ = await other_replica.create("shared", "team-b", ["*"], Limits())
        _, keys = store(prefix, [ConfigKey.model_validate(declared("shared"))])
        assert await keys.lookup(keys.digest(key)) is None
        assert "'shared'" in caplog.text and key not in caplog.text
        assert await keys.claim_config_ids() == ["shared"]  # what refuses such a config when Redis can be read
        config_info = await keys.lookup(keys.digest(CONFIG_KEY))
        assert config_info is not None and config_info.source == "config"
        assert await keys.by_id("shared") == config_info
    finally:
        await client.aclose()
