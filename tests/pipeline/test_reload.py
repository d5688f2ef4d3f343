"""Reload paths: refused configs leave the old one serving, versions follow content, retired plugins
close only after their requests drain, a ConfigMap-style symlink swap is picked up by the watcher."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio as aioredis
import yaml
from pydantic import BaseModel, ConfigDict

from gateway.ops.settings import Settings
from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.services import TENANT_OF
from gateway.server.app import create_app
from plugins.routing import precise_setup
from tests.support.dns import NAME, scripted_routing
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.kv_fleet import kv_sources, kv_workers
from tests.support.kv_publisher import ThreadedPublisher

TOKEN = "reload-admin-token"
ADMIN = {"authorization": f"Bearer {TOKEN}"}
CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


class RedisConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str


class NeedsRedis(Plugin):
    """Refuses to start without its Redis, like any plugin that cannot work without one."""

    name = "needs_redis"
    Config = RedisConfig

    async def start(self) -> None:
        self.client = aioredis.Redis.from_url(self.config.url, socket_connect_timeout=0.3, socket_timeout=0.3)
        try:
            await self.client.ping()
        except Exception:
            await self.client.aclose()
            raise

    async def aclose(self) -> None:
        await self.client.aclose()


class TagConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = "a"


class Tagger(Plugin):
    """Stamps the response with its config's tag; records when it is closed."""

    name = "tagger"
    Config = TagConfig

    async def on_request(self, ctx: RequestContext) -> None:
        ctx.response_headers["x-tag"] = self.config.tag

    async def aclose(self) -> None:
        self.services.shared.setdefault("tagger_closed", []).append((self.config.tag, time.monotonic()))


def closed_tags(app: Any) -> list[tuple[str, float]]:
    return list(app.state.services.shared.get("tagger_closed", []))


PLUGINS: dict[str, type[Plugin]] = {"needs_redis": NeedsRedis, "tagger": Tagger}


def tagged(upstream_url: str, tag: str, **extra: Any) -> dict[str, Any]:
    return base_config(
        [upstream_url], plugins=[{"name": "tagger", "config": {"tag": tag}}, {"name": "routing"}], **extra
    )


def put(server: ServerThread, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.put(server.url + "/admin/config", headers=ADMIN, content=content, timeout=10)


def live_version(server: ServerThread) -> str:
    return str(httpx.get(server.url + "/admin/config", headers=ADMIN).json()["version"])


def serves_tag(server: ServerThread, tag: str) -> None:
    response = httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert response.status_code == 200 and response.headers["x-tag"] == tag


BROKEN: list[tuple[str, Callable[[str], bytes], str | None, str]] = [
    ("bad yaml", lambda url: b"models: [\n  - name: m1\n   workers: {{", None, "not valid YAML at line"),
    ("not a mapping", lambda url: b"- just\n- a list\n", None, "top level must be a mapping"),
    (
        "missing field",
        lambda url: orjson.dumps({"models": [{"name": "m1"}]}),
        "models[0].workers",
        "Field required",
    ),
    (
        "unknown plugin",
        lambda url: orjson.dumps(base_config([url], plugins=[{"name": "no_such_plugin"}, {"name": "routing"}])),
        "plugins[0].name",
        "unknown plugin 'no_such_plugin'",
    ),
    (
        "invalid plugin config",
        lambda url: orjson.dumps(base_config([url], plugins=[{"name": "tagger", "config": {"tag": ["x"]}}])),
        "plugins[0].config.tag",
        "Input should be a valid string",
    ),
    (
        "plugin cannot start (unreachable Redis)",
        lambda url: orjson.dumps(
            base_config([url], plugins=[{"name": "needs_redis", "config": {"url": "redis://127.0.0.1:1/0"}}])
        ),
        None,
        "could not start",
    ),
]


@pytest.mark.parametrize(("case", "make", "param", "reason"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_config_is_refused_and_the_old_one_serves(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    case: str,
    make: Callable[[str], bytes],
    param: str | None,
    reason: str,
) -> None:
    with gateway_factory(tagged(upstream_url, "old"), plugins=PLUGINS, admin_token=TOKEN) as (app, server):
        before = live_version(server)
        response = put(server, make(upstream_url))
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "config_invalid"
        assert reason in error["message"]
        assert f"version {before}" in error["message"]
        if param is not None:
            assert error["param"] == param
        assert live_version(server) == before
        serves_tag(server, "old")
        assert closed_tags(app) == []  # the live plugin was not touched


def test_plugin_needing_redis_loads_when_redis_answers(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with gateway_factory(tagged(upstream_url, "old"), plugins=PLUGINS, admin_token=TOKEN) as (_, server):
        good = base_config(
            [upstream_url], plugins=[{"name": "needs_redis", "config": {"url": "redis://127.0.0.1:6379/0"}}]
        )
        good["plugins"].append({"name": "routing"})
        response = put(server, good)
        assert response.status_code == 200 and response.json()["changed"] is True


def test_version_changes_only_on_real_change(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, tmp_path: Path
) -> None:
    config = tagged(upstream_url, "a")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    with gateway_factory(config, plugins=PLUGINS, admin_token=TOKEN, config_path=path) as (app, server):
        first = live_version(server)
        # The same config as JSON, as YAML with comments and another key order: same version, no swap.
        snapshot = app.state.holder.current
        same_yaml = "# a comment\n" + yaml.safe_dump(dict(reversed(list(config.items()))), sort_keys=False)
        for body in (orjson.dumps(config), same_yaml.encode()):
            response = put(server, body)
            assert response.status_code == 200
            assert response.json() == {**response.json(), "version": first, "changed": False}
        reloaded = httpx.post(server.url + "/admin/reload", headers=ADMIN)
        assert reloaded.json()["version"] == first and reloaded.json()["changed"] is False
        assert app.state.holder.current is snapshot  # nothing was rebuilt
        # A real change gets a new version, visible on the admin API and in metrics.
        path.write_text(yaml.safe_dump(tagged(upstream_url, "b")))
        reloaded = httpx.post(server.url + "/admin/reload", headers=ADMIN)
        assert reloaded.status_code == 200 and reloaded.json()["changed"] is True
        second = reloaded.json()["version"]
        assert second != first and live_version(server) == second
        assert httpx.get(server.url + "/admin/config", headers=ADMIN).json()["source"] == "api"
        serves_tag(server, "b")
        metrics = httpx.get(server.url + "/metrics").text
        assert f'gateway_config_info{{version="{second}"}} 1.0' in metrics
        assert f'gateway_config_info{{version="{first}"}} 0.0' in metrics


def test_in_flight_stream_finishes_on_its_snapshot_and_old_plugins_close_after(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    upstream.behavior.chunks = 8
    upstream.behavior.pace_s = 0.15
    with gateway_factory(tagged(upstream_url, "old"), plugins=PLUGINS, admin_token=TOKEN) as (app, server):
        body = {**CHAT, "stream": True}
        with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=10) as stream:
            assert stream.headers["x-tag"] == "old"
            lines = stream.iter_lines()
            next(lines)  # the stream is open and pinned to the old snapshot
            assert put(server, tagged(upstream_url, "new")).json()["changed"] is True
            serves_tag(server, "new")  # new requests see the new config at once
            time.sleep(0.2)
            assert closed_tags(app) == []  # the old plugin is still in use by the open stream
            rest = list(lines)
            stream_ended = time.monotonic()
        assert "data: [DONE]" in rest
        text = "".join(
            orjson.loads(line[6:])["choices"][0]["delta"].get("content") or ""
            for line in rest
            if line.startswith("data: {")
        )
        assert text.endswith("worker.")
        deadline = time.monotonic() + 5
        while not closed_tags(app) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert [tag for tag, _ in closed_tags(app)] == ["old"]
        assert closed_tags(app)[0][1] >= stream_ended - 0.5


# -- the file watcher: a Kubernetes ConfigMap volume -----------------------------------------------


class ConfigMapDir:
    """Lays out a directory the way the kubelet does: ``config.yaml -> ..data/config.yaml``,
    ``..data -> ..<timestamp>``; an update writes a new timestamped dir and renames a new symlink over
    ``..data`` (atomic), then removes the old dir. File mtimes say nothing about the change."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.generation = 0

    def publish(self, text: str) -> None:
        self.generation += 1
        new = self.root / f"..2026_11_21_22_00_{self.generation:02d}.000000001"
        new.mkdir()
        (new / "config.yaml").write_text(text)
        os.utime(new / "config.yaml", (0, 0))  # identical mtimes across versions
        old = (self.root / "..data").resolve() if (self.root / "..data").exists() else None
        tmp = self.root / "..data_tmp"
        tmp.symlink_to(new.name)
        tmp.rename(self.root / "..data")
        link = self.root / "config.yaml"
        if not link.is_symlink():
            link.symlink_to("..data/config.yaml")
        if old is not None:
            for child in old.iterdir():
                child.unlink()
            old.rmdir()


@contextlib.contextmanager
def file_gateway(path: Path, **settings: Any) -> Iterator[ServerThread]:
    registry = PluginRegistry(dict(PLUGINS))
    app = create_app(
        Settings(config_path=path, admin_token=TOKEN, config_watch_s=0.1, **settings),
        registry=registry,
        engine_factory=None,
    )
    with ServerThread(app) as server:
        yield server


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_configmap_symlink_swap_is_picked_up(upstream: FakeUpstream, upstream_url: str, tmp_path: Path) -> None:
    mount = ConfigMapDir(tmp_path)
    mount.publish(yaml.safe_dump(tagged(upstream_url, "v1")))
    with file_gateway(tmp_path / "config.yaml") as server:
        serves_tag(server, "v1")
        first = live_version(server)

        mount.publish(yaml.safe_dump(tagged(upstream_url, "v2")))
        assert wait_for(lambda: live_version(server) != first)
        serves_tag(server, "v2")
        second = live_version(server)
        assert httpx.get(server.url + "/admin/config", headers=ADMIN).json()["source"] == "watch"

        # A broken update is refused; the running config stays; the next good one is picked up.
        mount.publish("models: [unclosed\n")
        time.sleep(0.5)
        assert live_version(server) == second
        serves_tag(server, "v2")
        mount.publish("# only a comment differs\n" + yaml.safe_dump(tagged(upstream_url, "v2")))
        time.sleep(0.5)
        assert live_version(server) == second  # same content, same version
        mount.publish(yaml.safe_dump(tagged(upstream_url, "v3")))
        assert wait_for(lambda: live_version(server) not in (first, second))
        serves_tag(server, "v3")


class LiveConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    tag: str = "a"
    fail: bool = False


class GoesLive(Plugin):
    """Records the configs that went live; ``fail`` makes its ``went_live`` raise."""

    name = "goes_live"
    Config = LiveConfig

    def went_live(self) -> None:
        self.services.shared.setdefault("went_live", []).append(self.config.tag)
        if self.config.fail:
            raise RuntimeError("broken")


def test_went_live_runs_once_per_config_that_goes_live_and_never_for_a_refused_one(
    gateway_factory: GatewayFactory, upstream_url: str
) -> None:
    def config(tag: str, fail: bool = False, after: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        plugins = [{"name": "goes_live", "config": {"tag": tag, "fail": fail}}, {"name": "routing"}, *(after or [])]
        return base_config([upstream_url], plugins=plugins)

    plugins: dict[str, type[Plugin]] = {**PLUGINS, "goes_live": GoesLive}
    with gateway_factory(config("a"), plugins=plugins, admin_token=TOKEN) as (app, server):
        went_live = app.state.services.shared.setdefault("went_live", [])
        assert went_live == ["a"]
        assert put(server, config("b")).status_code == 200
        assert put(server, config("b")).json()["changed"] is False  # the same config: no swap
        unreachable = [{"name": "needs_redis", "config": {"url": "redis://127.0.0.1:1/0"}}]
        assert put(server, config("c", after=unreachable)).status_code == 400  # started, then refused
        assert went_live == ["a", "b"]
        # A failure there is the plugin's: the swap is done, the config stays live.
        assert put(server, config("d", fail=True)).status_code == 200
        assert went_live == ["a", "b", "d"]
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


UNREACHABLE = {"name": "needs_redis", "config": {"url": "redis://127.0.0.1:1/0"}}


def test_a_config_refused_by_a_later_plugins_start_leaves_the_feeds_following_the_live_workers(
    gateway_factory: GatewayFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The refused config's routing started (and would follow no worker: least_outstanding) before the
    plugin after it failed: the live config's precise_prefix keeps its KV event streams and load polls."""

    async def any_tokenizer(*_: object) -> object:  # no model is needed: nothing is placed here
        return object()

    monkeypatch.setattr(precise_setup.PromptTokenizer, "load", any_tokenizer)
    with contextlib.ExitStack() as stack:
        fakes, servers, pubs = kv_workers(stack)
        urls = [s.url for s in servers]
        sources = kv_sources(servers, pubs)
        routing = {"default": {"policy": "precise_prefix", "precise": {"tokenizer": "/any", "block_size": 4}},
                   "kv_events": {"sources": sources, "load_interval_s": 0.1}}  # fmt: skip
        live = base_config(urls, plugins=[{"name": "routing", "config": routing}])
        app, server = stack.enter_context(gateway_factory(live, plugins=PLUGINS, admin_token=TOKEN))
        feed = app.state.services.workers.kv

        def delivered(pub: ThreadedPublisher, url: str) -> bool:
            """A batch published now reaches the feed (a socket just connected misses the first ones)."""
            received = feed.workers[url].received if url in feed.workers else 0
            pub.publish([])
            return wait_for(lambda: url in feed.workers and feed.workers[url].received > received, 0.5)

        for pub, url in zip(pubs, urls, strict=True):
            assert wait_for(lambda p=pub, u=url: delivered(p, u), 10)
        following = dict(feed.workers)

        refused = base_config(urls, plugins=[{"name": "routing"}, UNREACHABLE])  # least_outstanding: no feed
        reply = put(server, refused)
        assert reply.status_code == 400 and "plugins[1] (needs_redis): could not start" in reply.text
        assert app.state.holder.current.config.plugins[0].config == live["plugins"][0]["config"]
        # the same streams, never stopped: their state (and the index's entries) kept, and still applied
        assert feed.workers.keys() == following.keys()
        assert all(feed.workers[url] is following[url] for url in urls)
        assert all(feed.trusted(url) for url in urls)
        for pub, url in zip(pubs, urls, strict=True):
            assert delivered(pub, url)
        # and the load polls go on
        polls = [sum(1 for seen in f.requests if seen.path == "/metrics") for f in fakes]
        assert wait_for(lambda: all(sum(1 for seen in f.requests if seen.path == "/metrics") > n
                                    for f, n in zip(fakes, polls, strict=True)), 5)  # fmt: skip


def test_a_config_refused_by_a_later_plugins_start_keeps_the_live_tenancy_hooks(
    gateway_factory: GatewayFactory, upstream_url: str
) -> None:
    def config(tenant: str, after: list[dict[str, Any]]) -> dict[str, Any]:
        tenancy = {"name": "tenancy", "config": {"auth": False, "anonymous_tenant": tenant}}
        return base_config([upstream_url], plugins=[tenancy, {"name": "routing"}, *after])

    with gateway_factory(config("live", []), plugins=PLUGINS, admin_token=TOKEN) as (app, server):
        shared = app.state.services.shared
        tenant_of = shared[TENANT_OF]
        assert put(server, config("refused", [UNREACHABLE])).status_code == 400
        assert shared.get(TENANT_OF) == tenant_of  # not replaced by the refused one's, nor removed by its close
        assert put(server, config("next", [])).status_code == 200
        assert shared[TENANT_OF] == app.state.holder.current.pipeline.plugins[0].plugin.tenant_of != tenant_of


def test_a_config_refused_by_a_later_plugins_start_keeps_the_live_configs_discovered_workers(
    gateway_factory: GatewayFactory,
) -> None:
    answers = {NAME: ["127.0.0.1"], "other.svc": ["127.0.0.3"]}
    live, other = f"dns://{NAME}:8000", "dns://other.svc:8000"
    plugins: dict[str, type[Plugin]] = {**PLUGINS, "routing": scripted_routing(answers)}
    with gateway_factory(base_config([live]), plugins=plugins, admin_token=TOKEN) as (app, server):
        table = app.state.services.workers
        assert table.expand([live]) == ["http://127.0.0.1:8000"]
        assert put(server, base_config([other], plugins=[{"name": "routing"}, UNREACHABLE])).status_code == 400
        assert table.expand([live]) == ["http://127.0.0.1:8000"]  # the refused config's resolution forgot nothing
        assert put(server, base_config([other])).status_code == 200
        assert table.expand([live]) == [] and table.expand([other]) == ["http://127.0.0.3:8000"]  # once live
