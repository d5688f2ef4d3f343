"""Batch lines use idle capacity only: while interactive requests hold the model's admission at the
configured share, no line is sent; once they finish, the batch runs, each line with the engine priority
the config names (the interactive requests without one)."""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import openai

from gateway.batch.runner import rotated_after
from tests.support.batches import batches_section, chat_line, start, wait_for
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config


def test_lines_wait_while_interactive_traffic_holds_the_model(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    routing = {"name": "routing", "config": {"default": {"admission": {"max_in_flight": 4, "max_queue": 8}}}}
    section = batches_section(batch_names, admission_share=0.5, engine_priority=7)
    config = base_config([upstream_url], plugins=[routing], batches=section)
    upstream.behavior.hold = threading.Event()
    replies: list[int] = []
    with gateway_factory(config) as (_, server):
        body = {"model": "m1", "messages": [{"role": "user", "content": "interactive"}]}

        def interactive() -> None:
            replies.append(httpx.post(server.url + "/v1/chat/completions", json=body, timeout=30).status_code)

        users = [threading.Thread(target=interactive) for _ in range(2)]
        for user in users:
            user.start()
        while len(upstream.requests) < 2:  # both hold a slot: the model is at half its max_in_flight
            time.sleep(0.01)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        batch = start(client, [chat_line(f"b-{i}", "batch") for i in range(3)])
        wait_for(client, batch.id, ("in_progress",))
        time.sleep(20 * 0.05)  # twenty rounds of the runner: none may send a line
        assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["interactive"] * 2
        upstream.behavior.hold.set()
        for user in users:
            user.join(timeout=30)
        done = wait_for(client, batch.id, ("completed",))
    assert replies == [200, 200] and done.request_counts.completed == 3  # type: ignore[union-attr]
    lines = [r.body for r in upstream.requests if r.body["messages"][0]["content"] == "batch"]
    assert [line.get("priority") for line in lines] == [7, 7, 7]
    assert all("priority" not in r.body for r in upstream.requests[:2])


def test_batches_take_turns(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """A large batch does not starve a small one created after it: lines are claimed one batch at a time."""
    config = base_config([upstream_url], batches=batches_section(batch_names, max_in_flight=1))
    upstream.behavior.hold = threading.Event()
    with gateway_factory(config) as (_, server):
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        ids = []
        for name, size in (("big", 8), ("small", 2)):
            ids.append(start(client, [chat_line(f"{name}-{i}", name) for i in range(size)]).id)
            wait_for(client, ids[-1], ("in_progress",))
        upstream.behavior.hold.set()  # the big batch's first line was held until both were running
        for batch_id in ids:
            wait_for(client, batch_id, ("completed",))
    order = [r.body["messages"][0]["content"] for r in upstream.requests]
    assert order[0] == "big" and order[1:5].count("small") == 2, order


def test_the_turn_carries_over_between_rounds() -> None:
    """Each round starts after the batch served last, wrapping around, so a one-line-at-a-time runner
    alternates between batches whatever their ids."""
    batches: list[tuple[str, Any]] = [("batch_a", {}), ("batch_b", {}), ("batch_c", {})]
    assert [b for b, _ in rotated_after(batches, "")] == ["batch_a", "batch_b", "batch_c"]
    assert [b for b, _ in rotated_after(batches, "batch_a")] == ["batch_b", "batch_c", "batch_a"]
    assert [b for b, _ in rotated_after(batches, "batch_c")] == ["batch_a", "batch_b", "batch_c"]
    # the batch served last may have finished since: the turn goes to the next id after it
    assert [b for b, _ in rotated_after(batches[::2], "batch_b")] == ["batch_c", "batch_a"]


def send_held_interactive(server_url: str, upstream: FakeUpstream) -> threading.Thread:
    """One interactive chat request, held at the fake worker until ``upstream.behavior.hold`` is set."""
    body = {"model": "m1", "messages": [{"role": "user", "content": "interactive"}]}
    user = threading.Thread(target=lambda: httpx.post(server_url + "/v1/chat/completions", json=body, timeout=30))
    user.start()
    while not upstream.requests:
        time.sleep(0.01)
    return user


def test_the_batch_shrinks_while_interactive_requests_run_and_grows_back_when_quiet(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    """No admission limit configured: a worker may hold 8 requests. While one interactive request runs,
    the batch sends one line (``busy_lines_per_worker``), not seven; once quiet, the rest go together."""
    section = batches_section(batch_names, busy_lines_per_worker=1, interactive_quiet_s=0.5)
    config = base_config([upstream_url], batches=section)
    upstream.behavior.hold = threading.Event()
    with gateway_factory(config) as (_, server):
        user = send_held_interactive(server.url, upstream)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        batch = start(client, [chat_line(f"b-{i}", "batch") for i in range(6)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(upstream.requests) < 2:  # the first line goes out
            time.sleep(0.02)
        time.sleep(20 * 0.05)  # twenty more rounds of the runner: no second line may go
        sent = [r.body["messages"][0]["content"] for r in upstream.requests]
        assert sent == ["interactive", "batch"], sent
        first, upstream.behavior.hold = upstream.behavior.hold, threading.Event()  # later lines are held anew
        first.set()  # the interactive request and the first line finish: the workers go quiet
        user.join(timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(upstream.requests) < 7:
            time.sleep(0.02)
        # after the quiet period the other five lines went out together, all held at the worker at once
        assert [r.body["messages"][0]["content"] for r in upstream.requests[2:]] == ["batch"] * 5
        upstream.behavior.hold.set()
        done = wait_for(client, batch.id, ("completed",))
    assert done.request_counts.completed == 6  # type: ignore[union-attr]


def test_interactive_traffic_does_not_shrink_the_batch_when_the_quiet_period_is_zero(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, batch_names: dict[str, Any]
) -> None:
    section = batches_section(batch_names, busy_lines_per_worker=1, interactive_quiet_s=0)
    config = base_config([upstream_url], batches=section)
    upstream.behavior.hold = threading.Event()
    with gateway_factory(config) as (_, server):
        user = send_held_interactive(server.url, upstream)
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        batch = start(client, [chat_line(f"b-{i}", "batch") for i in range(4)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and len(upstream.requests) < 5:
            time.sleep(0.02)
        assert [r.body["messages"][0]["content"] for r in upstream.requests] == ["interactive"] + ["batch"] * 4
        upstream.behavior.hold.set()
        user.join(timeout=30)
        wait_for(client, batch.id, ("completed",))
