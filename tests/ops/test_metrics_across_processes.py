"""``gateway serve`` as a real process: metric totals across several uvicorn workers, one JSON access
line per request without prompt or completion text, and SIGHUP reloading the config file."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import orjson
import yaml

from tests.support.fakes import FakeUpstream, free_port
from tests.support.gateways import base_config
from tests.support.metrics import admin_scrape

TOKEN = "process-admin-token"
PROMPT = "my secret prompt words"


@contextlib.contextmanager
def serve(
    config: dict[str, Any], tmp_path: Path, *, workers: int
) -> Iterator[tuple[str, Path, subprocess.Popen[bytes]]]:
    """Run ``gateway serve`` on a free port until the block ends; yields (url, stderr file, process)."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GATEWAY_", "PROMETHEUS_"))}
    env.update(GATEWAY_ADMIN_TOKEN=TOKEN, GATEWAY_CONFIG_WATCH_S="0")
    stderr = tmp_path / "stderr.log"
    args = [sys.executable, "-m", "gateway.cli", "serve", "--config", str(path), "--host", "127.0.0.1"]
    args += ["--port", str(port), "--workers", str(workers), "--no-managed-workers"]
    with stderr.open("wb") as err:
        proc = subprocess.Popen(
            args, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=Path(__file__).resolve().parents[2]
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, stderr.read_text()[-3000:]
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/v1/models", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline, "gateway did not start: " + stderr.read_text()[-3000:]
            time.sleep(0.1)
        yield url, stderr, proc
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def sample(metrics: str, name: str, **labels: str) -> float:
    """The value of one sample in Prometheus text format (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in metrics.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, _, value = line.rpartition(" ")
            got = ",".join(sorted(re.findall(r'\w+="[^"]*"', head)))
            if got == want:
                return float(value)
    return 0.0


def test_totals_and_access_lines_across_two_worker_processes(
    upstream: FakeUpstream, upstream_url: str, tmp_path: Path
) -> None:
    upstream.behavior.delay_s = 0.02
    upstream.behavior.pace_s = 0.01  # stream events arrive apart, as a decoding worker sends them
    n_plain, n_stream = 60, 20
    chat = {"model": "m1", "messages": [{"role": "user", "content": PROMPT}]}
    with serve(base_config([upstream_url]), tmp_path, workers=2) as (url, stderr, _):

        def one(i: int) -> int:
            body = {**chat, "stream": True} if i < n_stream else chat
            # A fresh connection each time, so the kernel spreads them over both processes.
            with httpx.Client(timeout=10, limits=httpx.Limits(max_keepalive_connections=0)) as client:
                r = client.post(url + "/v1/chat/completions", json=body)
                return r.status_code

        with ThreadPoolExecutor(8) as pool:
            statuses = list(pool.map(one, range(n_plain + n_stream)))
        assert statuses == [200] * (n_plain + n_stream)

        for _ in range(3):  # any process may answer the scrape; each must see the whole total
            metrics = admin_scrape(url, TOKEN, close=True)  # per-model series are the admin's
            labels = {"model": "m1", "route": "chat/completions", "status": "200"}
            assert sample(metrics, "gateway_requests_total", **labels) == n_plain + n_stream
            assert sample(metrics, "gateway_request_duration_seconds_count", model="m1", route="chat/completions") == (
                n_plain + n_stream
            )
            assert sample(metrics, "gateway_tokens_total", model="m1", kind="completion") == 3 * n_plain
            assert sample(metrics, "gateway_time_to_first_token_seconds_count", model="m1") == n_stream
            assert sample(metrics, "gateway_time_per_output_token_seconds_count", model="m1") == n_stream
            assert sample(metrics, "gateway_in_flight_requests", model="m1") == 0
        time.sleep(0.3)  # let the last access lines reach the file

    lines = [orjson.loads(line) for line in stderr.read_text().splitlines() if line.startswith("{")]
    access = [line for line in lines if line.get("logger") == "gateway.access" and line["msg"] == "request"]
    assert len(access) == n_plain + n_stream
    assert len({line["pid"] for line in access}) == 2  # both worker processes served (and logged)
    assert len({line["request_id"] for line in access}) == n_plain + n_stream
    for line in access:
        assert line["model"] == "m1" and line["status"] == 200 and line["route"] == "chat/completions"
        assert line["worker"] == upstream_url and line["duration_ms"] > 0
        assert "prompt" not in line and "completion" not in line
    assert sum(1 for line in access if line.get("usage", {}).get("completion_tokens") == 3) == n_plain
    assert sum(1 for line in access if line["stream"] and "ttft_ms" in line) == n_stream
    text = stderr.read_text()
    assert PROMPT not in text and upstream.behavior.text not in text


def test_sighup_reloads_the_config_file(upstream: FakeUpstream, upstream_url: str, tmp_path: Path) -> None:
    with serve(base_config([upstream_url]), tmp_path, workers=1) as (url, _, proc):
        admin = {"authorization": f"Bearer {TOKEN}"}
        before = httpx.get(url + "/admin/config", headers=admin).json()["version"]
        changed = base_config([upstream_url])
        changed["models"][0]["aliases"] = ["alias-1", "after-sighup"]
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(changed))
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while httpx.get(url + "/admin/config", headers=admin).json()["version"] == before:
            assert time.monotonic() < deadline, "SIGHUP did not reload the config"
            time.sleep(0.05)
        shown = httpx.get(url + "/admin/config", headers=admin).json()
        assert shown["source"] == "sighup"
        assert httpx.get(url + "/v1/models/after-sighup").status_code == 200
        # A broken file on SIGHUP is refused; the process keeps serving the last good config.
        (tmp_path / "config.yaml").write_text("models: [broken\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.5)
        assert proc.poll() is None
        assert httpx.get(url + "/admin/config", headers=admin).json()["version"] == shown["version"]
