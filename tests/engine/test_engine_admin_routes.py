"""The app's engine wiring: managed workers started by the lifespan show in ``GET /admin/engine`` and their
lifecycle events in ``gateway_engine_worker_events_total``.

The worker is a managed one launched through the real spec -> launch -> supervisor path; only the
interpreter is a stand-in (a tiny HTTP server with /health and /crash in place of vLLM's OpenAI server),
so no model or vLLM start-up is needed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import create_app
from tests.support.fakes import ServerThread, free_port
from tests.support.metrics import admin_scrape

TOKEN = "engine-admin-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}

# Called as `PYTHON -m vllm.entrypoints.openai.api_server --model ... --port N ...`: ignores what it does not
# know, answers /health, exits with code 3 on /crash.
FAKE_VLLM = textwrap.dedent(
    """
    import argparse, http.server, os
    p = argparse.ArgumentParser()
    p.add_argument("-m")
    p.add_argument("--port", type=int, required=True)
    args, _ = p.parse_known_args()
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/crash":
                os._exit(3)
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", args.port), H).serve_forever()
    """
)


@pytest.fixture
def managed(tmp_path: Path) -> Iterator[tuple[ServerThread, str]]:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_VLLM)
    interpreter = tmp_path / "python"
    interpreter.write_text(f'#!/bin/sh\nexec {sys.executable} {script} "$@"\n')
    interpreter.chmod(0o755)
    model = tmp_path / "model"
    model.mkdir()
    for name, content in {"config.json": "{}", "model.safetensors": "", "tokenizer.json": "{}"}.items():
        (model / name).write_text(content)
    port = free_port()
    config = GatewayConfig.model_validate({
        "models": [{"name": "tiny", "workers": ["w0"]}],
        "engine": {"workers": [{"name": "w0", "model": str(model), "served_model_name": "tiny", "port": port,
                                "python": str(interpreter), "ready_timeout_s": 30}]},
        "plugins": [{"name": "routing"}],
        "upstream": {"health_interval_s": 0.5},
    })  # fmt: skip
    settings = Settings(admin_token=TOKEN, managed_workers=True, model_dir=tmp_path)
    app = create_app(settings, registry=PluginRegistry(), config=config)
    with ServerThread(app, start_timeout_s=60) as server:
        yield server, f"http://127.0.0.1:{port}"


def events(server: ServerThread) -> dict[str, float]:
    text = admin_scrape(server.url, TOKEN)  # per-worker series are the admin's
    prefix = 'gateway_engine_worker_events_total{event="'
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(prefix) and 'worker="w0"' in line:
            found[line[len(prefix) :].split('"', 1)[0]] = float(line.rsplit(" ", 1)[1])
    return found


def engine_status(server: ServerThread) -> dict[str, Any]:
    response = httpx.get(server.url + "/admin/engine", headers=AUTH, timeout=5)
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_admin_engine_lists_the_managed_worker(managed: tuple[ServerThread, str]) -> None:
    server, worker_url = managed
    body = engine_status(server)
    assert body["managed"] is True
    (worker,) = body["workers"]
    assert worker["name"] == "w0" and worker["model"] == "tiny" and worker["url"] == worker_url
    assert worker["state"] == "ready" and worker["restarts"] == 0
    assert isinstance(worker["pid"], int) and os.path.exists(f"/proc/{worker['pid']}")
    assert events(server) == {"ready": 1.0}


def test_admin_engine_needs_the_admin_token(managed: tuple[ServerThread, str]) -> None:
    server, _ = managed
    assert httpx.get(server.url + "/admin/engine", timeout=5).status_code == 401
    wrong = httpx.get(server.url + "/admin/engine", headers={"authorization": "Bearer nope"}, timeout=5)
    assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "invalid_admin_token"


def test_a_crash_is_counted_and_shown(managed: tuple[ServerThread, str]) -> None:
    server, worker_url = managed
    first_pid = engine_status(server)["workers"][0]["pid"]
    with contextlib.suppress(httpx.HTTPError):  # the worker dies mid-answer
        httpx.get(worker_url + "/crash", timeout=5)
    deadline = time.monotonic() + 30
    while events(server).get("restarted", 0) < 1:
        assert time.monotonic() < deadline, f"no restart within 30 s: {events(server)}"
        time.sleep(0.2)
    seen = events(server)
    assert seen["exited"] == 1 and seen["restarting"] == 1 and seen["restarted"] == 1
    (worker,) = engine_status(server)["workers"]
    assert worker["state"] == "ready" and worker["restarts"] == 1 and worker["last_exit_code"] == 3
    assert worker["pid"] != first_pid


def test_without_managed_workers_the_list_is_empty(tmp_path: Path, upstream_url: str) -> None:
    config = GatewayConfig.model_validate({"models": [{"name": "m", "workers": [upstream_url]}]})
    app = create_app(Settings(admin_token=TOKEN), registry=PluginRegistry(), config=config, engine_factory=None)
    with ServerThread(app) as server:
        assert engine_status(server) == {"managed": False, "workers": []}
