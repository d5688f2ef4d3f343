"""Replicas converge through the Redis config channel (real Redis, a channel unique to the test)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import orjson
import redis

from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

TOKEN = "channel-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}


def version(server: ServerThread) -> str:
    return str(httpx.get(server.url + "/admin/config", headers=ADMIN).json()["version"])


def eventually(predicate: Callable[[], bool], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def with_alias(upstream_url: str, alias: str) -> dict[str, Any]:
    config = base_config([upstream_url])
    config["models"][0]["aliases"] = [alias]
    return config


def test_replicas_converge_and_refuse_bad_announcements(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    channel = f"test-config-{uuid.uuid4().hex}"
    settings = {"admin_token": TOKEN, "config_channel": channel}
    start = with_alias(upstream_url, "first")
    with (
        gateway_factory(start, **settings) as (app_a, a),
        gateway_factory(start, **settings) as (app_b, b),
    ):
        for app in (app_a, app_b):  # both subscribed before anything is published
            channel_of = app.state.reloader.channel
            assert eventually(channel_of.ready.is_set)
        new = with_alias(upstream_url, "second")
        r = httpx.put(a.url + "/admin/config", headers=ADMIN, content=orjson.dumps(new))
        assert r.status_code == 200 and r.json()["changed"] is True
        assert eventually(lambda: version(b) == r.json()["version"])
        assert httpx.get(b.url + "/admin/config", headers=ADMIN).json()["source"] == "channel"
        assert httpx.get(b.url + "/v1/models/second").status_code == 200

        # A broken or foreign message changes nothing on any replica.
        live = version(b)
        client = redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=2)
        try:
            bad = {"origin": "someone", "version": "x", "config": "models: [broken"}
            assert client.publish(channel, orjson.dumps(bad)) == 2
            assert client.publish(channel, b"not json") == 2
        finally:
            client.close()
        time.sleep(0.3)
        assert version(a) == live and version(b) == live
        assert httpx.get(b.url + "/v1/models/second").status_code == 200
