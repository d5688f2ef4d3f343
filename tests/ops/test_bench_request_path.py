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
    try:
        assert child.wait(timeout=240) == 0, "a run with an answer other than 200 exits non-zero"
        result = json.loads(out.read_text())
        assert result["cpu_us_per_req"] > 0 and result["req_per_s"] > 0
        if peer == "production":
            assert _run_keys(client, child.pid), "the production set stored cache entries and counters"
    finally:
        child.kill()
        _delete_run_keys(client, child.pid)


def _run_keys(client: redis.Redis, pid: int) -> list[bytes]:
    """The keys a run stored: its cache namespace and tenancy prefix name its process."""
    return list(client.scan_iter(match=f"gwbench:*run{pid}:*"))


def _delete_run_keys(client: redis.Redis, pid: int) -> None:
    keys = _run_keys(client, pid)
    if keys:
        client.delete(*keys)
    client.close()


def test_a_run_whose_cache_went_unasked_fails(health_url: str) -> None:
    """The Redis bounds are wall-clock bounds: under valgrind the cache's ran out, its breaker opened and
    requests went past the cache, so the production set was counted without it. A run in which the cache
    did not count every request as a miss fails rather than report that (here: a bound nothing meets)."""
    code = (
        "import sys, uvloop; sys.path.insert(0, 'bench'); import bench_request_path as bench;"
        "bench.REDIS_BOUNDS['cache'] = {'timeout_ms': 0.001};"
        f"uvloop.run(bench.drive('production', {health_url!r}, 32, 0, 4))"
    )
    env = {"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}
    child = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True)
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        _, stderr = child.communicate(timeout=240)
        assert child.returncode != 0
        assert "the cache missed 0 of 32 requests" in stderr
    finally:
        child.kill()
        _delete_run_keys(client, child.pid)


def test_a_failed_child_reason_reaches_the_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The child's own output goes nowhere (the access log would drown it): why it failed comes back in its
    result file, and the parent's exit says it, with the end of valgrind's log when there is one."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the script's sibling imports
    bench = load_script(SCRIPT)
    out = tmp_path / "result.json"
    out.write_text(json.dumps({"error": "answers other than 200: {b'503': 3}"}))
    with pytest.raises(SystemExit, match=r"production: answers other than 200: \{b'503': 3\}\nlog tail"):
        bench.child_result("production", out, 1, "log tail")
    with pytest.raises(SystemExit, match=r"^routing: exit status 1$"):
        bench.child_result("routing", tmp_path / "never-written.json", 1)
    out.write_text(json.dumps({"cpu_us_per_req": 1.5, "req_per_s": 2.0}))
    assert bench.child_result("routing", out, 0) == {"cpu_us_per_req": 1.5, "req_per_s": 2.0}
