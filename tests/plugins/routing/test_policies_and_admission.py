"""Routing parts on their own: each policy's choice, bounded loads, prompt prefixes, the admission
gate's queue and priorities, the retry budget, weighted targets and DNS discovery into the table."""

from __future__ import annotations

import asyncio
import collections
import random

import pytest

from gateway.upstream.workers import Worker, WorkerTable
from gateway.wire.errors import RateLimited
from plugins.routing.admission import ModelGate
from plugins.routing.canary import WeightedTargets
from plugins.routing.config import AdmissionConfig, RetryBudgetConfig
from plugins.routing.discovery import DnsDiscovery, worker_url
from plugins.routing.plan import RetryBudget
from plugins.routing.policies import WorkerPool, prompt_prefix, stable_hash
from plugins.routing.workerload import parse_vllm_load


def pool(n: int) -> WorkerPool:
    return WorkerPool([Worker(url=f"http://10.0.0.{i}:8000") for i in range(n)])


def test_round_robin_cycles_and_skips_unavailable_and_tried() -> None:
    p = pool(3)
    assert [p.round_robin([], 0.0) for _ in range(6)] == p.workers * 2
    p.workers[1].healthy = False
    picks = [p.round_robin([], 0.0) for _ in range(4)]
    assert p.workers[1] not in picks and set(picks) == {p.workers[0], p.workers[2]}
    assert p.round_robin([p.workers[0], p.workers[2]], 0.0) is None


def test_least_outstanding_picks_the_idlest_and_spreads_ties() -> None:
    p = pool(4)
    for worker, load in zip(p.workers, [5, 2, 7, 3], strict=True):
        worker.in_flight = load
    assert p.least_outstanding([], 0.0) is p.workers[1]
    assert p.least_outstanding([p.workers[1]], 0.0) is p.workers[3]
    p.workers[1].ejected_until = 10.0  # ejected until t=10
    assert p.least_outstanding([], 5.0) is p.workers[3]
    for worker in p.workers:
        worker.in_flight, worker.ejected_until = 0, 0.0
    assert {p.least_outstanding([], 0.0) for _ in range(4)} == set(p.workers)


def test_least_outstanding_weighs_in_scraped_load() -> None:
    p = pool(2)
    p.workers[0].in_flight = 1
    bias = {p.workers[0].url: 0.0, p.workers[1].url: 3.0}
    assert p.least_outstanding([], 0.0, lambda w: bias[w.url]) is p.workers[0]


def test_hashed_keeps_a_key_on_one_worker_and_moves_few_keys_when_a_worker_leaves() -> None:
    p = pool(8)
    keys = [stable_hash(f"prefix-{i}".encode()) for i in range(400)]
    first = {k: p.hashed(k, 1.25, [], 0.0) for k in keys}
    assert all(p.hashed(k, 1.25, [], 0.0) is first[k] for k in keys)
    assert len(set(first.values())) == 8  # keys spread over every worker
    gone = p.workers[3]
    gone.healthy = False
    moved = [k for k in keys if p.hashed(k, 1.25, [], 0.0) is not first[k]]
    assert all(first[k] is gone for k in moved)  # only the departed worker's keys move


def test_bounded_loads_spread_a_hot_key() -> None:
    p = pool(4)
    key = stable_hash(b"one hot system prompt")
    home = p.hashed(key, 1.25, [], 0.0)
    assert home is not None
    placed = []
    for _ in range(40):  # 40 concurrent requests with the same prefix
        worker = p.hashed(key, 1.25, [], 0.0)
        assert worker is not None
        worker.in_flight += 1
        placed.append(worker)
    counts = collections.Counter(placed)
    assert counts[home] == max(counts.values())
    assert max(counts.values()) <= 13  # ceil(1.25 * 40 / 4) = 13
    assert len(counts) == 4


def test_load_slack_keeps_small_imbalances_home_and_still_bounds_a_hot_key() -> None:
    p = pool(2)
    key = stable_hash(b"one system prompt")
    home = p.hashed(key, 1.25, [], 0.0)
    assert home is not None
    home.in_flight = 3  # this request is the 4th in flight: the plain cap ceil(1.25 * 4 / 2) = 3 is reached
    assert p.hashed(key, 1.25, [], 0.0) is not home
    assert p.hashed(key, 1.25, [], 0.0, load_slack=4) is home
    home.in_flight = 0
    placed = collections.Counter()
    for _ in range(40):  # a hot key: the home takes requests while under max(1.25 x mean, mean + 4)
        worker = p.hashed(key, 1.25, [], 0.0, load_slack=4)
        assert worker is not None
        worker.in_flight += 1
        placed[worker] += 1
    assert placed[home] == 25  # ceil(1.25 * 40 / 2) = 25 > ceil(40 / 2 + 4) = 24
    assert sum(placed.values()) == 40


def test_prompt_prefix_uses_the_system_prompt_or_the_prompt_start() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "question 1"},
        ]
    }
    other = {"messages": [body["messages"][0], {"role": "user", "content": "question 2"}]}
    assert prompt_prefix("chat/completions", body, 1024) == "You are terse."
    assert prompt_prefix("chat/completions", body, 1024) == prompt_prefix("chat/completions", other, 1024)
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "abcdef"}]}]}
    assert prompt_prefix("chat/completions", parts, 3) == "abc"
    assert prompt_prefix("completions", {"prompt": "Once upon a time"}, 4) == "Once"
    assert prompt_prefix("completions", {"prompt": [[1, 2, 3]]}, 8) == "1,2"
    assert prompt_prefix("embeddings", {"input": ["xyz", "w"]}, 16) == "xyz"


async def test_gate_admits_to_the_limit_then_refuses_with_retry_after() -> None:
    gate = ModelGate("m", AdmissionConfig(max_in_flight=2, max_queue=0, retry_after_s=7))
    await gate.acquire()
    await gate.acquire()
    with pytest.raises(RateLimited) as info:
        await gate.acquire()
    assert info.value.headers == {"retry-after": "7"}
    gate.release()
    await gate.acquire()
    assert gate.in_flight == 2


async def test_gate_queue_admits_higher_priority_first_and_times_out() -> None:
    gate = ModelGate("m", AdmissionConfig(max_in_flight=1, max_queue=3, max_queue_time_s=2))
    await gate.acquire()
    order: list[str] = []

    async def wait(name: str, priority: int) -> None:
        await gate.acquire(priority)
        order.append(name)

    low = asyncio.create_task(wait("low", 0))
    await asyncio.sleep(0)
    high = asyncio.create_task(wait("high", 5))
    await asyncio.sleep(0)
    assert gate.queued == 2
    gate.release()
    await asyncio.sleep(0.01)
    assert order == ["high"]
    gate.release()
    await asyncio.gather(low, high)
    assert order == ["high", "low"] and gate.in_flight == 1 and gate.queued == 0

    quick = ModelGate("m", AdmissionConfig(max_in_flight=1, max_queue=1, max_queue_time_s=0.05))
    await quick.acquire()
    with pytest.raises(RateLimited):
        await quick.acquire()
    assert quick.queued == 0
    quick.release()
    assert quick.in_flight == 0


async def test_gate_queue_takes_turns_across_tenants_and_forgets_them_when_empty() -> None:
    """Start-time fair queueing: with three tenants backlogged, admission goes round robin among them
    whatever their arrival order (one tenant's 20 requests first), FIFO within each."""
    gate = ModelGate("m", AdmissionConfig(max_in_flight=1, max_queue=100, max_queue_time_s=10))
    await gate.acquire()
    order: list[str] = []

    async def wait(tenant: str, i: int) -> None:
        await gate.acquire(0, tenant)
        order.append(f"{tenant}{i}")
        gate.release()

    tasks = [asyncio.create_task(wait("a", i)) for i in range(20)]
    tasks += [asyncio.create_task(wait("b", i)) for i in range(3)]
    tasks += [asyncio.create_task(wait("c", i)) for i in range(2)]
    await asyncio.sleep(0)
    assert gate.queued == 25
    gate.release()
    await asyncio.gather(*tasks)
    assert order[:7] == ["a0", "b0", "c0", "a1", "b1", "c1", "a2"]
    assert order[7:9] == ["b2", "a3"] and order[-1] == "a19"
    assert gate.queued == 0 and gate._last_tag == {}  # nobody waits: no tenant state kept


def test_retry_budget_bounds_retries_to_a_fraction_of_requests() -> None:
    now = [100.0]
    budget = RetryBudget(RetryBudgetConfig(ratio=0.1, min_per_s=0.0, window_s=10), clock=lambda: now[0])
    for _ in range(100):
        budget.record_request()
    allowed = sum(budget.try_spend() for _ in range(50))
    assert allowed == 10
    now[0] += 11  # the window has passed
    assert not budget.try_spend()
    budget.record_request()
    for _ in range(9):
        budget.record_request()
    assert budget.try_spend()


def test_weighted_targets_follow_their_weights() -> None:
    picker = WeightedTargets({"a": 90, "b": 10}, random.Random(1234))
    n = 20_000
    counts = collections.Counter(picker.pick() for _ in range(n))
    # binomial: mean 2000, sd ~42; 5 sd either side
    assert abs(counts["b"] - n * 0.1) < 5 * (n * 0.1 * 0.9) ** 0.5
    assert WeightedTargets({"a": 1, "b": 0}, random.Random(1)).pick() == "a"


async def test_dns_discovery_feeds_the_worker_table_and_keeps_addresses_on_failure() -> None:
    table = WorkerTable()
    table.sync(["http://static:1"])
    answers: dict[str, list[str]] = {"svc.ns": ["10.1.0.2"]}

    async def resolver(host: str, port: int) -> list[str]:
        if host not in answers:
            raise OSError("NXDOMAIN")
        return answers[host]

    ref = "dns://svc.ns:8000"
    discovery = DnsDiscovery(table, [ref, "http://static:1"], interval_s=60, timeout_s=1, resolver=resolver)
    await discovery.refresh()
    assert table.expand([ref, "http://static:1"]) == ["http://10.1.0.2:8000", "http://static:1"]
    generation = table.generation
    answers["svc.ns"] = ["10.1.0.3", "10.1.0.2"]
    await discovery.refresh()
    assert table.expand([ref]) == ["http://10.1.0.2:8000", "http://10.1.0.3:8000"]
    assert table.generation > generation
    assert {w.url for w in table.all()} == {"http://static:1", "http://10.1.0.2:8000", "http://10.1.0.3:8000"}
    del answers["svc.ns"]  # a failed lookup keeps the last known workers
    await discovery.refresh()
    assert len(table.expand([ref])) == 2
    table.sync(["http://static:1"])  # a config reload keeps discovered workers
    assert len(table.all()) == 3
    assert worker_url("fd00::1", 80) == "http://[fd00::1]:80"


def test_vllm_metrics_parsing() -> None:
    text = "\n".join(
        [
            "# HELP vllm:num_requests_waiting Number of requests waiting",
            'vllm:num_requests_waiting{engine="0",model_name="m"} 3.0',
            'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25',
            'vllm:prefix_cache_hits_total{engine="0"} 10.0',
        ]
    )
    assert parse_vllm_load(text) == (3.0, 0.25)
