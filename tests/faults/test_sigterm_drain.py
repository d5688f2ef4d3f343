"""SIGTERM to a real ``gateway serve`` process under load: readiness turns 503 while requests are still
served (the drain delay), then new connections are refused, every in-flight stream finishes whole, and
the process exits within its grace period."""

from __future__ import annotations

import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fakes import free_port
from tests.support.faults import REPO, WorkerProcess, error_events, gateway_env, sse_events, wait_for

DRAIN_S = 1.5
BODY = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def start_gateway(tmp_path: Path, worker_url: str, port: int, **env: str) -> subprocess.Popen[bytes]:
    config = {
        "models": [{"name": "m1", "workers": [worker_url]}],
        "plugins": [{"name": "routing"}],
        "upstream": {"health_interval_s": 0.5},
        "logging": {"level": "WARNING"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    settings = {
        "GATEWAY_PORT": str(port),
        "GATEWAY_CONFIG_PATH": str(path),
        "GATEWAY_MANAGED_WORKERS": "false",
        "GATEWAY_CONFIG_WATCH_S": "0",
        **env,
    }
    log = (tmp_path / "gateway.log").open("wb")
    return subprocess.Popen(
        [str(REPO / ".venv/bin/gateway"), "serve"], cwd=tmp_path, env=gateway_env(**settings), stdout=log, stderr=log
    )


def ready_status(url: str) -> int | None:
    """/ready's status over a new connection, or None when the connection is refused. A connection the
    kernel completed in the listen backlog just before the listener closed is reset instead of refused
    (a read error, or a disconnect before any response): that, too, is a connection not served."""
    try:
        return httpx.get(url + "/ready", timeout=2).status_code
    except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
        return None


def in_flight(url: str) -> float:
    """Requests the gateway is answering now, from its own /metrics (every model)."""
    text = httpx.get(url + "/metrics", timeout=2).text
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "gateway_in_flight_requests"
    )


def test_sigterm_drains_then_refuses_and_finishes_in_flight_streams(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # Streams of 30 chunks 0.1 s apart (3 s): they outlive the drain delay and end during shutdown.
    with WorkerProcess(chunks=30, pace_s=0.1, text="z" * 60) as worker:
        gateway = start_gateway(tmp_path, worker.url, port, GATEWAY_DRAIN_DELAY_S=str(DRAIN_S))
        try:
            wait_for(lambda: ready_status(url) == 200, 30, "the gateway to be ready")
            streams: list[list[bytes]] = []
            started = threading.Barrier(9)

            def stream() -> None:
                with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30) as r:
                    chunks = r.iter_text()
                    text = next(chunks)
                    started.wait(timeout=10)
                    text += "".join(chunks)
                streams.append(sse_events(text))

            readers = [threading.Thread(target=stream) for _ in range(8)]
            for reader in readers:
                reader.start()
            started.wait(timeout=10)  # every stream has its first bytes

            sent_at = time.monotonic()
            gateway.send_signal(signal.SIGTERM)
            wait_for(lambda: ready_status(url) == 503, DRAIN_S, "/ready to turn 503 while draining")
            draining = httpx.get(url + "/ready", timeout=2)
            served_while_draining = httpx.post(url + "/v1/chat/completions", json=BODY, timeout=10)
            wait_for(lambda: ready_status(url) is None, DRAIN_S + 5, "new connections to be refused")
            refused_after = time.monotonic() - sent_at
            gateway.wait(timeout=30)  # the grace period (uvicorn's graceful-shutdown timeout)
            exited_after = time.monotonic() - sent_at
            for reader in readers:
                reader.join(timeout=10)
        finally:
            if gateway.poll() is None:
                gateway.kill()
                gateway.wait()
    assert draining.json() == {"status": "draining"}
    assert served_while_draining.status_code == 200
    assert refused_after >= DRAIN_S * 0.9, "the listener closed before the drain delay was over"
    assert gateway.returncode in (0, -signal.SIGTERM), (tmp_path / "gateway.log").read_text()
    assert exited_after < 30
    assert len(streams) == 8
    for events in streams:
        assert events[-1] == b"[DONE]" and not error_events(events), events[-3:]
        assert len(events) >= 30  # every chunk arrived


def test_sigterm_without_drain_delay_still_finishes_in_flight_requests(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with WorkerProcess(delay_s=1.5) as worker:
        gateway = start_gateway(tmp_path, worker.url, port)
        try:
            wait_for(lambda: ready_status(url) == 200, 30, "the gateway to be ready")
            replies: list[httpx.Response] = []
            threads = [
                threading.Thread(
                    target=lambda: replies.append(httpx.post(url + "/v1/chat/completions", json=BODY, timeout=30))
                )
                for _ in range(6)
            ]
            for thread in threads:
                thread.start()
            # Signal only once the gateway has accepted all six (a request still in the listen backlog when
            # the listener closes is reset: the drain delay is what protects those, and it is 0 here).
            wait_for(lambda: in_flight(url) + len(replies) == 6, 10, "the gateway to accept all six requests")
            gateway.send_signal(signal.SIGTERM)
            wait_for(lambda: ready_status(url) is None, 3, "new connections to be refused")
            gateway.wait(timeout=30)
            for thread in threads:
                thread.join(timeout=10)
        finally:
            if gateway.poll() is None:
                gateway.kill()
                gateway.wait()
    assert [r.status_code for r in replies] == [200] * 6
    assert gateway.returncode in (0, -signal.SIGTERM)
