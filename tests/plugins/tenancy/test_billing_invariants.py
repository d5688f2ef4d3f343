"""The billing invariants under concurrency, real Redis and a seeded random mix of requests (many
clients on three keys of two tenants; random n, max_tokens, streaming, usage, client disconnects and
worker faults: 500, 503, streams cut by the worker):

- each key and tenant is charged exactly what its clients were delivered: an answer's usage; a
  stream's usage when it ended (the gateway asks the worker for it, whether the client did or not);
  a cut stream's tokens that went out (between what the client read and what the worker sent when the
  client hung up), with the prompt estimate (the only estimate); nothing for refusals and failures;
- no key or tenant ever gets more than its budget or its per-minute limit allows (GCRA: the limit at
  once, then the limit per minute), beyond what prompt estimates below the true prompt let through.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
import pytest
import redis

from plugins.tenancy.budgets import budgets_for
from plugins.tenancy.config import Limits
from plugins.tenancy.estimate import prompt_tokens
from plugins.tenancy.keys import hash_key
from tests.support.fakes import ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metered import MeteredWorker
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

CONTEXT = 128
KEYS = {  # id -> (tenant, key limits)
    "k1": ("t1", {"tokens_per_day": 1200}),
    "k2": ("t1", {"tokens_per_minute": 1200}),
    "k3": ("t2", {"requests_per_minute": 40}),
}
TENANTS = {"t2": {"tokens_per_day": 2000}}
SECRET = {key_id: f"sk-gw-invariants-{key_id}" for key_id in KEYS}


@dataclass
class Outcome:
    key_id: str
    rid: str
    body: dict[str, Any]
    status: int = 0
    read: int = 0  # completion tokens the client read
    usage: dict[str, int] | None = None
    complete: bool = False
    client_cut: bool = False


def request_mix(rng: random.Random, count: int) -> list[tuple[str, dict[str, Any], int | None]]:
    """(key id, body, client disconnects after this many tokens or None), seeded."""
    mix = []
    for i in range(count):
        words = [f"rid-{i}", f"len-{rng.randint(1, 40)}"] + ["lorem"] * rng.randint(0, 12)
        roll = rng.random()
        if roll < 0.06:
            words.append("fault-500")
        elif roll < 0.12:
            words.append("fault-503")
        elif roll < 0.2:
            words.append(f"cut-{rng.randint(0, 6)}")
        body: dict[str, Any] = {"model": "m1", "messages": [{"role": "user", "content": " ".join(words)}]}
        if rng.random() < 0.5:
            body["max_tokens"] = rng.randint(1, 40)
        if rng.random() < 0.4:
            body["n"] = rng.randint(2, 3)
        disconnect = None
        if rng.random() < 0.55:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
            if rng.random() < 0.25:
                disconnect = rng.randint(1, 5)
        mix.append((rng.choice(list(KEYS)), body, disconnect))
    return mix


async def one(client: httpx.AsyncClient, url: str, key_id: str, body: dict[str, Any], cut: int | None) -> Outcome:
    outcome = Outcome(key_id, body["messages"][0]["content"].split()[0][4:], body)
    headers = {"authorization": f"Bearer {SECRET[key_id]}"}
    if not body.get("stream"):
        reply = await client.post(url, json=body, headers=headers)
        outcome.status = reply.status_code
        if reply.status_code == 200:
            outcome.usage = reply.json()["usage"]
            outcome.complete = True
        return outcome
    async with client.stream("POST", url, json=body, headers=headers) as reply:
        outcome.status = reply.status_code
        if reply.status_code != 200:
            await reply.aread()
            return outcome
        failed = False
        async for line in reply.aiter_lines():
            if line == "data: [DONE]":
                outcome.complete = not failed  # a stream the worker cut ends with an error event first
                break
            if not line.startswith("data: "):
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                failed = True
                continue
            if event.get("usage"):
                outcome.usage = event["usage"]
            for choice in event.get("choices") or ():
                if choice["delta"].get("content"):
                    outcome.read += 1
                    if cut is not None and outcome.read >= cut:
                        outcome.client_cut = True
                        return outcome  # leaving the block closes the connection
    return outcome


def bounds(outcome: Outcome, worker: MeteredWorker) -> tuple[int, int, int]:
    """(least, most) the gateway may charge for this request, and by how much the charge may pass the
    request's reservation (a true prompt above the admission estimate, known from usage)."""
    if outcome.status != 200:
        return 0, 0, 0
    meter = worker.seen[outcome.rid]
    estimate = prompt_tokens("chat/completions", outcome.body)
    if not outcome.body.get("stream"):
        assert outcome.usage is not None
        total = outcome.usage["prompt_tokens"] + outcome.usage["completion_tokens"]
        return total, total, max(0, meter.prompt - estimate)
    if outcome.read == 0 and not outcome.complete:
        return 0, 0, 0  # cut before any token went out
    if outcome.usage is not None:  # read to the end, usage included
        total = outcome.usage["prompt_tokens"] + outcome.usage["completion_tokens"]
        assert outcome.usage["completion_tokens"] == outcome.read
        return total, total, max(0, meter.prompt - estimate)
    if outcome.complete:  # read to the end: charged the usage the gateway asked the worker for
        assert meter.generated == outcome.read
        total = meter.prompt + meter.generated
        return total, total, max(0, meter.prompt - estimate)
    if outcome.client_cut:
        return estimate + outcome.read, estimate + meter.sent, 0
    assert outcome.read == meter.sent  # everything the worker sent reached the client
    return estimate + outcome.read, estimate + outcome.read, 0


def used(client: redis.Redis, prefix: str, tenant: str, scope: str, name: str) -> int:
    budget = budgets_for(prefix, tenant, scope, name, Limits(), time.time())[0]  # today's counter
    return int(client.hget(budget.redis_key, "tokens") or 0)


@pytest.mark.parametrize("seed", [7, 2024])
def test_charged_equals_delivered_and_limits_hold(gateway_factory: GatewayFactory, prefix: str, seed: int) -> None:
    worker = MeteredWorker(context=CONTEXT)
    keys = [
        {"id": key_id, "tenant": tenant, "hash": hash_key(SECRET[key_id], PEPPER.encode()), "limits": limits}
        for key_id, (tenant, limits) in KEYS.items()
    ]
    section = {"redis_prefix": prefix, "keys": keys, "tenants": TENANTS, "redis_timeout_ms": 2000}
    config = base_config(["http://placeholder"], plugins=[{"name": "tenancy", "config": section}, {"name": "routing"}])
    config["upstream"]["idle_timeout_s"] = 10
    rng = random.Random(seed)
    mix = request_mix(rng, 160)
    with ServerThread(worker) as upstream:
        config["models"][0]["workers"] = [upstream.url]
        config["models"][0]["max_model_len"] = CONTEXT
        with gateway_factory(config) as (app, server):

            async def drive() -> list[Outcome]:
                gate = asyncio.Semaphore(12)
                limits = httpx.Limits(max_connections=24)
                async with httpx.AsyncClient(timeout=30, limits=limits) as client:

                    async def bounded(item: tuple[str, dict[str, Any], int | None]) -> Outcome:
                        async with gate:
                            return await one(client, server.url + "/v1/chat/completions", *item)

                    return list(await asyncio.gather(*(bounded(item) for item in mix)))

            started = time.monotonic()
            outcomes = asyncio.run(drive())
            elapsed = time.monotonic() - started
            tenancy = next(b.plugin for b in app.state.holder.current.pipeline.plugins if b.name == "tenancy")
            deadline = time.monotonic() + 20
            while tenancy.charges.due and time.monotonic() < deadline:  # charges still on their way
                time.sleep(0.05)
            time.sleep(0.2)
    statuses = sorted({o.status for o in outcomes})
    assert set(statuses) <= {200, 429, 502, 503}, statuses
    client = redis.Redis()
    try:
        charged = {key_id: used(client, prefix, tenant, "key", key_id) for key_id, (tenant, _) in KEYS.items()}
        charged_t2 = used(client, prefix, "t2", "tenant", "t2")
    finally:
        client.close()
    per_key: dict[str, list[int]] = {key_id: [0, 0, 0] for key_id in KEYS}
    for outcome in outcomes:
        least, most, over = bounds(outcome, worker)
        sums = per_key[outcome.key_id]
        sums[0] += least
        sums[1] += most
        sums[2] += over
    for key_id, (least, most, _) in per_key.items():
        assert least <= charged[key_id] <= most, (key_id, least, charged[key_id], most)
    assert charged_t2 == charged["k3"]  # the tenant's counter is its one key's
    # The limits bind (the mix asks for more than they allow) and hold.
    refused = {key_id: sum(o.status == 429 for o in outcomes if o.key_id == key_id) for key_id in KEYS}
    assert all(refused.values()), refused
    assert charged["k1"] <= 1200 + per_key["k1"][2]
    assert charged["k2"] <= 1200 * (1 + elapsed / 60) + per_key["k2"][2]
    assert charged_t2 <= 2000 + per_key["k3"][2]
    admitted_k3 = sum(o.status != 429 for o in outcomes if o.key_id == "k3")
    assert admitted_k3 <= 40 * (1 + elapsed / 60)
    # Every kind of ending happened at least once in the mix.
    streams = [o for o in outcomes if o.body.get("stream") and o.status == 200]
    assert any(o.client_cut for o in streams) and any(not o.complete and not o.client_cut for o in streams)
    assert any(o.status in (502, 503) for o in outcomes)
