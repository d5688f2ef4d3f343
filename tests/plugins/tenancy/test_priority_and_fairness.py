"""Who waits for a full model: priority comes from the tenant's config (a client's x-priority header
counts only where its tenant allows it, capped), and within a priority the queue is fair across
tenants, so one tenant's burst cannot starve another's requests. Also: the model allow-list follows
the request through canaries and fallbacks."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from plugins.tenancy.keys import hash_key
from tests.plugins.routing.test_retry_budget_and_fallback import metric
from tests.plugins.routing.test_through_the_gateway import dead_url, fleet
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

TENANTS = ("a", "b", "c", "p")


def secret(tenant: str) -> str:
    return f"sk-gw-fairness-{tenant}"


def config(prefix: str, worker_url: str, tenants: dict[str, Any]) -> dict[str, Any]:
    keys = [{"id": f"key-{t}", "tenant": t, "hash": hash_key(secret(t), PEPPER.encode())} for t in TENANTS]
    admission = {"max_in_flight": 1, "max_queue": 30, "max_queue_time_s": 60}
    return base_config(
        [worker_url],
        plugins=[
            {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys, "tenants": tenants}},
            {"name": "routing", "config": {"default": {"admission": admission}}},
        ],
    )


class Queue:
    """Holds the model's only slot with one request, queues the ones a test sends, then lets all go;
    the worker then sees them in the order the gate admitted them."""

    def __init__(self, server: ServerThread, fake: FakeUpstream) -> None:
        self.server, self.fake = server, fake
        self.threads: list[threading.Thread] = []
        self.queued = 0

    def send(self, tag: str, tenant: str, **headers: str) -> None:
        body = {"model": "m1", "messages": [{"role": "user", "content": tag}], "max_tokens": 3}
        headers = {"authorization": f"Bearer {secret(tenant)}", **headers}
        thread = threading.Thread(
            target=httpx.post,
            args=(self.server.url + "/v1/chat/completions",),
            kwargs={"json": body, "headers": headers, "timeout": 60},
        )
        thread.start()
        self.threads.append(thread)
        if self.fake.behavior.hold is None:  # the first one takes the slot and holds it
            self.fake.behavior.hold = threading.Event()
            wait_for(lambda: len(self.fake.requests) == 1, 20, "the holder to reach the worker")
            return
        self.queued += 1
        wait_for(
            lambda: metric(self.server, 'gateway_queued_requests{model="m1"}') >= self.queued, 20, f"{tag} to queue"
        )

    def release(self) -> list[str]:
        assert self.fake.behavior.hold is not None
        self.fake.behavior.hold.set()
        for thread in self.threads:
            thread.join(timeout=60)
        return [seen.body["messages"][0]["content"] for seen in self.fake.requests]


@pytest.fixture
def worker() -> Iterator[tuple[FakeUpstream, ServerThread]]:
    with fleet(1) as workers:
        yield workers[0]


def test_one_tenants_burst_cannot_starve_another(
    gateway_factory: GatewayFactory, worker: tuple[FakeUpstream, ServerThread], prefix: str
) -> None:
    fake, url = worker[0], worker[1].url
    with gateway_factory(config(prefix, url, {})) as (_, server):
        queue = Queue(server, fake)
        queue.send("a-holder", "a")
        for i in range(8):
            queue.send(f"a{i}", "a")  # tenant a floods the full model
        queue.send("b0", "b")
        queue.send("a8", "a")
        queue.send("b1", "b")
        order = queue.release()
    assert order[0] == "a-holder"
    assert order.index("b0") <= 2  # served within a slot or two, not after a's eight
    assert order.index("b1") <= order.index("a3")  # and b's second request does not wait for the burst
    assert len(order) == 12


def test_priority_comes_from_tenant_config_and_a_header_only_where_allowed(
    gateway_factory: GatewayFactory, worker: tuple[FakeUpstream, ServerThread], prefix: str
) -> None:
    fake, url = worker[0], worker[1].url
    tenants = {"p": {"priority": 5}, "c": {"client_priority_max": 3}}
    with gateway_factory(config(prefix, url, tenants)) as (_, server):
        queue = Queue(server, fake)
        queue.send("holder", "a")
        queue.send("a-says-999", "a", **{"x-priority": "999"})  # a's tenant allows no client priority
        queue.send("c-says-100", "c", **{"x-priority": "100"})  # capped at 3
        queue.send("c-junk", "c", **{"x-priority": "soon"})  # not a number: c's configured 0
        queue.send("p-config", "p")  # 5 by config
        queue.send("b-plain", "b")
        order = queue.release()
    assert order[:3] == ["holder", "p-config", "c-says-100"]
    # the rest at priority 0, fair across tenants: c already had a turn (its capped request), so b,
    # which arrived after c-junk, goes before it
    assert order[3:] == ["a-says-999", "b-plain", "c-junk"]


# -- the allow-list follows the request -----------------------------------------------------------


def two_models(prefix: str, m1_workers: list[str], m2_url: str, routing: dict[str, Any]) -> dict[str, Any]:
    keys = [
        {"id": "only-m1", "tenant": "t", "hash": hash_key(secret("a"), PEPPER.encode()), "models": ["m1"]},
        {"id": "both", "tenant": "t", "hash": hash_key(secret("b"), PEPPER.encode()), "models": ["m1", "m2secret"]},
    ]
    cfg = base_config(
        m1_workers,
        plugins=[
            {"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}},
            {"name": "routing", "config": routing},
        ],
    )
    cfg["models"].append({"name": "m2secret", "served_name": "secret-weights", "workers": [m2_url]})
    return cfg


def ask(server: ServerThread, tenant: str, model: str = "m1") -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    return httpx.post(
        server.url + "/v1/chat/completions", json=body, headers={"authorization": f"Bearer {secret(tenant)}"}
    )


def test_a_fallback_the_key_may_not_use_is_never_tried(
    gateway_factory: GatewayFactory, worker: tuple[FakeUpstream, ServerThread], prefix: str
) -> None:
    fake, url = worker[0], worker[1].url
    cfg = two_models(prefix, [dead_url()], url, {"models": {"m1": {"fallbacks": ["m2secret"]}}})
    with gateway_factory(cfg) as (_, server):
        direct = ask(server, "a", "m2secret")
        refused = ask(server, "a")  # m1 is down; its fallback is not this key's
        assert fake.requests == []
        allowed = ask(server, "b")  # a key allowed both falls back
    assert direct.status_code == 404 and direct.json()["error"]["code"] == "model_not_found"
    assert refused.status_code in (502, 503) and "secret" not in refused.text
    assert allowed.status_code == 200
    assert [seen.body["model"] for seen in fake.requests] == ["secret-weights"]


def test_a_model_allowed_by_one_of_its_aliases_may_be_a_fallback(
    gateway_factory: GatewayFactory, worker: tuple[FakeUpstream, ServerThread], prefix: str
) -> None:
    fake, url = worker[0], worker[1].url
    cfg = two_models(prefix, [dead_url()], url, {"models": {"m1": {"fallbacks": ["m2secret"]}}})
    cfg["models"][1]["aliases"] = ["m2-public"]
    cfg["plugins"][0]["config"]["keys"][0]["models"] = ["m1", "m2-public"]
    with gateway_factory(cfg) as (_, server):
        assert ask(server, "a").status_code == 200
    assert [seen.body["model"] for seen in fake.requests] == ["secret-weights"]


def test_a_canary_the_key_may_not_use_keeps_the_request_on_its_model(
    gateway_factory: GatewayFactory, prefix: str
) -> None:
    with fleet(2) as workers:
        (m1_fake, m1), (m2_fake, m2) = workers
        cfg = two_models(prefix, [m1.url], m2.url, {"models": {"m1": {"targets": {"m1": 0, "m2secret": 1}}}})
        with gateway_factory(cfg) as (_, server):
            codes = [ask(server, "a").status_code for _ in range(5)] + [ask(server, "b").status_code]
    assert codes == [200] * 6
    assert len(m1_fake.requests) == 5 and len(m2_fake.requests) == 1  # only the key allowed both went over
