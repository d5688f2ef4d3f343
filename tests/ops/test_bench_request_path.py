"""bench/bench_request_path.py drives the real app (its lifespan, the front door, the plugins, real Redis)
with in-process clients and an in-process worker: each peer's run answers every request with a 200 (the
run fails otherwise) and measures something, and it leaves no key behind in Redis."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    """bench/bench_request_path.py as a module."""
    monkeypatch.syspath_prepend(str(REPO / "bench"))  # the script's sibling imports
    return load_script(SCRIPT)


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


def test_a_failed_child_reason_reaches_the_parent(tmp_path: Path, bench: Any) -> None:
    """The child's own output goes nowhere (the access log would drown it): why it failed comes back in its
    result file, and the parent's exit says it, with the end of valgrind's log when there is one."""
    out = tmp_path / "result.json"
    out.write_text(json.dumps({"error": "answers other than 200: {b'503': 3}"}))
    with pytest.raises(SystemExit, match=r"production: answers other than 200: \{b'503': 3\}\nlog tail"):
        bench.child_result("production", out, 1, "log tail")
    with pytest.raises(SystemExit, match=r"^routing: exit status 1$"):
        bench.child_result("routing", tmp_path / "never-written.json", 1)
    out.write_text(json.dumps({"cpu_us_per_req": 1.5, "req_per_s": 2.0}))
    assert bench.child_result("routing", out, 0) == {"cpu_us_per_req": 1.5, "req_per_s": 2.0}


def test_a_peer_without_tenancy_needs_no_key_and_keeps_no_counters(health_url: str, tmp_path: Path) -> None:
    """``production-without-tenancy`` runs the production set but tenancy: its requests carry no key and
    are answered (tenancy would refuse them with a 401, and the run would fail), its cache still stores
    entries, and no tenancy counter is written."""
    out = tmp_path / "result.json"
    cmd = [sys.executable, str(SCRIPT), "--child", "production-without-tenancy", "--out", str(out)]
    cmd += ["--health-url", health_url, "--requests", "32", "--warmup", "8", "--concurrency", "4"]
    child = subprocess.Popen(cmd, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    client = redis.Redis(host="127.0.0.1", port=6379)
    try:
        assert child.wait(timeout=240) == 0
        assert json.loads(out.read_text())["cpu_us_per_req"] > 0
        keys = _run_keys(client, child.pid)
        assert keys, "the cache stored its entries"
        assert not [k for k in keys if k.startswith(b"gwbench:tenancy:")], "no tenancy counter"
    finally:
        child.kill()
        _delete_run_keys(client, child.pid)


def test_peers_without_plugins_name_plugins_of_the_production_set(bench: Any) -> None:
    left_out = bench.left_out
    assert left_out("production") == frozenset() and left_out("routing") == frozenset()
    assert left_out("production-without-safety") == {"safety"}
    assert left_out("production-without-tenancy+cache") == {"tenancy", "cache"}
    for wrong in ("production-without-routing", "production-without-", "production-without-safety+nope", "prod"):
        with pytest.raises(SystemExit, match="unknown peer"):
            left_out(wrong)


def test_the_table_says_what_left_out_plugins_cost(bench: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """A peer without some plugins costs the production set's median minus its own, each against the
    production set of its own source tree (``@base``: the ``--baseline-src`` copy)."""
    metric = "instructions_per_req"
    results = {
        "routing": [{metric: 100.0}],
        "production": [{metric: 300.0}, {metric: 320.0}, {metric: 310.0}],
        "production-without-tenancy": [{metric: 200.0}],
        "production@base": [{metric: 400.0}],
        "production-without-tenancy@base": [{metric: 250.0}],
    }
    bench.print_table(results, metric, "instructions/req", 3)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert rows[0].endswith("| x routing | left-out plugins cost |")
    assert rows[1:] == [
        "| routing | 100.0 | 100.0 | 1.00 | - |",
        "| production | 310.0 | 300.0, 320.0, 310.0 | 3.10 | - |",
        "| production-without-tenancy | 200.0 | 200.0 | 2.00 | 110.0 |",
        "| production@base | 400.0 | 400.0 | 4.00 | - |",
        "| production-without-tenancy@base | 250.0 | 250.0 | 2.50 | 150.0 |",
    ]
