"""bench/bench_request_path.py drives the real app (its lifespan, the front door, the plugins, real Redis)
with in-process clients and an in-process worker: each peer's run answers every request with a 200 (the
run fails otherwise) and measures something, and it leaves no key behind in Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.support.scripts import load_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "bench_request_path.py"


@pytest.fixture(scope="module")
def health_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The mock worker (bench/peers.py starts it and waits for it), for the gateway's health checks only."""
    peers = load_script(REPO / "bench" / "peers.py")
    mock = peers.start_mock(tmp_path_factory.mktemp("mock"), 0.0, 16)
    try:
        yield mock.url
    finally:
        mock.stop()


@pytest.mark.parametrize("stream", [False, True], ids=["answers", "streams"])
@pytest.mark.parametrize("peer", ["routing", "production"])
def test_each_peer_answers_every_request_and_cleans_up(
    peer: str, stream: bool, health_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPT), "--child", peer, "--out", str(out), "--health-url", health_url]
    cmd += ["--requests", "64", "--warmup", "16", "--concurrency", "4", *(["--stream"] if stream else [])]
    child = subprocess.Popen(cmd, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    client = redis.Redis(host="127.0.0.1", port=6379)
    pattern = f"gwbench:*run{child.pid}:*"  # the run's cache namespace and tenancy prefix
    try:
        assert child.wait(timeout=240) == 0, "a run with an answer other than 200 exits non-zero"
        result = json.loads(out.read_text())
        assert result["cpu_us_per_req"] > 0 and result["req_per_s"] > 0
        if peer == "production":
            assert list(client.scan_iter(match=pattern)), "the production set stored cache entries and counters"
    finally:
        child.kill()
        keys = list(client.scan_iter(match=pattern))
        if keys:
            client.delete(*keys)
        client.close()
