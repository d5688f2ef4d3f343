"""The OpenAI SDK's whole batch flow against the gateway on the fake worker: upload, create, poll,
download the output and the errors; every line went through the pipeline to the worker."""

from __future__ import annotations

import time
from typing import Any

import openai
import pytest
import redis

from gateway.batch.runner import Runner
from tests.support.batches import batches_section, chat_line, jsonl, parse_jsonl, wait_for
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config


def sdk(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)


def test_the_sdk_runs_a_batch_end_to_end(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    config = base_config([upstream_url], batches=batches_section(batch_names))
    lines = [chat_line(f"req-{i}", f"question {i}", max_tokens=5) for i in range(6)]
    lines.append(b"{not json")
    lines.append(chat_line("unknown-model", "hi", model="no-such-model"))
    with gateway_factory(config) as (_, server):
        client = sdk(server.url)
        uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == len(jsonl(lines))
        assert client.files.content(uploaded.id).content == jsonl(lines)
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"k": "v"}
        )
        assert batch.status == "validating" and batch.metadata == {"k": "v"}
        done = wait_for(client, batch.id, ("completed", "failed"))
        assert done.status == "completed", done
        assert done.request_counts is not None
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (8, 6, 2)
        assert done.output_file_id and done.error_file_id and done.completed_at and done.in_progress_at
        output = parse_jsonl(client.files.content(done.output_file_id).content)
        errors = parse_jsonl(client.files.content(done.error_file_id).content)
    assert sorted(o["custom_id"] for o in output) == [f"req-{i}" for i in range(6)]
    assert all(o["response"]["status_code"] == 200 for o in output)
    assert {o["response"]["body"]["choices"][0]["message"]["content"] for o in output} == {upstream.behavior.text}
    by_id = {e["custom_id"]: e for e in errors}
    assert set(by_id) == {None, "unknown-model"}
    assert by_id[None]["error"]["code"] == "invalid_json" and by_id[None]["response"] is None
    refused = by_id["unknown-model"]["response"]
    assert refused["status_code"] == 404 and refused["body"]["error"]["code"] == "model_not_found"
    asked = sorted(r.body["messages"][0]["content"] for r in upstream.requests if r.path == "/v1/chat/completions")
    assert asked == sorted(f"question {i}" for i in range(6))  # each line once, the bad ones never


def test_a_files_content_is_served_nosniff(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """What a tenant uploaded comes back as bytes a browser must not sniff: without ``nosniff`` it would run
    a file as a script of the gateway's origin (where the console may be served) if a page asked it to."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    with gateway_factory(config) as (_, server):
        client = sdk(server.url)
        uploaded = client.files.create(file=("x.jsonl", b"window.__pwned = 1;\n"), purpose="batch")
        answer = client.files.with_raw_response.content(uploaded.id)
        assert answer.headers["content-type"] == "application/octet-stream"
        assert answer.headers["x-content-type-options"] == "nosniff"
        assert answer.content == b"window.__pwned = 1;\n"


def test_a_finished_batch_keeps_its_results_in_its_files_only(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """Redis holds the lines and results of unfinished batches only (what the file store's sizing guide
    counts on): once a batch's output and error files are written, nothing of its work stays in Redis, not
    even until the files expire, and the files still serve every line."""
    config = base_config([upstream_url], batches=batches_section(batch_names))
    lines = [chat_line("answered", "hi"), chat_line("refused", "hi", model="no-such-model")]
    with gateway_factory(config) as (_, server):
        client = sdk(server.url)
        uploaded = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        done = wait_for(client, batch.id, ("completed",))
        assert done.output_file_id and done.error_file_id
        output = parse_jsonl(client.files.content(done.output_file_id).content)
        errors = parse_jsonl(client.files.content(done.error_file_id).content)
        with redis.Redis() as redis_client:
            left = sorted(redis_client.scan_iter(match=f"{batch_names['prefix']}:b:{batch.id}:*"))
    assert left == []
    assert [o["custom_id"] for o in output] == ["answered"] and [e["custom_id"] for e in errors] == ["refused"]


def test_a_finished_line_does_not_cost_a_round_over_every_batch(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Lines finishing one at a time (``max_in_flight`` 1) over 20 running batches: each finished line
    starts the next one from the batches the last round found (a refill), not a whole round that reads
    every running batch from Redis. Whole rounds come with each batch created and every poll interval.
    (``bench/bench_batch_runner.py`` measures what the rounds cost: it grew with the number of batches.)"""
    rounds: list[float] = []
    tick = Runner.tick

    async def counted(self: Runner) -> None:
        rounds.append(time.monotonic())
        await tick(self)

    monkeypatch.setattr(Runner, "tick", counted)
    batches, per = 20, 10
    config = base_config([upstream_url], batches=batches_section(batch_names, max_in_flight=1, poll_interval_s=0.5))
    with gateway_factory(config) as (_, server):
        client = sdk(server.url)
        ids = []
        for b in range(batches):
            lines = [chat_line(f"b{b}-{i}", "hi", max_tokens=2) for i in range(per)]
            source = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
            ids.append(client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions",
                                             completion_window="24h").id)  # fmt: skip
        done = [wait_for(client, batch_id, ("completed",)) for batch_id in ids]
    assert all(d.request_counts.completed == per for d in done)
    assert len(upstream.requests) == batches * per
    # before: a round per finished line (at least 200); now about one per batch created and per 0.5 s
    elapsed = rounds[-1] - rounds[0]
    assert len(rounds) <= batches + 2 * elapsed / 0.5 + 5, (len(rounds), elapsed)
