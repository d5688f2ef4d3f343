"""Durable and exactly-once across replicas, with gateways as real processes: a replica SIGKILLed in the
middle of a batch loses nothing (restarted, it resumes the batch; or a second replica takes its leased
lines over), and every custom_id appears exactly once in the output, however many replicas ran it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson

from tests.support.batches import batches_section, chat_line, jsonl, parse_jsonl, wait_for
from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import REPO, GatewayFactory, base_config

LINES = 30


@contextlib.contextmanager
def replica(config: dict[str, Any], tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """``gateway serve`` in its own process; killed (if still alive) on the way out."""
    path = tmp_path / f"config-{free_port()}.yaml"
    path.write_bytes(orjson.dumps(config))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO), "GATEWAY_LOG_LEVEL": "WARNING"}
    command = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--port", str(port)]
    proc = subprocess.Popen([*command, "--no-managed-workers"], env=env, stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            assert proc.poll() is None, "the replica exited during start-up"
            assert time.monotonic() < deadline, "the replica did not start"
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def start_batch(client: openai.OpenAI) -> str:
    lines = [chat_line(f"id-{i}", f"line {i}") for i in range(LINES)]
    source = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    return client.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h").id


def kill_midway(proc: subprocess.Popen[bytes], client: openai.OpenAI, batch_id: str) -> None:
    """SIGKILL the replica once some lines are done and most are not."""
    deadline = time.monotonic() + 60
    while True:
        batch = client.batches.retrieve(batch_id)
        assert batch.request_counts is not None
        if batch.request_counts.completed >= 4:
            break
        assert time.monotonic() < deadline, batch
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert batch.status == "in_progress" and batch.request_counts.completed < LINES


def check_exactly_once(client: openai.OpenAI, batch_id: str, upstream: FakeUpstream) -> None:
    done = wait_for(client, batch_id, ("completed",), timeout_s=120)
    output = parse_jsonl(client.files.content(done.output_file_id).content)
    assert sorted(line["custom_id"] for line in output) == sorted(f"id-{i}" for i in range(LINES))
    assert done.error_file_id is None
    assert (done.request_counts.total, done.request_counts.completed) == (LINES, LINES)
    sent = {r.body["messages"][0]["content"] for r in upstream.requests}
    assert sent == {f"line {i}" for i in range(LINES)}  # every line reached the worker (some twice)


def test_a_replica_killed_midway_and_restarted_resumes_its_batch(
    upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any], tmp_path: Path
) -> None:
    upstream.behavior.delay_s = 0.1
    config = base_config([upstream_url], batches=batches_section(batch_names, lease_s=1, max_in_flight=2))
    with replica(config, tmp_path) as (proc, url):
        client = sdk(url)
        batch_id = start_batch(client)
        kill_midway(proc, client, batch_id)
    with replica(config, tmp_path) as (_, url):
        check_exactly_once(sdk(url), batch_id, upstream)


def test_a_second_replica_takes_over_the_lines_of_a_killed_one(
    gateway_factory: GatewayFactory,
    upstream: FakeUpstream,
    upstream_url: str,
    batch_names: dict[str, Any],
    tmp_path: Path,
) -> None:
    upstream.behavior.delay_s = 0.1
    config = base_config([upstream_url], batches=batches_section(batch_names, lease_s=1, max_in_flight=2))
    with gateway_factory(config) as (_, survivor), replica(config, tmp_path) as (proc, url):
        client = sdk(url)
        batch_id = start_batch(client)  # both replicas run its lines, until one is killed
        kill_midway(proc, client, batch_id)
        check_exactly_once(sdk(survivor.url), batch_id, upstream)


def test_two_live_replicas_share_a_batch_without_running_a_line_twice(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    upstream.behavior.delay_s = 0.02
    config = base_config([upstream_url], batches=batches_section(batch_names, max_in_flight=3))
    with gateway_factory(config) as (_, one), gateway_factory(config) as (_, two):
        batch_id = start_batch(sdk(one.url))
        check_exactly_once(sdk(two.url), batch_id, upstream)
    assert len(upstream.requests) == LINES  # leases held: no line ran twice
