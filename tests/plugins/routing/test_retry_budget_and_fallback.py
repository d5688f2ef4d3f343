"""Routing paths the other routing tests leave alone: the retry budget refusing a retry, a fallback
after the model's own attempts are used up, admission slots across retries and reloads, the priority
header as clients really send it, config validation, worker-load scraping and DNS resolution."""

from __future__ import annotations

import asyncio
import socket
import threading
from typing import Any

import httpx
import orjson
import pytest
from pydantic import ValidationError

from gateway.ops.metrics import Metrics
from gateway.ops.settings import Settings
from gateway.pipeline.config import ConfigError, GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.runtime import build_snapshot
from gateway.pipeline.services import Services
from gateway.upstream.client import UpstreamClient, UpstreamConfig
from gateway.upstream.workers import Worker, WorkerTable
from plugins.routing import RoutingPlugin
from plugins.routing.config import LoadMetricsConfig, RoutingConfig
from plugins.routing.discovery import DnsDiscovery, parse_dns_ref, system_resolver
from plugins.routing.policies import WorkerPool, prompt_prefix
from plugins.routing.telemetry import RoutingShared
from plugins.routing.workerload import WorkerLoadScraper, parse_vllm_load
from tests.plugins.routing.test_through_the_gateway import CHAT, counts, fleet, routing, two_models
from tests.support.fakes import ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics


def metric(server: ServerThread, line_start: str) -> float:
    """The value of the first /metrics sample whose line starts with ``line_start`` (0 when absent)."""
    for line in admin_metrics(server).splitlines():
        if line.startswith(line_start):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def chat(server: ServerThread, **headers: str) -> httpx.Response:
    return httpx.post(server.url + "/v1/chat/completions", json={"model": "m1", "messages": CHAT}, headers=headers)


# -- retries, budgets, fallbacks, admission --------------------------------------------------------


def test_an_empty_retry_budget_refuses_the_retry_and_counts_it(gateway_factory: GatewayFactory) -> None:
    with fleet(2) as workers:
        for fake, _ in workers:
            fake.behavior.status = 503
        config = {"retry_budget": {"ratio": 0, "min_per_s": 0}, "default": {"policy": "round_robin"}}
        with gateway_factory(base_config([s.url for _, s in workers], plugins=routing(config))) as (_, gw):
            response = chat(gw)
            assert response.status_code == 502
            assert sum(counts(workers)) == 1  # the failure was retryable, but the budget said no
            assert metric(gw, 'gateway_routing_retry_budget_exhausted_total{model="m1"}') == 1


def test_a_fallback_model_gets_its_turn_after_the_models_own_attempts(gateway_factory: GatewayFactory) -> None:
    with fleet(3) as workers:
        workers[0][0].behavior.status = 502
        workers[1][0].behavior.status = 502
        config = {"max_attempts": 2, "models": {"m1": {"fallbacks": ["m2"], "policy": "round_robin"}}}
        cfg = two_models([workers[0][1].url, workers[1][1].url], [workers[2][1].url], config)
        with gateway_factory(cfg) as (_, gw):
            response = chat(gw)
            assert response.status_code == 200, response.text
            assert counts(workers) == [1, 1, 1]  # both of m1's workers, then m2's
            assert workers[2][0].requests[0].body["model"] == "m2-served"
            assert metric(gw, 'gateway_routing_fallbacks_total{fallback="m2",model="m1"}') == 1
            # one retry within m1, one into m2 (counted under the model it went to)
            retries = [metric(gw, f'gateway_upstream_retries_total{{model="{m}"}}') for m in ("m1", "m2")]
            assert retries == [1, 1]


def test_a_retried_request_holds_one_admission_slot_and_gives_it_back(gateway_factory: GatewayFactory) -> None:
    with fleet(2) as workers:
        workers[0][0].behavior.status = 503
        config = {"models": {"m1": {"policy": "round_robin", "admission": {"max_in_flight": 1}}}}
        with gateway_factory(base_config([s.url for _, s in workers], plugins=routing(config))) as (app, gw):
            for _ in range(4):
                assert chat(gw).status_code == 200  # never refused: a retry does not queue behind itself
            gate = RoutingShared.of(app.state.services).gates["m1"]
            assert (gate.in_flight, gate.queued) == (0, 0)
            assert metric(gw, 'gateway_routing_admitted{model="m1"}') == 0


def test_a_reload_updates_admission_and_budgets_in_place(gateway_factory: GatewayFactory, upstream_url: str) -> None:
    def cfg(limit: int, ratio: float) -> dict[str, Any]:
        config = {"retry_budget": {"ratio": ratio}, "models": {"m1": {"admission": {"max_in_flight": limit}}}}
        return base_config([upstream_url], plugins=routing(config))

    with gateway_factory(cfg(1, 0.2), admin_token="t") as (app, gw):
        assert chat(gw).status_code == 200
        shared = RoutingShared.of(app.state.services)
        gate, budget = shared.gates["m1"], shared.budgets["m1"]
        put = httpx.put(gw.url + "/admin/config", headers={"authorization": "Bearer t"}, json=cfg(7, 0.5))
        assert put.status_code == 200
        assert chat(gw).status_code == 200
        assert shared.gates["m1"] is gate and gate.limits.max_in_flight == 7  # same gate, new limits
        assert shared.budgets["m1"] is budget and budget.config.ratio == 0.5


def test_a_client_priority_header_alone_changes_nothing(gateway_factory: GatewayFactory) -> None:
    """Priority comes from tenant config (tests/plugins/tenancy/test_priority_and_fairness.py): a client's
    x-priority header on its own cannot jump the queue, so waiters are admitted first come, first served."""
    with fleet(1) as workers:
        fake, worker = workers[0]
        fake.behavior.hang = True  # the first request holds the only slot until its client goes away
        admission = {"max_in_flight": 1, "max_queue": 5, "max_queue_time_s": 30}
        config = base_config([worker.url], plugins=routing({"default": {"admission": admission}}))
        with gateway_factory(config) as (_, gw), httpx.Client(base_url=gw.url, timeout=30) as client:
            holder = socket.create_connection(("127.0.0.1", gw.port))
            body = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "holder"}]})
            holder.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            wait_for(lambda: len(fake.requests) == 1, 10, "the holder to reach the worker")
            threads: list[threading.Thread] = []
            for queued, (tag, priority) in enumerate(
                [("low", "-5000"), ("junk", "soon"), ("high", "7"), ("none", None)]
            ):
                headers = {"X-Priority": priority} if priority is not None else {}
                payload = {"model": "m1", "messages": [{"role": "user", "content": tag}]}
                thread = threading.Thread(
                    target=client.post, args=("/v1/chat/completions",), kwargs={"json": payload, "headers": headers}
                )
                thread.start()
                threads.append(thread)
                wait_for(lambda n=queued: metric(gw, 'gateway_queued_requests{model="m1"}') > n, 10, f"{tag} to queue")
            fake.behavior.hang = False
            holder.close()  # the holder's client leaves: its slot goes to the best waiter, and so on
            for thread in threads:
                thread.join(timeout=30)
    order = [seen.body["messages"][0]["content"] for seen in fake.requests]
    assert order == ["holder", "low", "junk", "high", "none"]


async def test_routing_config_names_every_unknown_model() -> None:
    services = Services(Settings(), UpstreamClient(UpstreamConfig()), WorkerTable(), Metrics())
    config = {"models": {"ghost": {}, "m1": {"targets": {"m1": 1, "nope": 1}, "fallbacks": ["gone"]}}}
    cfg = GatewayConfig.model_validate(base_config(["http://127.0.0.1:9"], plugins=routing(config)))
    with pytest.raises(ConfigError) as refused:
        await build_snapshot(cfg, PluginRegistry({"routing": RoutingPlugin}, discover=False), services)
    message = refused.value.problems[0]
    assert "routing.models.ghost: no model named 'ghost' in models:" in message
    assert "routing.models.m1.targets: unknown model 'nope'" in message
    assert "routing.models.m1.fallbacks: unknown model 'gone'" in message
    await services.aclose()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"default": {"targets": {"a": -1}}}, "target weights must be >= 0"),
        ({"default": {"targets": {"a": 0, "b": 0}}}, "at least one target needs a weight > 0"),
        ({"default": {"policy": "random"}}, "Input should be 'round_robin'"),
        ({"max_attempts": 11}, "less than or equal to 10"),
        ({"default": {"admission": {"retry_after_s": 0}}}, "greater than or equal to 1"),
        ({"surprise": True}, "Extra inputs are not permitted"),
        ({"kv_events": {"max_message_bytes": 1024}}, "greater than or equal to 4096"),
        ({"kv_events": {"max_message_bytes": 1 << 30}}, "less than or equal to 268435456"),
    ],
)
def test_routing_config_refusals(section: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        RoutingConfig.model_validate(section)


def test_header_names_are_matched_case_insensitively() -> None:
    config = RoutingConfig.model_validate({"default": {"session_header": "X-Session"}})
    assert config.default.session_header == "x-session"


# -- policies ---------------------------------------------------------------------------------------


def test_hashed_choice_without_a_live_worker_is_none() -> None:
    assert WorkerPool([]).hashed(1, 1.25, [], 0.0) is None
    workers = [Worker(url="http://a:1"), Worker(url="http://b:1", healthy=False)]
    pool = WorkerPool(workers)
    assert pool.hashed(5, 1.25, [workers[0]], 0.0) is None  # one tried, the other down
    assert pool.least_outstanding([workers[0]], 0.0) is None
    assert pool.round_robin([workers[0]], 0.0) is None
    assert len(pool) == 2


@pytest.mark.parametrize(
    ("endpoint", "body", "expected"),
    [
        ("completions", {"prompt": [[101, 102, 103, 104, 105]]}, "101"),  # token ids: chars // 4 of them
        ("completions", {"prompt": ["first prompt", "second"]}, "first prompt"[:4]),
        ("embeddings", {"input": "some text to embed"}, "some"),
        ("embeddings", {"input": 42}, ""),
        ("chat/completions", {"messages": []}, ""),
        ("chat/completions", {"messages": "not a list"}, ""),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "part"}]}]}, "part"),
        ("chat/completions", {"messages": ["junk"]}, ""),
        ("chat/completions", {"messages": [{"role": "system", "content": None}, {"role": "user", "content": "u"}]}, ""),
    ],
)
def test_prompt_prefix_of_every_body_shape(endpoint: str, body: dict[str, Any], expected: str) -> None:
    assert prompt_prefix(endpoint, body, 4) == expected


# -- worker load scraping ---------------------------------------------------------------------------


def test_vllm_metrics_without_labels_and_broken_lines() -> None:
    text = "\n".join(
        [
            "vllm:num_requests_waiting 2",
            'vllm:num_requests_waiting{engine="1"} 3',
            "vllm:kv_cache_usage_perc",  # no value
            'vllm:gpu_cache_usage_perc{engine="0"} not-a-number',
            'vllm:gpu_cache_usage_perc{engine="1"} 0.5',
            "vllm:kv_cache_usage_perc 0.25",
            "other_metric 99",
        ]
    )
    assert parse_vllm_load(text) == (5.0, 0.5)  # waiting adds up over engines; KV usage is the fullest one


class MetricsWorker:
    """A worker's /metrics: vLLM's exposition text, or an error status."""

    def __init__(self, text: str, status: int = 200) -> None:
        self.text, self.status = text, status

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        await send(
            {"type": "http.response.start", "status": self.status, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": self.text.encode()})


async def test_scraper_weighs_fresh_samples_only_and_forgets_departed_workers() -> None:
    busy = ServerThread(MetricsWorker("vllm:num_requests_waiting 4\nvllm:kv_cache_usage_perc 0.5\n"), lifespan="off")
    broken = ServerThread(MetricsWorker("oops", status=500), lifespan="off")
    now = [1000.0]
    table = WorkerTable()
    upstream = UpstreamClient(UpstreamConfig())
    config = LoadMetricsConfig(enabled=True, waiting_weight=1.0, kv_weight=4.0, max_age_s=10)
    scraper = WorkerLoadScraper(config, table, upstream, clock=lambda: now[0])
    with busy, broken:
        table.sync([busy.url, broken.url])
        await scraper.scrape_once()
        assert scraper.bias(table.get(busy.url)) == pytest.approx(4 + 4 * 0.5)
        assert scraper.bias(table.get(broken.url)) == 0.0  # a 500 gives no sample
        now[0] += 11
        assert scraper.bias(table.get(busy.url)) == 0.0  # stale: unknown, not pinned away
        table.sync([broken.url])
        await scraper.scrape_once()
        now[0] -= 11
        assert scraper.bias(Worker(url=busy.url)) == 0.0  # the departed worker's sample is gone
    await upstream.aclose()


async def test_scraper_loop_survives_a_failing_round(caplog: pytest.LogCaptureFixture) -> None:
    table = WorkerTable()
    upstream = UpstreamClient(UpstreamConfig())
    scraper = WorkerLoadScraper(LoadMetricsConfig(enabled=True, interval_s=0.01), table, upstream)
    rounds: list[int] = []

    async def failing_round() -> None:
        rounds.append(1)
        raise RuntimeError("scrape bug")

    scraper.scrape_once = failing_round  # type: ignore[method-assign]
    await scraper.start()
    for _ in range(200):
        if len(rounds) >= 3:
            break
        await asyncio.sleep(0.01)
    await scraper.aclose()
    assert len(rounds) >= 3  # it kept going after the first failure
    assert "worker load scrape failed" in caplog.text
    await upstream.aclose()


async def test_scraper_does_nothing_unless_enabled() -> None:
    scraper = WorkerLoadScraper(LoadMetricsConfig(enabled=False), WorkerTable(), UpstreamClient(UpstreamConfig()))
    await scraper.start()
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "routing-load-scrape"]
    await scraper.aclose()


# -- DNS discovery ----------------------------------------------------------------------------------


@pytest.mark.parametrize("ref", ["dns://svc", "http://svc:80", "dns://:8000"])
def test_dns_refs_need_a_name_and_a_port(ref: str) -> None:
    with pytest.raises(ValueError, match="must look like dns://name:port"):
        parse_dns_ref(ref)


async def test_the_system_resolver_resolves_localhost() -> None:
    assert "127.0.0.1" in await system_resolver("localhost", 8000)


async def test_a_slow_resolver_is_bounded_and_keeps_the_last_addresses() -> None:
    table = WorkerTable()
    answers = {"svc": (0.0, ["10.0.0.1"])}

    async def resolver(host: str, port: int) -> list[str]:
        delay, addresses = answers[host]
        await asyncio.sleep(delay)
        return addresses

    discovery = DnsDiscovery(table, ["dns://svc:80"], interval_s=60, timeout_s=0.05, resolver=resolver)
    await discovery.refresh()
    answers["svc"] = (1.0, ["10.0.0.2"])
    await discovery.refresh()  # times out after 0.05 s
    assert table.expand(["dns://svc:80"]) == ["http://10.0.0.1:80"]


async def test_discovery_forgets_refs_no_model_names_any_more() -> None:
    table = WorkerTable()

    async def resolver(host: str, port: int) -> list[str]:
        return ["10.0.0.9"]

    await DnsDiscovery(table, ["dns://old:80"], interval_s=60, timeout_s=1, resolver=resolver).refresh()
    assert [w.url for w in table.all()] == ["http://10.0.0.9:80"]
    await DnsDiscovery(table, ["dns://new:81"], interval_s=60, timeout_s=1, resolver=resolver).refresh()
    assert table.expand(["dns://old:80"]) == []
    assert [w.url for w in table.all()] == ["http://10.0.0.9:81"]


async def test_the_discovery_loop_survives_a_failing_round(caplog: pytest.LogCaptureFixture) -> None:
    table = WorkerTable()
    rounds: list[int] = []

    async def resolver(host: str, port: int) -> list[str]:
        return ["10.0.0.1"]

    discovery = DnsDiscovery(table, ["dns://svc:80"], interval_s=0.01, timeout_s=1, resolver=resolver)
    await discovery.start()  # the first round runs before start returns
    assert table.expand(["dns://svc:80"]) == ["http://10.0.0.1:80"]

    async def failing_refresh() -> None:
        rounds.append(1)
        raise RuntimeError("discovery bug")

    discovery.refresh = failing_refresh  # type: ignore[method-assign]
    for _ in range(200):
        if len(rounds) >= 3:
            break
        await asyncio.sleep(0.01)
    await discovery.aclose()
    assert len(rounds) >= 3 and "DNS discovery round failed" in caplog.text
