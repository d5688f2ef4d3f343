"""A batch goes at the pace its tenant's limits allow: a line refused for now (a 429 that says how long to
wait) is given back and runs again after the wait, its batch paused meanwhile on that replica, instead of
ending in the error file. A wait longer than the batch's window is no help: then the refusal is the line's
result, as before. Real Redis, a fake worker, the real OpenAI SDK."""

from __future__ import annotations

import re
import time
import uuid
from typing import Any, ClassVar

import openai

from gateway.pipeline import ModelResponse, Plugin, RequestContext
from gateway.wire.errors import RateLimited
from plugins.tenancy.keys import hash_key
from tests.support.batches import batches_section, chat_line, jsonl, parse_jsonl, start, wait_for
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name

PACED = f"sk-paced-{uuid.uuid4().hex}"  # RPM requests a minute: the batch's lines run as this key
FREE = f"sk-free-{uuid.uuid4().hex}"  # the same tenant, no limits: uploads and polling
RPM = 60  # a burst of 60, then one a second
LINES = RPM + 4


def sdk(server: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def deferred(server: ServerThread) -> float:
    found = re.search(r"^gateway_batch_lines_deferred_total (\S+)$", admin_metrics(server), re.M)
    return float(found.group(1)) if found else 0.0


def test_a_batch_past_its_keys_request_limit_waits_rather_than_failing_lines(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    prefix: str,
    batch_names: dict[str, Any],
) -> None:
    keys = [
        {"id": "paced", "tenant": "acme", "hash": hash_key(PACED, PEPPER.encode()),
         "limits": {"requests_per_minute": RPM}},
        {"id": "free", "tenant": "acme", "hash": hash_key(FREE, PEPPER.encode())},
    ]  # fmt: skip
    plugins = [{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}}, {"name": "routing"}]
    config = base_config([upstream_url], plugins=plugins, batches=batches_section(batch_names))
    lines = [chat_line(f"r-{i}", f"line {i}", max_tokens=3) for i in range(LINES)]
    with gateway_factory(config) as (_, server):
        free = sdk(server, FREE)
        source = free.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        # created by the paced key (one of its requests): its lines run as it, within its limit
        batch = sdk(server, PACED).batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_for(free, batch.id, ("completed",), timeout_s=60)
        output = parse_jsonl(free.files.content(done.output_file_id).content)
        waits = deferred(server)
    assert (done.request_counts.completed, done.request_counts.failed) == (LINES, 0), done.request_counts
    assert done.error_file_id is None
    assert sorted(line["custom_id"] for line in output) == sorted(f"r-{i}" for i in range(LINES))
    assert len(upstream.requests) == LINES  # each line answered once: a refused run never reached the worker
    assert waits >= 1  # some lines were refused for now and waited


class Throttle(Plugin):
    """Refuses batch lines with a 429 whose ``retry-after-ms`` is ``wait_ms`` until ``until`` (monotonic);
    counts the attempts it refused."""

    name = "throttle"
    wait_ms: ClassVar[int] = 200
    until: ClassVar[float] = 0.0
    refused: ClassVar[int] = 0

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        cls = type(self)
        if ctx.batch_line is not None and time.monotonic() < cls.until:
            cls.refused += 1
            wait = str(cls.wait_ms)
            raise RateLimited("Slow down.", code="rate_limit_exceeded", headers={"retry-after-ms": wait})
        return None


def throttled_config(upstream_url: str, batch_names: dict[str, Any]) -> dict[str, Any]:
    plugins = [{"name": "throttle"}, {"name": "routing"}]
    return base_config([upstream_url], plugins=plugins, batches=batches_section(batch_names))


def test_a_refused_batch_pauses_rather_than_trying_each_line(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """Every line refused for 1 s, each refusal saying to wait 200 ms: the batch completes, and the lines
    were tried about once per wait (plus the runs already started when the first refusal came), not each
    line over and over."""
    Throttle.wait_ms, Throttle.refused = 200, 0
    lines = [chat_line(f"t-{i}", "hi", max_tokens=3) for i in range(40)]
    with gateway_factory(throttled_config(upstream_url, batch_names), plugins={"throttle": Throttle}) as (_, server):
        client = sdk(server, "sk-any")
        Throttle.until = time.monotonic() + 1.0
        batch = start(client, lines)
        done = wait_for(client, batch.id, ("completed",), timeout_s=30)
    assert (done.request_counts.completed, done.request_counts.failed) == (40, 0)
    # at most a round of started lines per wait (max_in_flight 16) over the 1 s: far below 40 lines x 5 waits
    assert 1 <= Throttle.refused <= 16 * 7, Throttle.refused


def test_a_wait_longer_than_the_batchs_window_is_the_lines_result(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """A refusal whose wait outlasts the 24 h window (a monthly budget spent) cannot be waited out: the
    line's result is the 429, as a live request got it."""
    Throttle.wait_ms, Throttle.refused = 48 * 3600 * 1000, 0
    with gateway_factory(throttled_config(upstream_url, batch_names), plugins={"throttle": Throttle}) as (_, server):
        client = sdk(server, "sk-any")
        Throttle.until = time.monotonic() + 3600
        batch = start(client, [chat_line("w-1", "hi", max_tokens=3)])
        done = wait_for(client, batch.id, ("completed",), timeout_s=30)
        errors = parse_jsonl(client.files.content(done.error_file_id).content)
    assert (done.request_counts.completed, done.request_counts.failed) == (0, 1)
    [line] = errors
    assert line["custom_id"] == "w-1" and line["response"]["status_code"] == 429
    assert line["response"]["body"]["error"]["code"] == "rate_limit_exceeded"
    assert Throttle.refused == 1 and upstream.requests == []
