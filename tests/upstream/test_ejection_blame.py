"""Ejection counts only the worker's own failures, and one tenant alone cannot eject a worker that
others use: through the gateway (real sockets, the fake worker, tenancy on real Redis) and on the
table itself."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from gateway.server.app import GatewayApp
from gateway.upstream.workers import Worker, WorkerTable
from plugins.tenancy.keys import hash_key
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metered import MeteredWorker
from tests.support.tenancy import PEPPER, prefix

__all__ = ["prefix"]  # the fixture, used by name


def test_one_source_cannot_eject_a_worker_another_source_uses() -> None:
    table = WorkerTable(eject_after_failures=3)
    shared = Worker(url="http://shared:1")
    table.report_success(shared, "b")  # tenant b uses the worker
    for _ in range(10):
        table.report_failure(shared, "http 500", "a", min_sources=2)
    assert shared.available() and shared.ejections == 0
    table.report_failure(shared, "http 500", "b", min_sources=2)  # now two tenants see it fail
    assert not shared.available()

    alone = Worker(url="http://alone:1")  # only one tenant uses it: its failures are enough
    for _ in range(3):
        table.report_failure(alone, "http 500", "a", min_sources=2)
    assert not alone.available()

    refused = Worker(url="http://refused:1")  # a refused connection names no tenant: always counts
    table.report_success(refused, "b")
    for _ in range(3):
        table.report_failure(refused, "connect")
    assert not refused.available()


@pytest.fixture
def metered() -> Iterator[tuple[MeteredWorker, ServerThread]]:
    worker = MeteredWorker()
    with ServerThread(worker) as server:
        yield worker, server


def tenancy_config(prefix: str, url: str) -> dict[str, Any]:
    keys = [{"id": f"k-{t}", "tenant": t, "hash": hash_key(f"sk-gw-eject-{t}", PEPPER.encode())} for t in "ab"]
    return base_config(
        [url], plugins=[{"name": "tenancy", "config": {"redis_prefix": prefix, "keys": keys}}, {"name": "routing"}]
    )


def ask(server: ServerThread, tenant: str, words: str) -> int:
    body = {"model": "m1", "messages": [{"role": "user", "content": words}], "max_tokens": 2}
    headers = {"authorization": f"Bearer sk-gw-eject-{tenant}"}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=headers, timeout=30).status_code


def worker_of(app: GatewayApp) -> Worker:
    (worker,) = app.state.services.workers.all()
    return worker


def test_one_tenants_failing_requests_cannot_eject_the_worker_for_all(
    gateway_factory: GatewayFactory, metered: tuple[MeteredWorker, ServerThread], prefix: str
) -> None:
    with gateway_factory(tenancy_config(prefix, metered[1].url)) as (app, server):
        assert ask(server, "b", "rid-b0") == 200
        codes = [ask(server, "a", f"rid-a{i} fault-500") for i in range(8)]  # a's requests make the engine fail
        assert set(codes) == {502}
        assert worker_of(app).ejections == 0
        assert ask(server, "b", "rid-b1") == 200  # b is still served
        for i in range(3):  # failures from both tenants: the worker is at fault
            ask(server, "a", f"rid-a-again{i} fault-500")
            ask(server, "b", f"rid-b-fails{i} fault-500")
        assert worker_of(app).ejections == 1
        assert ask(server, "b", "rid-b2") == 503  # ejected: no healthy worker


def test_a_long_non_streamed_request_timing_out_is_not_held_against_the_worker(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    config["upstream"]["first_byte_timeout_s"] = 0.3
    body = {"model": "m1", "messages": [{"role": "user", "content": "write a novel"}], "max_tokens": 4000}
    with gateway_factory(config) as (app, server):
        url = server.url + "/v1/chat/completions"
        upstream.behavior.delay_s = 0.6  # the worker answers after the whole generation
        codes = [httpx.post(url, json=body, timeout=30).status_code for _ in range(5)]
        assert codes == [504] * 5
        assert worker_of(app).ejections == 0 and worker_of(app).available()
        # a stream's first byte comes before its generation: the same wait is the worker's failure
        codes = [httpx.post(url, json={**body, "stream": True}, timeout=30).status_code for _ in range(3)]
        assert codes == [504] * 3
        assert worker_of(app).ejections == 1


def test_a_stream_whose_first_byte_is_far_slower_than_usual_counts_against_its_worker(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url])
    config["upstream"].update(slow_first_byte_min_s=0.5, slow_first_byte_factor=5)
    body = {"model": "m1", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with gateway_factory(config) as (app, server):
        url = server.url + "/v1/chat/completions"
        for _ in range(3):  # the model's usual first byte: milliseconds
            assert httpx.post(url, json=body, timeout=30).status_code == 200
        assert worker_of(app).consecutive_failures == 0
        upstream.behavior.delay_s = 0.8  # answered, but far slower than usual and over the 0.5 s floor
        assert httpx.post(url, json=body, timeout=30).status_code == 200
        worker = worker_of(app)
        assert worker.last_error == "slow first byte" and worker.consecutive_failures == 1  # not reset by its end
