"""The bound on the adapter loads one tenant causes (``adapters.tenant_loads_per_minute``), through the real
gateway on the fake LoRA workers: a tenant asking for more adapters than the workers hold is refused past
its bound instead of evicting the others' adapters, a request past it goes to a worker that holds its
adapter, the bucket refills, later attempts of a request (a cut stream's continuation, the retry after a
worker's 404) load whatever the bucket says, and without a bound every load happens as before."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.server.app import GatewayApp
from plugins.routing.telemetry import RoutingShared
from plugins.tenancy.keys import hash_key
from tests.plugins.routing.test_adapters_through_the_gateway import (
    ADAPTERS,
    CHAT,
    STALE,
    Fleet,
    ask,
    evict_at_the_worker,
    fleet,
    loads,
    lora_config,
    sdk,
    worker,
)
from tests.support.clock import Clock
from tests.support.fakes import ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory
from tests.support.metrics import admin_metrics
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

KEYS = {"a": "sk-gw-loads-a", "b": "sk-gw-loads-b"}


def bounded(workers: Fleet, per_minute: int | None, max_loras: int = 2, **routing: Any) -> dict[str, Any]:
    config = lora_config(workers, max_loras=max_loras, **routing)
    routing = config["plugins"][0]["config"]
    routing["adapters"] = {**routing["adapters"], "tenant_loads_per_minute": per_minute}  # not STALE's own dict
    config["models"][0]["adapters"] = [*ADAPTERS, {"name": "docs", "path": "/adapters/docs"}]
    return config


def with_tenants(config: dict[str, Any], prefix: str) -> dict[str, Any]:
    keys = [{"id": f"k-{t}", "tenant": t, "hash": hash_key(key, PEPPER.encode())} for t, key in KEYS.items()]
    config["plugins"].insert(0, {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}})
    return config


def clocked(app: GatewayApp) -> Clock:
    clock = Clock()
    RoutingShared.of(app.state.services).tenant_loads.clock = clock
    return clock


def post(gw: ServerThread, model: str, tenant: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {KEYS[tenant]}"} if tenant else {}
    body = {"model": model, "messages": CHAT, "max_tokens": 4}
    return httpx.post(gw.url + "/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_a_tenant_past_its_bound_is_refused_instead_of_evicting_another_tenants_adapter(
    gateway_factory: GatewayFactory, prefix: str
) -> None:
    """One worker, two slots. B keeps using support; A asks for sql, legal and docs in turn. A's two loads
    are served (the second evicts A's own sql, support being used); past them A's requests for adapters
    not loaded are 429s that reach no worker, its request for the one loaded is served, and B's support is
    neither evicted nor loaded again."""
    with fleet(1) as workers, gateway_factory(with_tenants(bounded(workers, 2), prefix)) as (app, gw):
        fake = workers[0][0]
        clocked(app)
        assert post(gw, "support", "b").status_code == 200
        codes: dict[str, list[int]] = {"a": [], "b": []}
        for model in ("sql", "legal", "docs", "sql", "legal", "docs"):
            codes["a"].append(post(gw, model, "a").status_code)
            codes["b"].append(post(gw, "support", "b").status_code)
        assert codes == {"a": [200, 200, 429, 429, 200, 429], "b": [200] * 6}
        assert loads(fake) == ["support", "sql", "legal"]
        assert [kind for kind, body in fake.lora_calls if kind == "unload"] == ["unload"]  # sql, A's own
        assert set(fake.adapters) == {"support", "legal"}
        refused = [r.body["model"] for r in fake.requests if r.body["model"] in ("docs", "sql")]
        assert refused == ["sql"]  # the 429s reached no worker
        assert 'gateway_routing_rejected_total{model="docs",reason="adapter_load_rate"} 2.0' in admin_metrics(gw)


def test_the_refusal_is_an_openai_429_with_the_seconds_until_the_next_token_and_the_bucket_refills(
    gateway_factory: GatewayFactory,
) -> None:
    with fleet(1) as workers, gateway_factory(bounded(workers, 2, max_loras=1)) as (app, gw):
        fake = workers[0][0]
        clock = clocked(app)
        assert [post(gw, m).status_code for m in ("sql", "support")] == [200, 200]  # no tenancy: one bucket
        refused = post(gw, "legal")
        assert refused.status_code == 429 and refused.headers["retry-after"] == "30"  # 2 a minute: 30 s each
        error = refused.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        assert error["type"] == "rate_limit_error" and error["code"] == "adapter_load_rate_exceeded"
        assert "(at most 2 a minute on this gateway)" in error["message"] and "Retry after 30 s" in error["message"]
        clock.now += 15  # half a token
        assert post(gw, "legal").headers["retry-after"] == "15"
        clock.now += 15
        assert post(gw, "legal").status_code == 200
        assert loads(fake) == ["sql", "support", "legal"]
        with pytest.raises(openai.RateLimitError):  # the SDK sees the same refusal
            ask(gw, "sql")


def test_past_the_bound_a_request_goes_to_an_overloaded_worker_that_holds_its_adapter(
    gateway_factory: GatewayFactory,
) -> None:
    """Bounded loads would spill sql from its busy holder to the idle worker (a load there); past the
    tenant's bound it stays on the holder. With a token again, it spills as before."""
    tight = {"default": {"load_factor": 1.0, "load_slack": 0}}
    with fleet(2) as workers, gateway_factory(bounded(workers, 1, **tight)) as (app, gw):
        (fake0, server0), (fake1, _) = workers
        clock = clocked(app)
        fake0.adapters["sql"] = "/adapters/sql"  # learnt from the worker: no load of this gateway's
        wait_for(lambda: "sql" in worker(app, server0).adapters.held, 5, "the sync to learn it")
        assert post(gw, "support").status_code == 200  # the one token
        support_loads = loads(fake0) + loads(fake1)
        hold = threading.Event()
        fake0.behavior.hold = hold
        with ThreadPoolExecutor(3) as pool:
            busy = pool.submit(post, gw, "sql")
            wait_for(lambda: len([r for r in fake0.requests if r.body["model"] == "sql"]) == 1, 10, "sql at w0")
            over = pool.submit(post, gw, "sql")  # w0 is over its load cap, and no token is left
            wait_for(lambda: len([r for r in fake0.requests if r.body["model"] == "sql"]) == 2, 10, "at w0 too")
            assert loads(fake1) + loads(fake0) == support_loads
            clock.now += 60
            spilled = pool.submit(post, gw, "sql")
            wait_for(lambda: "sql" in loads(fake1), 10, "sql to be loaded on w1")
            hold.set()
            assert [f.result(timeout=30).status_code for f in (busy, over, spilled)] == [200] * 3


def test_a_stream_cut_midway_is_continued_on_a_worker_that_loads_its_adapter_past_the_bound(
    gateway_factory: GatewayFactory,
) -> None:
    """Only a request's first attempt is charged: the continuation of a stream the client is already
    reading loads the adapter on the other worker though the bucket is empty."""
    with fleet(2) as workers, gateway_factory(bounded(workers, 1)) as (app, gw):
        (fake0, server0), (fake1, _) = workers
        clocked(app)
        fake0.adapters["sql"] = "/adapters/sql"
        wait_for(lambda: "sql" in worker(app, server0).adapters.held, 5, "the sync to learn it")
        assert post(gw, "support").status_code == 200  # the one token
        assert post(gw, "legal").status_code == 429
        fake0.behavior.chunks = 6
        fake0.behavior.die_after = 2
        fake1.behavior.chunks = 6
        stream = sdk(gw).chat.completions.create(model="sql", messages=CHAT, max_tokens=16, stream=True)  # type: ignore[arg-type]
        text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        assert text
        assert "sql" in loads(fake1) and [r.body["model"] for r in fake1.requests][-1] == "sql"


def test_the_retry_after_a_workers_404_loads_the_adapter_again_past_the_bound(gateway_factory: GatewayFactory) -> None:
    """Another replica unloaded sql behind this one: the request that finds it gone loads it again, though
    its tenant has no token left, and is served."""
    with fleet(1) as workers, gateway_factory(bounded(workers, 1, **STALE)) as (app, gw):
        fake, server = workers[0]
        clocked(app)
        assert post(gw, "sql").status_code == 200  # the one token
        assert post(gw, "support").status_code == 429
        evict_at_the_worker(server, "sql")
        assert post(gw, "sql").status_code == 200
        assert loads(fake) == ["sql", "sql"]
        assert [r.body["model"] for r in fake.requests] == ["sql", "sql", "sql"]  # the 404, then served


@pytest.mark.parametrize("unbounded", [None, 0])
def test_without_a_bound_every_load_is_made(gateway_factory: GatewayFactory, unbounded: int | None) -> None:
    with fleet(1) as workers, gateway_factory(bounded(workers, unbounded, max_loras=1)) as (app, gw):
        fake = workers[0][0]
        clocked(app)
        models = ["sql", "support", "legal", "docs"] * 3
        assert [post(gw, m).status_code for m in models] == [200] * 12
        assert loads(fake) == models
