"""The worker table: state kept across reloads, ejection that grows and resets, health checks whose
probe fails, discovered workers; and what a reload that removes a worker leaves behind."""

from __future__ import annotations

import asyncio
import threading

import httpx
import pytest

from gateway.upstream.workers import Worker, WorkerTable
from tests.support.fakes import FakeUpstream, ServerThread, free_port
from tests.support.faults import wait_for
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics
from tests.wire.test_error_shape import CHAT

TOKEN = "cover-workers-token"


def test_sync_keeps_the_state_of_kept_workers_and_forgets_removed_idle_ones() -> None:
    table = WorkerTable()
    table.sync(["http://a:1", "http://b:1"])
    a = table.get("http://a:1")
    table.report_failure(a, "connect")
    generation = table.generation
    table.sync(["http://a:1", "http://c:1", "http://a:1"])
    assert [w.url for w in table.all()] == ["http://a:1", "http://c:1"]
    assert table.get("http://a:1") is a and a.consecutive_failures == 1
    assert table.generation > generation


def test_ejection_grows_with_each_ejection_up_to_the_cap_and_a_success_resets_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    now = [100.0]
    monkeypatch.setattr("gateway.upstream.workers.time.monotonic", lambda: now[0])
    table = WorkerTable(eject_after_failures=2, base_ejection_s=1.0, max_ejection_s=5.0)
    changes: list[str] = []
    table.on_change.append(lambda w: changes.append(w.url))
    worker = Worker(url="http://w:1")
    holds = []
    for _ in range(5):
        table.report_failure(worker, "http 502")
        assert worker.available()  # one failure is not enough
        table.report_failure(worker, "http 502")
        assert not worker.available()
        holds.append(worker.ejected_until - now[0])
        now[0] = worker.ejected_until  # the hold is over
        assert worker.available()
    assert holds == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert worker.last_error == "http 502" and changes == ["http://w:1"] * 5
    table.report_success(worker)
    assert (worker.ejections, worker.consecutive_failures, worker.ejected_until) == (0, 0, 0.0)
    table.report_failure(worker, "x")
    table.report_failure(worker, "x")
    assert worker.ejected_until - now[0] == 1.0  # back to the first hold
    table.report_success(Worker(url="http://fresh:1"))  # nothing to reset: no change reported
    assert len(changes) == 7


async def test_a_probe_that_raises_marks_the_worker_unhealthy_with_the_exception_type() -> None:
    table = WorkerTable()
    table.sync(["http://ok:1", "http://bad:1"])

    async def probe(url: str) -> str | None:
        if "bad" in url:
            raise ConnectionResetError("boom")
        return None

    table.start_health_checks(probe, 0.01)
    await asyncio.sleep(0)  # the first round runs at once
    for _ in range(100):
        if not table.get("http://bad:1").healthy:
            break
        await asyncio.sleep(0.01)
    await table.aclose()
    bad, ok = table.get("http://bad:1"), table.get("http://ok:1")
    assert (bad.healthy, bad.last_error) == (False, "ConnectionResetError")
    assert ok.healthy and ok.checked_at > 0


async def test_health_timeouts_count_only_in_a_row_and_a_refusal_counts_at_once() -> None:
    """A busy worker answers /health late while it serves: only the third timeout in a row makes it
    unhealthy; an answer in between starts the count again. A refused connection (the process is gone)
    makes a worker unhealthy at the first check."""
    table = WorkerTable()
    table.sync(["http://busy:1", "http://gone:1"])
    script = {"http://busy:1": ["late", "late", "ok", "late", "late", "late", "ok"], "http://gone:1": ["refused"]}
    seen: dict[str, list[bool]] = {url: [] for url in script}
    done = asyncio.Event()

    async def probe(url: str) -> str | None:
        steps = script[url]
        seen[url].append(table.get(url).healthy)  # its health before this check
        step = steps.pop(0) if len(steps) > 1 else steps[0]
        if not script["http://busy:1"][1:]:
            done.set()
        if step == "late":
            raise TimeoutError
        return "ConnectionRefusedError" if step == "refused" else None

    table.start_health_checks(probe, 0.001, timeouts_before_unhealthy=3)
    await asyncio.wait_for(done.wait(), 5)
    await asyncio.sleep(0.05)  # a round or two past the end of the script
    await table.aclose()
    busy, gone = table.get("http://busy:1"), table.get("http://gone:1")
    # before each check: healthy through two timeouts, an answer, two more; unhealthy after the third; back
    assert seen["http://busy:1"][:7] == [True, True, True, True, True, True, False]
    assert busy.healthy and busy.health_timeouts == 0
    assert seen["http://gone:1"][1] is False and (gone.healthy, gone.last_error) == (False, "ConnectionRefusedError")


def test_discovered_workers_join_and_leave_with_their_ref() -> None:
    table = WorkerTable()
    table.sync(["http://static:1"])
    assert table.set_discovered("dns://svc:80", ["http://10.0.0.1:80", "http://10.0.0.1:80"])
    assert not table.set_discovered("dns://svc:80", ["http://10.0.0.1:80"])  # no change
    assert table.expand(["dns://svc:80", "dns://other:80", "http://static:1"]) == [
        "http://10.0.0.1:80",
        "http://static:1",
    ]
    generation = table.generation
    table.retain_discovered(["dns://svc:80"])  # still named: nothing changes
    assert table.generation == generation
    table.retain_discovered([])
    assert [w.url for w in table.all()] == ["http://static:1"] and table.generation > generation


# -- what a reload that removes a worker leaves behind ----------------------------------------------


def put_config(server: ServerThread, urls: list[str]) -> None:
    response = httpx.put(
        server.url + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"}, json=base_config(urls)
    )
    assert response.status_code == 200, response.text


def worker_lines(server: ServerThread, metric: str, url: str) -> list[str]:
    text = admin_metrics(server)  # per-worker series are the admin's
    return [line for line in text.splitlines() if line.startswith(f'{metric}{{worker="{url}"}}')]


def test_a_worker_removed_while_idle_leaves_the_table(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    with (
        ServerThread(FakeUpstream(name="second")) as second,
        gateway_factory(base_config([upstream_url, second.url]), admin_token=TOKEN) as (app, server),
    ):
        assert worker_lines(server, "gateway_worker_in_flight", second.url)
        put_config(server, [upstream_url])
        assert [w.url for w in app.state.services.workers.all()] == [upstream_url]
        assert worker_lines(server, "gateway_worker_in_flight", second.url) == []


def test_a_worker_removed_while_busy_leaves_the_table_when_its_requests_finish(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    busy = FakeUpstream(name="busy")
    busy.behavior.delay_s = 1.0
    with ServerThread(busy) as busy_server:
        config = base_config([busy_server.url])
        with gateway_factory(config, admin_token=TOKEN) as (app, server):
            replies: list[httpx.Response] = []
            request = threading.Thread(
                target=lambda: replies.append(httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10))
            )
            request.start()
            wait_for(lambda: len(busy.requests) == 1, 5, "the request to reach the busy worker")
            put_config(server, [upstream_url])  # the busy worker leaves the config mid-request
            request.join(timeout=10)
            assert replies[0].status_code == 200  # the request finished on its own snapshot
            assert app.state.services.workers.get(busy_server.url).in_flight == 0
            assert [w.url for w in app.state.services.workers.all()] == [upstream_url]


def test_a_removed_worker_is_no_longer_reported_healthy_or_unhealthy(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with gateway_factory(base_config([upstream_url, dead]), admin_token=TOKEN) as (_, server):
        wait_for(
            lambda: (
                worker_lines(server, "gateway_worker_healthy", dead)
                == [f'gateway_worker_healthy{{worker="{dead}"}} 0.0']
            ),
            5,
            "the dead worker to be reported unhealthy",
        )
        put_config(server, [upstream_url])
        assert worker_lines(server, "gateway_worker_healthy", upstream_url)
        assert worker_lines(server, "gateway_worker_healthy", dead) == []
