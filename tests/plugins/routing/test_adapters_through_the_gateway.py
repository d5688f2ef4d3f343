"""LoRA adapters through the real gateway, on fake vLLM workers over loopback sockets that list, load and
unload adapters as vLLM does: placement by affinity, one load for concurrent first requests, LRU eviction,
a restarted worker noticed, load errors, failover of a cut stream, a reload that adds an adapter, an
adapter unloaded behind the gateway loaded again and the request retried there (and counted apart)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.pipeline.plugin import Plugin
from gateway.server.app import GatewayApp
from gateway.upstream.workers import Worker
from plugins.routing.telemetry import RoutingShared
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics

Fleet = list[tuple[FakeUpstream, ServerThread]]
ADMIN_TOKEN = "lora-admin"
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
CHAT = [{"role": "user", "content": "hi"}]
ADAPTERS = [{"name": n, "path": f"/adapters/{n}", "aliases": [f"{n}-v1"]} for n in ("sql", "support", "legal")]


@contextlib.contextmanager
def fleet(n: int) -> Iterator[Fleet]:
    with contextlib.ExitStack() as stack:
        out = []
        for i in range(n):
            fake = FakeUpstream(name=f"w{i}", lora=True)
            out.append((fake, stack.enter_context(ServerThread(fake))))
        yield out


def lora_config(workers: Fleet, max_loras: int = 2, **routing: Any) -> dict[str, Any]:
    config = base_config(
        [s.url for _, s in workers],
        plugins=[{"name": "routing", "config": {"adapters": {"sync_interval_s": 0.1}, **routing}}],
    )
    config["models"][0]["adapters"] = ADAPTERS
    config["models"][0]["lora"] = {"max_loras": max_loras, "max_lora_rank": 8}
    return config


def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def ask(server: ServerThread, model: str) -> str:
    reply = sdk(server).chat.completions.create(model=model, messages=CHAT, max_tokens=4)  # type: ignore[arg-type]
    return str(reply.choices[0].message.content)


def loads(fake: FakeUpstream) -> list[str]:
    return [body["lora_name"] for kind, body in fake.lora_calls if kind == "load"]


def worker(app: GatewayApp, server: ServerThread) -> Worker:
    return app.state.services.workers.get(server.url)


def test_a_first_request_loads_the_adapter_on_one_worker_and_the_next_ones_stay_there(
    gateway_factory: GatewayFactory,
) -> None:
    with fleet(2) as workers, gateway_factory(lora_config(workers)) as (_, gw):
        for model in ("sql", "sql-v1", "sql", "sql"):
            ask(gw, model)
        holders = [fake for fake, _ in workers if fake.adapters]
        assert len(holders) == 1 and holders[0].adapters == {"sql": "/adapters/sql"}
        assert sum(len(loads(fake)) for fake, _ in workers) == 1
        # every request reached the holder, under the adapter's served name (an alias is not sent upstream)
        assert [r.body["model"] for r in holders[0].requests] == ["sql"] * 4
        # the base model is still served by both workers, without a load
        for _ in range(4):
            ask(gw, "m1")
        assert all(any(r.body["model"] == "m1" for r in fake.requests) for fake, _ in workers)


def test_concurrent_first_requests_for_one_adapter_trigger_one_load(gateway_factory: GatewayFactory) -> None:
    with fleet(2) as workers, gateway_factory(lora_config(workers)) as (_, gw):
        release = threading.Event()
        for fake, _ in workers:
            fake.lora_hold = release
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(ask, gw, "sql") for _ in range(8)]
            wait_for(lambda: any(fake.lora_calls for fake, _ in workers), 10, "the first load")
            release.set()
            answers = [f.result(timeout=30) for f in futures]
        assert answers == ["Hello from the fake worker."] * 8
        assert [loads(fake) for fake, _ in workers] in (([["sql"], []]), ([[], ["sql"]]))
        holder = next(fake for fake, _ in workers if fake.adapters)
        assert len(holder.requests) == 8


def test_more_adapters_than_max_loras_evict_the_least_recently_used(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers, max_loras=2), admin_token=ADMIN_TOKEN) as (_, gw):
        fake = workers[0][0]
        for model in ("sql", "support", "sql", "legal"):  # support is the least recently used when legal comes
            ask(gw, model)
        assert fake.lora_calls == [
            ("load", {"lora_name": "sql", "lora_path": "/adapters/sql"}),
            ("load", {"lora_name": "support", "lora_path": "/adapters/support"}),
            ("unload", {"lora_name": "support"}),
            ("load", {"lora_name": "legal", "lora_path": "/adapters/legal"}),
        ]
        assert set(fake.adapters) == {"sql", "legal"}
        metrics = httpx.get(gw.url + "/metrics", headers=ADMIN).text
        assert 'gateway_adapter_evictions_total{adapter="support",reason="lru",worker=' in metrics
        assert 'gateway_adapter_loads_total{adapter="legal",outcome="ok",worker=' in metrics
        # the public page sums adapter names away
        public = httpx.get(gw.url + "/metrics").text
        assert "gateway_adapter_loads_total{outcome=" in public and 'adapter="legal"' not in public


def test_a_worker_that_lost_its_adapters_is_noticed_and_the_adapter_reloaded_on_demand(
    gateway_factory: GatewayFactory,
) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers)) as (app, gw):
        fake, server = workers[0]
        ask(gw, "sql")
        wait_for(lambda: "sql" in worker(app, server).adapters.held, 5, "the gateway to hold sql")
        fake.adapters.clear()  # a restart: run-time adapters are gone, the worker still answers
        wait_for(lambda: "sql" not in worker(app, server).adapters.held, 5, "the sync to notice")
        ask(gw, "sql")
        assert loads(fake) == ["sql", "sql"]
        # a restart seen by the health checks (down, then up without adapters) is noticed as well
        fake.healthy = False
        wait_for(lambda: not worker(app, server).healthy, 5, "the worker to be seen down")
        fake.adapters.clear()
        fake.healthy = True
        wait_for(lambda: worker(app, server).available(), 5, "the worker to be back")
        ask(gw, "sql")
        assert loads(fake) == ["sql", "sql", "sql"]


def test_adapters_loaded_elsewhere_are_learnt_from_the_worker(gateway_factory: GatewayFactory) -> None:
    with fleet(2) as workers, gateway_factory(lora_config(workers)) as (app, gw):
        (_, _), (fake1, server1) = workers
        fake1.adapters["support"] = "/adapters/support"  # loaded by another gateway replica
        wait_for(lambda: "support" in worker(app, server1).adapters.held, 5, "the sync to learn it")
        ask(gw, "support")
        assert sum(len(loads(fake)) for fake, _ in workers) == 0
        assert [r.body["model"] for r in fake1.requests] == ["support"]


def test_an_adapter_a_worker_holds_from_another_path_is_loaded_again_from_the_configured_one(
    gateway_factory: GatewayFactory,
) -> None:
    """A gateway started with a config whose adapter has a new path, beside workers that kept it from an
    earlier run with the old one: the worker's list says where it came from, and the first request there
    loads the configured weights in place."""
    with fleet(1) as workers:
        fake, server = workers[0]
        fake.adapters["sql"] = "/adapters/sql-old"
        with gateway_factory(lora_config(workers)) as (app, gw):
            wait_for(lambda: "sql" in worker(app, server).adapters.held, 5, "the sync to learn it")
            ask(gw, "sql")
            assert fake.adapters == {"sql": "/adapters/sql"}
            assert loads(fake) == ["sql"]
            ask(gw, "sql")
            assert loads(fake) == ["sql"]


def test_load_errors_are_clear_openai_errors(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers)) as (_, gw):
        fake, server = workers[0]
        fake.lora_missing.add("/adapters/sql")
        with pytest.raises(openai.APIStatusError) as caught:
            ask(gw, "sql")
        assert caught.value.status_code == 502
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "adapter_load_failed"
        assert "check the adapter's path" in error["message"] and fake.requests == []
        assert server.url not in error["message"]  # worker addresses are for the operator's logs, not clients
        fake.lora = False  # a worker started without run-time adapter loading: no such route
        reply = httpx.post(gw.url + "/v1/chat/completions", json={"model": "support", "messages": CHAT})
        assert reply.status_code == 502
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in reply.json()["error"]["message"]
        assert server.url not in reply.text
        assert set(reply.json()["error"]) == {"message", "type", "param", "code"}


def test_a_stream_cut_midway_continues_on_a_worker_that_loads_the_same_adapter(
    gateway_factory: GatewayFactory,
) -> None:
    with fleet(2) as workers, gateway_factory(lora_config(workers)) as (app, gw):
        (fake0, server0), (fake1, _) = workers
        fake0.adapters["sql"] = "/adapters/sql"
        wait_for(lambda: "sql" in worker(app, server0).adapters.held, 5, "the sync to learn it")
        fake0.behavior.chunks = 6
        fake0.behavior.die_after = 2
        fake1.behavior.chunks = 6
        stream = sdk(gw).chat.completions.create(model="sql", messages=CHAT, max_tokens=16, stream=True)  # type: ignore[arg-type]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text  # one answer, continued
        assert loads(fake1) == ["sql"]
        assert [r.body["model"] for r in fake1.requests] == ["sql"]


def test_a_reload_adds_an_adapter_without_touching_the_workers(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers), admin_token=ADMIN_TOKEN) as (_, gw):
        config = lora_config(workers)
        config["models"][0]["adapters"] = [*ADAPTERS, {"name": "fresh", "path": "/adapters/fresh"}]
        with pytest.raises(openai.NotFoundError):
            ask(gw, "fresh")
        reply = httpx.put(gw.url + "/admin/config", headers=ADMIN, content=orjson.dumps(config), timeout=10)
        assert reply.status_code == 200, reply.text
        ask(gw, "fresh")
        assert loads(workers[0][0]) == ["fresh"]


def test_a_reload_that_gives_an_adapter_a_new_path_loads_the_new_weights(gateway_factory: GatewayFactory) -> None:
    """docs/adapters.md: to change an adapter's weights, give it a new path. A worker that holds the
    adapter from its old path must load it again, in place, from the new one before it serves it."""
    with fleet(1) as workers, gateway_factory(lora_config(workers), admin_token=ADMIN_TOKEN) as (_, gw):
        fake = workers[0][0]
        ask(gw, "sql")
        assert fake.adapters == {"sql": "/adapters/sql"}
        config = lora_config(workers)
        config["models"][0]["adapters"] = [{"name": "sql", "path": "/adapters/sql-v2"}, *ADAPTERS[1:]]
        reply = httpx.put(gw.url + "/admin/config", headers=ADMIN, content=orjson.dumps(config), timeout=10)
        assert reply.status_code == 200, reply.text
        ask(gw, "sql")
        assert fake.adapters == {"sql": "/adapters/sql-v2"}
        assert fake.lora_calls[-1] == (
            "load", {"lora_name": "sql", "lora_path": "/adapters/sql-v2", "load_inplace": True}
        )  # fmt: skip
        ask(gw, "sql")  # held from the new path now: no further load
        assert loads(fake) == ["sql", "sql"]


def admin(gw: ServerThread, action: str, **body: str) -> httpx.Response:
    return httpx.post(f"{gw.url}/admin/plugins/routing/{action}", headers=ADMIN, json=body, timeout=10)


def test_operators_pin_unload_and_see_adapters_per_worker(gateway_factory: GatewayFactory) -> None:
    with fleet(2) as workers, gateway_factory(lora_config(workers, max_loras=2), admin_token=ADMIN_TOKEN) as (_, gw):
        (fake0, server0), (fake1, server1) = workers
        pinned = admin(gw, "pin_adapter", adapter="sql-v1", worker=server1.url)
        assert pinned.status_code == 200, pinned.text
        assert pinned.json()["result"]["adapters"][0] | {"idle_s": None} == {
            "name": "sql", "state": "held", "pinned": True, "in_use": 0, "idle_s": None,
        }  # fmt: skip
        assert loads(fake1) == ["sql"] and loads(fake0) == []
        # a pinned adapter stays when the worker must make room for others
        fake0.healthy = False  # every request below goes to worker 1
        wait_for(lambda: not any(w["healthy"] for w in _rows(gw) if w["url"] == server0.url), 5, "w0 down")
        for model in ("support", "legal"):
            ask(gw, model)
        assert "sql" in fake1.adapters and set(fake1.adapters) == {"sql", "legal"}
        view = {w["url"]: w for w in _rows(gw)}[server1.url]["adapters"]
        assert {a["name"]: a["pinned"] for a in view} == {"sql": True, "legal": False}
        overview = admin(gw, "adapters").json()["result"]["workers"]
        assert {w["url"] for w in overview} == {server0.url, server1.url}
        # unloaded by the operator, pinned or not
        assert admin(gw, "unload_adapter", adapter="sql", worker=server1.url).status_code == 200
        assert "sql" not in fake1.adapters and ("unload", {"lora_name": "sql"}) in fake1.lora_calls
        # mistakes are named; a client key is not an admin
        assert admin(gw, "pin_adapter", adapter="nope", worker=server1.url).json()["error"]["code"] == (
            "adapter_not_found"
        )
        assert admin(gw, "pin_adapter", adapter="sql", worker="http://elsewhere:1").json()["error"]["param"] == "worker"
        anonymous = httpx.post(f"{gw.url}/admin/plugins/routing/unload_adapter", json={})
        assert anonymous.status_code in (401, 403)


def _rows(gw: ServerThread) -> list[dict[str, Any]]:
    models = httpx.get(gw.url + "/admin/workers", headers=ADMIN).json()["models"]
    return [row for model in models for row in model["workers"]]


def test_requests_waiting_on_a_load_keep_their_adapter_from_the_next_load(gateway_factory: GatewayFactory) -> None:
    """Two requests wait for sql's load while a request for support waits for the worker's lock behind
    it (one slot). When sql lands, the support load runs before the waiters resume: it must see sql in
    use and load beside it, not evict it and leave the waiters to the worker's 404."""
    with fleet(1) as workers, gateway_factory(lora_config(workers, max_loras=1)) as (app, gw):
        fake, server = workers[0]
        release = threading.Event()
        fake.lora_hold = release
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(ask, gw, "sql")]
            wait_for(lambda: loads(fake) == ["sql"], 10, "sql's load to reach the worker")
            first.append(pool.submit(ask, gw, "sql"))
            wait_for(lambda: worker(app, server).adapters.active.get("sql") == 2, 10, "both sql requests waiting")
            other = pool.submit(ask, gw, "support")
            wait_for(lambda: ("support", "loading") in _states(app, server), 10, "support's load to be queued")
            release.set()
            assert [f.result(timeout=30) for f in first] == ["Hello from the fake worker."] * 2
            assert other.result(timeout=30)
        assert ("unload", {"lora_name": "sql"}) not in fake.lora_calls
        assert sorted(fake.adapters) == ["sql", "support"]  # over max_loras while both were busy


def _states(app: GatewayApp, server: ServerThread) -> list[tuple[str, str]]:
    return [(str(a["name"]), str(a["state"])) for a in worker(app, server).adapters.describe(0.0)]


def test_an_adapter_in_use_is_neither_evicted_nor_unloaded(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers, max_loras=1), admin_token=ADMIN_TOKEN) as (_, gw):
        fake, server = workers[0]
        hold = threading.Event()
        fake.behavior.hold = hold
        with ThreadPoolExecutor(2) as pool:
            busy = pool.submit(ask, gw, "sql")
            wait_for(lambda: len(fake.requests) == 1, 10, "the sql request to reach the worker")
            refused = admin(gw, "unload_adapter", adapter="sql", worker=server.url)
            assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_in_use"
            other = pool.submit(ask, gw, "support")  # no room, and sql is busy: loaded beside it
            wait_for(lambda: "support" in fake.adapters, 10, "support to be loaded")
            assert "sql" in fake.adapters
            hold.set()
            assert busy.result(timeout=30) and other.result(timeout=30)
        assert ("unload", {"lora_name": "sql"}) not in fake.lora_calls


def test_an_unload_waiting_for_the_workers_lock_spares_a_request_that_began_meanwhile(
    gateway_factory: GatewayFactory,
) -> None:
    """The operator's unload waits for a load running on the worker; a request for the adapter that starts
    meanwhile finds it held and goes to the worker. The unload must then see it in use (409), not pull the
    adapter from under that request."""
    with fleet(1) as workers, gateway_factory(lora_config(workers), admin_token=ADMIN_TOKEN) as (app, gw):
        fake, server = workers[0]
        ask(gw, "sql")
        lock = RoutingShared.of(app.state.services).loader(60.0).lock(server.url)
        loading, hold = threading.Event(), threading.Event()
        fake.lora_hold = loading
        with ThreadPoolExecutor(3) as pool:
            other = pool.submit(ask, gw, "support")  # its load holds the worker's lock
            wait_for(lambda: loads(fake) == ["sql", "support"], 10, "support's load to reach the worker")
            unload = pool.submit(admin, gw, "unload_adapter", adapter="sql", worker=server.url)
            wait_for(lambda: len(getattr(lock, "_waiters", None) or ()) == 1, 10, "the unload to wait for the lock")
            fake.behavior.hold = hold
            busy = pool.submit(ask, gw, "sql")
            wait_for(lambda: len(fake.requests) == 2, 10, "the sql request to reach the worker")
            loading.set()
            refused = unload.result(timeout=30)
            hold.set()
            assert busy.result(timeout=30) and other.result(timeout=30)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "adapter_in_use"
        assert ("unload", {"lora_name": "sql"}) not in fake.lora_calls and "sql" in fake.adapters


def test_an_adapter_pinned_while_a_load_waits_for_the_worker_is_not_evicted_by_that_load(
    gateway_factory: GatewayFactory,
) -> None:
    """pin_adapter loads sql (one slot) while a request for support waits for the worker's lock behind that
    load. When sql lands, the support load runs before the pin resumes: it must find sql pinned already
    and load beside it, not evict it and leave the operator a pin on an adapter the worker dropped."""
    with fleet(1) as workers, gateway_factory(lora_config(workers, max_loras=1), admin_token=ADMIN_TOKEN) as (app, gw):
        fake, server = workers[0]
        release = threading.Event()
        fake.lora_hold = release
        with ThreadPoolExecutor(2) as pool:
            pin = pool.submit(admin, gw, "pin_adapter", adapter="sql", worker=server.url)
            wait_for(lambda: loads(fake) == ["sql"], 10, "sql's load to reach the worker")
            other = pool.submit(ask, gw, "support")
            wait_for(lambda: ("support", "loading") in _states(app, server), 10, "support's load to be queued")
            release.set()
            assert pin.result(timeout=30).status_code == 200
            assert other.result(timeout=30)
        assert ("unload", {"lora_name": "sql"}) not in fake.lora_calls
        assert sorted(fake.adapters) == ["sql", "support"]
        assert ("sql", "held") in _states(app, server) and "sql" in worker(app, server).adapters.pinned


def test_a_reload_that_removes_a_pinned_adapter_drops_its_pin(gateway_factory: GatewayFactory) -> None:
    """An operator pins sql (one slot); a reload removes sql from the config. The pin must go with it: the
    next adapter's load evicts sql as any adapter nobody uses, instead of loading beside it for good."""
    with fleet(1) as workers, gateway_factory(lora_config(workers, max_loras=1), admin_token=ADMIN_TOKEN) as (app, gw):
        fake, server = workers[0]
        assert admin(gw, "pin_adapter", adapter="sql", worker=server.url).status_code == 200
        config = lora_config(workers, max_loras=1)
        config["models"][0]["adapters"] = ADAPTERS[1:]
        reply = httpx.put(gw.url + "/admin/config", headers=ADMIN, content=orjson.dumps(config), timeout=10)
        assert reply.status_code == 200, reply.text
        view = {w["url"]: w for w in _rows(gw)}[server.url]["adapters"]
        assert {a["name"]: a["pinned"] for a in view} == {"sql": False}
        ask(gw, "support")
        assert fake.lora_calls[-2:] == [
            ("unload", {"lora_name": "sql"}),
            ("load", {"lora_name": "support", "lora_path": "/adapters/support"}),
        ]
        assert fake.adapters == {"support": "/adapters/support"}
        assert worker(app, server).adapters.pinned == set()


def test_a_reload_that_keeps_a_pinned_adapter_keeps_its_pin(gateway_factory: GatewayFactory) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers, max_loras=1), admin_token=ADMIN_TOKEN) as (app, gw):
        fake, server = workers[0]
        assert admin(gw, "pin_adapter", adapter="sql", worker=server.url).status_code == 200
        config = lora_config(workers, max_loras=1)
        config["models"][0]["adapters"] = [*ADAPTERS, {"name": "fresh", "path": "/adapters/fresh"}]
        reply = httpx.put(gw.url + "/admin/config", headers=ADMIN, content=orjson.dumps(config), timeout=10)
        assert reply.status_code == 200, reply.text
        ask(gw, "support")  # no room, sql pinned: loaded beside it
        assert ("unload", {"lora_name": "sql"}) not in fake.lora_calls
        assert sorted(fake.adapters) == ["sql", "support"]
        assert worker(app, server).adapters.pinned == {"sql"}


class RefusesToStart(Plugin):
    """A plugin after routing whose start fails: the config is refused once routing has started."""

    async def start(self) -> None:
        raise RuntimeError("not today")


def test_a_refused_reload_leaves_the_pins_of_the_live_config(gateway_factory: GatewayFactory) -> None:
    with (
        fleet(1) as workers,
        gateway_factory(
            lora_config(workers, max_loras=1), plugins={"refuses": RefusesToStart}, admin_token=ADMIN_TOKEN
        ) as (app, gw),
    ):
        fake, server = workers[0]
        assert admin(gw, "pin_adapter", adapter="sql", worker=server.url).status_code == 200
        config = lora_config(workers, max_loras=1)
        config["models"][0]["adapters"] = ADAPTERS[1:]
        config["plugins"].append({"name": "refuses"})
        reply = httpx.put(gw.url + "/admin/config", headers=ADMIN, content=orjson.dumps(config), timeout=10)
        assert reply.status_code == 400 and "could not start" in reply.text
        assert worker(app, server).adapters.pinned == {"sql"}
        ask(gw, "support")  # the live config still pins sql: loaded beside it
        assert ("unload", {"lora_name": "sql"}) not in fake.lora_calls


def test_operators_unload_adapters_a_reload_left_on_the_workers(gateway_factory: GatewayFactory) -> None:
    """A reload takes every adapter off the model: the worker still holds the two it loaded, and the
    operator can let go of them by the name the worker lists, though the live config names neither."""
    with fleet(1) as workers, gateway_factory(lora_config(workers), admin_token=ADMIN_TOKEN) as (app, gw):
        fake, server = workers[0]
        assert admin(gw, "pin_adapter", adapter="sql", worker=server.url).status_code == 200
        ask(gw, "support")
        config = lora_config(workers)
        del config["models"][0]["adapters"], config["models"][0]["lora"]
        reply = httpx.put(gw.url + "/admin/config", headers=ADMIN, content=orjson.dumps(config), timeout=10)
        assert reply.status_code == 200, reply.text
        assert admin(gw, "unpin_adapter", adapter="sql", worker=server.url).status_code == 200
        unloaded = admin(gw, "unload_adapter", adapter="sql", worker=server.url)
        assert unloaded.status_code == 200, unloaded.text
        assert [a["name"] for a in unloaded.json()["result"]["adapters"]] == ["support"]
        assert admin(gw, "unload_adapter", adapter="support", worker=server.url + "/").status_code == 200
        assert fake.adapters == {} and worker(app, server).adapters.held == {}
        assert [call for call in fake.lora_calls if call[0] == "unload"] == [
            ("unload", {"lora_name": "sql"}),
            ("unload", {"lora_name": "support"}),
        ]
        # gone now, and never loadable without a config: named as before
        for action in ("unload_adapter", "pin_adapter"):
            refused = admin(gw, action, adapter="sql", worker=server.url)
            assert refused.status_code == 404 and refused.json()["error"]["code"] == "adapter_not_found"


def two_models(refs: list[str], m1_lora: dict[str, int] | None, **extra: Any) -> dict[str, Any]:
    """m1 serves sql, m2 support and legal, both on the workers ``refs``; m2 keeps at most 2 adapters."""
    config = base_config(refs, plugins=[{"name": "routing", "config": {"adapters": {"sync_interval_s": 0.1}}}])
    config["models"] = [
        {"name": "m1", "workers": refs, "adapters": ADAPTERS[:1], **({"lora": m1_lora} if m1_lora else {})},
        {"name": "m2", "workers": refs, "lora": {"max_loras": 2}, "adapters": ADAPTERS[1:]},
    ]
    return {**config, **extra}


def test_a_worker_shared_by_two_models_is_counted_with_its_own_adapter_slots(gateway_factory: GatewayFactory) -> None:
    """m1 (max_loras 1) and m2 (max_loras 2) share one worker, which runs with the larger of the two
    (docs/adapters.md: 2 slots). Loading m1's adapter beside m2's must not evict m2's: the worker has room
    for both. A third adapter then evicts the least recently used, as on any worker with two slots."""
    with fleet(1) as workers:
        fake, server = workers[0]
        with gateway_factory(two_models([server.url], {"max_loras": 1})) as (_, gw):
            ask(gw, "support")
            ask(gw, "sql")
            assert loads(fake) == ["support", "sql"] and sorted(fake.adapters) == ["sql", "support"]
            ask(gw, "legal")
            assert fake.lora_calls[-2:] == [
                ("unload", {"lora_name": "support"}),
                ("load", {"lora_name": "legal", "lora_path": "/adapters/legal"}),
            ]
            assert sorted(fake.adapters) == ["legal", "sql"]


def test_a_managed_workers_own_lora_settings_bound_its_adapters(gateway_factory: GatewayFactory) -> None:
    """A managed worker's own ``lora:`` is what it is started with (--max-loras 1 here), whatever its
    models ask for (m2: 2): a second adapter must evict the first rather than be loaded past the worker's
    slot."""
    with fleet(1) as workers:
        fake, server = workers[0]
        port = int(server.url.rsplit(":", 1)[1])
        spec = {"name": "w0", "model": "smollm2", "port": port, "lora": {"max_loras": 1, "max_lora_rank": 8}}
        with gateway_factory(two_models(["w0"], None, engine={"workers": [spec]})) as (_, gw):
            ask(gw, "support")
            ask(gw, "legal")
            assert fake.lora_calls == [
                ("load", {"lora_name": "support", "lora_path": "/adapters/support"}),
                ("unload", {"lora_name": "support"}),
                ("load", {"lora_name": "legal", "lora_path": "/adapters/legal"}),
            ]
            assert fake.adapters == {"legal": "/adapters/legal"}


# -- an adapter evicted behind this gateway's back (another replica, an operator at the worker) ----------

#: Reads of the workers' adapter lists far apart: what a gateway believes stays stale for the whole test.
STALE = {"adapters": {"sync_interval_s": 60}}


def evict_at_the_worker(server: ServerThread, name: str) -> None:
    """What another gateway replica does to make room: unload ``name`` on the worker itself."""
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": name}).status_code == 200


def test_an_adapter_another_gateway_evicted_is_loaded_again_instead_of_a_404(gateway_factory: GatewayFactory) -> None:
    """Two replicas share one worker (one adapter slot). A evicts sql to load support; B still believes
    the worker holds sql: its request gets the worker's 404, and B must load sql again and retry there
    instead of passing the 404 on."""
    with fleet(1) as workers:
        fake, server = workers[0]
        config = lora_config(workers, max_loras=1, **STALE)
        with gateway_factory(config) as (_, gw_a), gateway_factory(config) as (app_b, gw_b):
            ask(gw_a, "sql")
            ask(gw_b, "sql")  # B's load finds sql there: held
            ask(gw_a, "support")  # A's only slot: sql evicted
            assert fake.lora_calls[-2:] == [
                ("unload", {"lora_name": "sql"}),
                ("load", {"lora_name": "support", "lora_path": "/adapters/support"}),
            ]
            assert "sql" in worker(app_b, server).adapters.held  # B has not read the worker's list since
            assert ask(gw_b, "sql") == "Hello from the fake worker."
            assert loads(fake) == ["sql", "sql", "support", "sql"]
            # the request that found sql gone, then the same request once sql was back
            assert [r.body["model"] for r in fake.requests] == ["sql", "sql", "support", "sql", "sql"]
            assert "sql" in fake.adapters
            ask(gw_b, "sql")  # held again: no further load
            assert loads(fake) == ["sql", "sql", "support", "sql"]


def samples(server: ServerThread, name: str) -> dict[str, float]:
    """The admin view's samples of ``name``: label set (as /metrics writes it) -> value."""
    found = {}
    for line in admin_metrics(server).splitlines():
        if line.startswith(name + "{"):
            labels, value = line[len(name) :].rsplit(" ", 1)
            found[labels] = float(value)
    return found


def test_a_retry_on_the_same_worker_after_loading_its_adapter_again_is_counted_by_worker_and_adapter(
    gateway_factory: GatewayFactory,
) -> None:
    """gateway_upstream_retries says workers fail (a request retried on another worker); a request tried
    once more on its own worker, after loading there again the adapter another replica unloaded, is
    gateway_adapter_retries, so an operator tells the two apart and sees which adapter churns where."""
    with fleet(2) as workers, gateway_factory(lora_config(workers, **STALE)) as (_, gw):
        ask(gw, "sql")
        fake, server = next((f, s) for f, s in workers if "sql" in f.adapters)
        evict_at_the_worker(server, "sql")
        assert ask(gw, "sql") == "Hello from the fake worker."
        assert loads(fake) == ["sql", "sql"] and [r.body["model"] for r in fake.requests] == ["sql"] * 3
        assert ask(gw, "sql")  # held again: no retry
        assert samples(gw, "gateway_adapter_retries_total") == {f'{{adapter="sql",worker="{server.url}"}}': 1.0}
        assert samples(gw, "gateway_upstream_retries_total") == {}  # no worker failed


#: sql admits one request at a time: a request tried twice on its worker must still hold exactly one slot.
ONE_AT_A_TIME = {"models": {"sql": {"admission": {"max_in_flight": 1}}}}


def in_flight(app: GatewayApp, model: str) -> int:
    return RoutingShared.of(app.state.services).gates[model].in_flight


def test_a_stream_for_an_adapter_evicted_behind_the_gateway_is_served_after_a_load(
    gateway_factory: GatewayFactory,
) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers, **STALE, **ONE_AT_A_TIME)) as (app, gw):
        fake, server = workers[0]
        ask(gw, "sql")
        evict_at_the_worker(server, "sql")
        stream = sdk(gw).chat.completions.create(model="sql", messages=CHAT, max_tokens=16, stream=True)  # type: ignore[arg-type]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text == "Hello from the fake worker."
        assert loads(fake) == ["sql", "sql"]
        assert [(r.body["model"], bool(r.body.get("stream"))) for r in fake.requests] == [
            ("sql", False), ("sql", True), ("sql", True)
        ]  # fmt: skip
        wait_for(lambda: in_flight(app, "sql") == 0, 5, "the stream's admission slot to be released")
        assert ask(gw, "sql")  # and the next request is admitted


def test_an_evicted_adapter_the_worker_refuses_to_load_again_is_the_loaders_error(
    gateway_factory: GatewayFactory,
) -> None:
    with fleet(1) as workers, gateway_factory(lora_config(workers, **STALE, **ONE_AT_A_TIME)) as (app, gw):
        fake, server = workers[0]
        ask(gw, "sql")
        evict_at_the_worker(server, "sql")
        fake.lora_missing.add("/adapters/sql")  # and its files are gone from the worker's disk
        with pytest.raises(openai.APIStatusError) as caught:
            ask(gw, "sql")
        assert caught.value.status_code == 502
        error = caught.value.body
        assert isinstance(error, dict) and error["code"] == "adapter_load_failed"
        assert "check the adapter's path" in error["message"]
        assert loads(fake) == ["sql", "sql"]  # one load again, one retry at most
        assert len(fake.requests) == 2
        assert in_flight(app, "sql") == 0


class LoadsButForgets(FakeUpstream):
    """A worker whose loads succeed but that still knows no adapter: a gateway must not retry forever."""

    async def _lora_route(self, path: str, body: dict[str, Any], send: Any) -> None:
        await super()._lora_route(path, body, send)
        self.adapters.clear()


def test_a_worker_that_still_lacks_the_adapter_after_a_load_again_gets_one_retry_only(
    gateway_factory: GatewayFactory,
) -> None:
    fake = LoadsButForgets(name="w0", lora=True)
    with ServerThread(fake) as server, gateway_factory(lora_config([(fake, server)], **STALE)) as (_, gw):
        reply = httpx.post(gw.url + "/v1/chat/completions", json={"model": "sql", "messages": CHAT})
        assert reply.status_code == 404
        assert reply.json()["error"]["message"] == "The model `sql` does not exist."
        # the first load, the request, the load again, the request again: then the worker's answer
        assert loads(fake) == ["sql", "sql"]
        assert [r.body["model"] for r in fake.requests] == ["sql", "sql"]


def test_a_404_that_is_not_a_missing_adapter_reaches_the_client_unchanged(gateway_factory: GatewayFactory) -> None:
    """Only the worker's own "model does not exist" for an adapter it was believed to hold is stale state:
    a base model the worker does not serve, another 404 for an adapter, and a model the gateway does not
    know are answered as before, with no load and no retry."""
    with fleet(1) as workers, gateway_factory(lora_config(workers, **STALE)) as (_, gw):
        fake, _ = workers[0]
        fake.base_model = "other"  # a worker serving another base model than the config says
        reply = httpx.post(gw.url + "/v1/chat/completions", json={"model": "m1", "messages": CHAT})
        assert reply.status_code == 404
        assert reply.json()["error"]["message"] == "The model `m1` does not exist."
        assert len(fake.requests) == 1 and fake.lora_calls == []
        fake.base_model = "m1"
        ask(gw, "sql")
        fake.behavior.status = 404  # the worker's 404 for something else than the model
        reply = httpx.post(gw.url + "/v1/chat/completions", json={"model": "sql", "messages": CHAT})
        assert reply.status_code == 404 and reply.json()["error"]["message"] == "fake failure 404"
        assert len(fake.requests) == 3 and loads(fake) == ["sql"]
        unknown = httpx.post(gw.url + "/v1/chat/completions", json={"model": "nope", "messages": CHAT})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        assert len(fake.requests) == 3 and loads(fake) == ["sql"]
