"""Config sources the other reload tests do not drive: SIGHUP, the file watcher through a removed file
and a refused content, an unreadable file on POST /admin/reload, announcing to other replicas (and
failing to), the Redis config channel's own-origin, version-mismatch and unreachable-Redis paths, and
the watcher and the channel stopping when cancelled inside a call that turns the cancellation into an
error of its own."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
import yaml
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.reload import ConfigRefused, Reloader
from gateway.pipeline.runtime import RuntimeHolder
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import WorkerTable
from tests.support.cancellation import CutAwait, stopped_when_cancelled
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.wire.test_error_shape import CHAT, assert_error_shape

TOKEN = "cover-reload-token"
REDIS_URL = "redis://127.0.0.1:6379/0"


def config_text(alias: str) -> bytes:
    config = base_config(["http://127.0.0.1:9"], plugins=[])
    config["models"][0]["aliases"] = [alias]
    return yaml.safe_dump(config).encode()


async def until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    """Poll ``predicate`` (state changed by another task or a signal) until it holds, within a bound."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        if predicate():
            return
        assert asyncio.get_running_loop().time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def build_reloader(path: Path, **settings: Any) -> Reloader:
    resolved = Settings(config_path=path, **settings)
    services = Services(resolved, UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    return Reloader(RuntimeHolder(PluginRegistry(discover=False), services), resolved)


def aliases(reloader: Reloader) -> list[str]:
    return list(reloader.holder.current.config.models[0].aliases)


@pytest.fixture
async def file_reloader(tmp_path: Path) -> AsyncIterator[Reloader]:
    path = tmp_path / "config.yaml"
    path.write_bytes(config_text("first"))
    reloader = build_reloader(path, config_watch_s=0)
    await reloader.from_file("initial")
    yield reloader
    await reloader.aclose()
    await reloader.holder.aclose()
    await reloader.holder.services.aclose()


# -- SIGHUP ---------------------------------------------------------------------------------------


async def test_sighup_reloads_the_file_and_a_refused_file_keeps_the_old_config(file_reloader: Reloader) -> None:
    before = signal.getsignal(signal.SIGHUP)
    file_reloader.start(watch=False)
    try:
        file_reloader.path.write_bytes(config_text("second"))
        os.kill(os.getpid(), signal.SIGHUP)
        await until(lambda: aliases(file_reloader) == ["second"])
        assert file_reloader.source == "sighup"
        version = file_reloader.holder.current.version

        file_reloader.path.write_bytes(b"models: [\n")
        os.kill(os.getpid(), signal.SIGHUP)
        await until(lambda: not any(t.get_name() == "config-sighup" for t in asyncio.all_tasks()))
        assert file_reloader.holder.current.version == version  # refused quietly: no task error, old config
        await until(lambda: file_reloader.history.latest()[0].outcome == "refused")
        refused, accepted = file_reloader.history.latest()[:2]
        assert (accepted.source, accepted.outcome, accepted.version) == ("sighup", "accepted", version)
        assert (refused.source, refused.outcome, refused.version) == ("sighup", "refused", version)
        assert refused.reason is not None and "refused" in refused.reason
    finally:
        await file_reloader.aclose()
    assert signal.getsignal(signal.SIGHUP) == before  # the handler is gone with the reloader


@pytest.mark.parametrize("disposition", [signal.SIG_IGN, signal.SIG_DFL], ids=["nohup", "default"])
async def test_closing_gives_sighup_back_as_it_was(file_reloader: Reloader, disposition: signal.Handlers) -> None:
    """Under nohup SIGHUP is ignored: after the reloader closes it must be ignored again, not reset to the
    default action (which terminates the process)."""
    outer = signal.signal(signal.SIGHUP, disposition)
    try:
        file_reloader.start(watch=False)
        assert signal.getsignal(signal.SIGHUP) not in (signal.SIG_IGN, signal.SIG_DFL)  # asyncio's handler
        await file_reloader.aclose()
        assert signal.getsignal(signal.SIGHUP) == disposition
        await file_reloader.aclose()  # a second close changes nothing
        assert signal.getsignal(signal.SIGHUP) == disposition
    finally:
        signal.signal(signal.SIGHUP, outer)


# -- the file watcher -----------------------------------------------------------------------------


async def test_watcher_survives_a_removed_file_and_loads_it_when_it_returns(file_reloader: Reloader) -> None:
    file_reloader.settings = Settings(config_path=file_reloader.path, config_watch_s=0.02)
    file_reloader.start(watch=True)
    file_reloader.path.unlink()
    await asyncio.sleep(0.1)  # several polls find no file
    assert aliases(file_reloader) == ["first"]
    file_reloader.path.write_bytes(config_text("back"))
    await until(lambda: aliases(file_reloader) == ["back"])
    assert file_reloader.source == "watch"


async def test_watcher_refuses_a_bad_content_once_and_not_again_until_it_changes(
    file_reloader: Reloader, caplog: pytest.LogCaptureFixture
) -> None:
    file_reloader.settings = Settings(config_path=file_reloader.path, config_watch_s=0.02)
    caplog.set_level(logging.WARNING, logger="gateway.pipeline.reload")
    file_reloader.start(watch=True)
    file_reloader.path.write_bytes(b"models: []\n")
    await until(lambda: any("config refused" in m for m in caplog.messages))
    await asyncio.sleep(0.15)  # many more polls of the same refused content
    assert sum("config refused" in m for m in caplog.messages) == 1
    assert aliases(file_reloader) == ["first"]
    file_reloader.path.write_bytes(config_text("fixed"))
    await until(lambda: aliases(file_reloader) == ["fixed"])
    # The history has the refusal once too, then the fix: what the console's config view lists.
    outcomes = [(e.who, e.outcome) for e in file_reloader.history.latest()[:2]]
    assert outcomes == [("watch", "accepted"), ("watch", "refused")]


async def test_watcher_cancelled_while_announcing_a_change_stops(file_reloader: Reloader) -> None:
    """Shut down while the watcher announces a change it loaded, and the announcement's Redis call turns
    the cancellation into an error of its own: loading logs a failed announcement and goes on, and the
    watcher must stop there instead of polling on with the cancellation swallowed."""
    announce = CutAwait(lambda: RedisConnectionError("Connection closed by server."))
    file_reloader.announce = announce
    file_reloader.settings = Settings(config_path=file_reloader.path, config_watch_s=0.02)
    file_reloader.start(watch=True)
    file_reloader.path.write_bytes(config_text("announced"))
    await asyncio.wait_for(announce.entered.wait(), 5)
    (watch,) = [t for t in file_reloader._tasks if t.get_name() == "config-watch"]
    done = await stopped_when_cancelled(watch, 2)  # what aclose does, at shutdown
    assert announce.converted, "the announcement never saw the cancellation"
    assert done, "the watcher went on polling the file after it was cancelled"


async def test_from_file_on_a_missing_file_is_refused_naming_the_live_version(file_reloader: Reloader) -> None:
    live = file_reloader.holder.current.version
    file_reloader.path.unlink()
    with pytest.raises(ConfigRefused) as refused:
        await file_reloader.from_file("api")
    assert "cannot read the config file" in refused.value.message
    assert f"(version {live}) stays live" in refused.value.message
    assert refused.value.code == "config_invalid" and refused.value.status_code == 400


def test_admin_reload_of_an_unreadable_file_is_a_400_and_the_gateway_keeps_serving(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere" / "config.yaml"
    with gateway_factory(base_config([upstream_url]), admin_token=TOKEN, config_path=missing) as (_, server):
        response = httpx.post(server.url + "/admin/reload", headers={"authorization": f"Bearer {TOKEN}"})
        error = assert_error_shape(response, 400)
        assert error["code"] == "config_invalid" and str(missing) in error["message"]
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


# -- announcing to other replicas -----------------------------------------------------------------


async def test_changes_are_announced_once_with_their_text_version_and_source(file_reloader: Reloader) -> None:
    heard: list[tuple[bytes, str, str]] = []

    async def announce(text: bytes, version: str, source: str) -> None:
        heard.append((text, version, source))

    file_reloader.announce = announce
    text = config_text("announced")
    result = await file_reloader.from_text(text, "api")
    assert heard == [(text, result.version, "api")]
    again = await file_reloader.from_text(text, "api")  # same content: nothing to tell anyone
    assert not again.changed and len(heard) == 1
    await file_reloader.from_text(config_text("quiet"), "channel", announce=False)
    assert len(heard) == 1


async def test_a_failed_announcement_does_not_undo_the_change(
    file_reloader: Reloader, caplog: pytest.LogCaptureFixture
) -> None:
    async def broken(text: bytes, version: str, source: str) -> None:
        raise ConnectionError("redis is away")

    file_reloader.announce = broken
    result = await file_reloader.from_text(config_text("kept"), "api")
    assert result.changed and aliases(file_reloader) == ["kept"]
    assert any("could not announce config" in r.message for r in caplog.records)


# -- the Redis config channel ---------------------------------------------------------------------


@pytest.fixture
async def channel_reloader(tmp_path: Path) -> AsyncIterator[Reloader]:
    path = tmp_path / "config.yaml"
    path.write_bytes(config_text("first"))
    reloader = build_reloader(path, config_watch_s=0, config_channel=f"cover-{uuid.uuid4().hex}")
    await reloader.from_file("initial")
    reloader.start(watch=False)
    assert reloader.channel is not None
    await until(reloader.channel.ready.is_set)
    yield reloader
    await reloader.aclose()
    await reloader.holder.aclose()
    await reloader.holder.services.aclose()


async def publish(channel: str, message: dict[str, Any]) -> None:
    client = aioredis.Redis.from_url(REDIS_URL, socket_timeout=2)
    try:
        assert await client.publish(channel, orjson.dumps(message)) >= 1
    finally:
        await client.aclose()


async def test_channel_ignores_its_own_announcements(channel_reloader: Reloader) -> None:
    channel = channel_reloader.channel
    assert channel is not None
    await publish(channel.name, {"origin": channel.origin, "version": "v", "config": config_text("echo").decode()})
    await publish(channel.name, {"origin": "other", "version": "v2", "config": config_text("foreign").decode()})
    await until(lambda: aliases(channel_reloader) == ["foreign"])  # the second arrived: the first was skipped
    assert channel_reloader.source == "channel"


async def test_channel_loads_a_config_whose_announced_version_differs_and_says_so(
    channel_reloader: Reloader, caplog: pytest.LogCaptureFixture
) -> None:
    channel = channel_reloader.channel
    assert channel is not None
    caplog.set_level(logging.WARNING, logger="gateway.pipeline.reload")
    await publish(channel.name, {"origin": "other", "version": "not-the-hash", "config": config_text("x").decode()})
    await until(lambda: aliases(channel_reloader) == ["x"])
    await until(lambda: any("announced version not-the-hash loaded as" in m for m in caplog.messages))


async def test_channel_publishes_local_changes_but_never_echoes_channel_ones(channel_reloader: Reloader) -> None:
    channel = channel_reloader.channel
    assert channel is not None
    listener = aioredis.Redis.from_url(REDIS_URL, socket_timeout=5)
    received: list[dict[str, Any]] = []
    try:
        async with listener.pubsub(ignore_subscribe_messages=True) as pubsub:
            await pubsub.subscribe(channel.name)
            await channel.publish(b"a: 1", "v-api", "api")
            await channel.publish(b"b: 2", "v-channel", "channel")
            await channel.publish(b"c: 3", "v-watch", "watch")
            async with asyncio.timeout(5):
                while len(received) < 2:
                    message = await pubsub.get_message(timeout=1.0)
                    if message is not None:
                        received.append(orjson.loads(message["data"]))
    finally:
        await listener.aclose()
    assert [(m["version"], m["source"], m["config"]) for m in received] == [
        ("v-api", "api", "a: 1"),
        ("v-watch", "watch", "c: 3"),
    ]
    assert {m["origin"] for m in received} == {channel.origin}


async def test_channel_cancelled_inside_a_redis_read_stops(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shut down while the channel waits for a message, and redis-py turns the cancellation of its read
    into ConnectionError: the channel reconnects after Redis errors, and must stop instead."""
    cut_read = CutAwait(lambda: RedisConnectionError("Connection closed by server."))
    monkeypatch.setattr(aioredis.client.PubSub, "get_message", cut_read)
    path = tmp_path / "config.yaml"
    path.write_bytes(config_text("first"))
    reloader = build_reloader(path, config_watch_s=0, config_channel=f"cover-{uuid.uuid4().hex}")
    await reloader.from_file("initial")
    reloader.start(watch=False)
    try:
        await asyncio.wait_for(cut_read.entered.wait(), 5)
        (listen,) = [t for t in reloader._tasks if t.get_name() == "config-channel"]
        done = await stopped_when_cancelled(listen, 2)  # what aclose does, at shutdown
        assert cut_read.converted, "the read never saw the cancellation"
        assert done, "the channel went on reconnecting after it was cancelled"
    finally:
        await reloader.aclose()
        await reloader.holder.aclose()
        await reloader.holder.services.aclose()


async def test_channel_keeps_retrying_while_redis_is_unreachable(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.yaml"
    path.write_bytes(config_text("first"))
    reloader = build_reloader(
        path, config_watch_s=0, config_channel="cover-unreachable", redis_url="redis://127.0.0.1:1/0"
    )
    caplog.set_level(logging.WARNING, logger="gateway.pipeline.reload")
    await reloader.from_file("initial")
    reloader.start(watch=False)
    try:
        await until(lambda: any("retrying in 0.5 s" in m for m in caplog.messages))
        assert reloader.channel is not None and not reloader.channel.ready.is_set()
        # The replica still takes configs from its other sources meanwhile.
        await reloader.from_text(config_text("local"), "api")
        assert aliases(reloader) == ["local"]
    finally:
        await reloader.aclose()
        await reloader.holder.aclose()
        await reloader.holder.services.aclose()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "config-channel"]
