"""``gateway serve`` does not name the software that serves it: no ``server: uvicorn`` header on the public
port or the admin port (``Settings.server_options``), while the ``date`` header HTTP/1.1 asks of an origin
server stays. Checked on a real ``gateway serve`` process, the way operators run it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from gateway.ops.settings import Settings
from tests.support.fakes import free_port
from tests.support.faults import REPO, answers, gateway_env, wait_for

TOKEN = "serve-header-admin-token"


def test_server_options_are_the_proxy_options_without_the_server_header() -> None:
    settings = Settings(forwarded_allow_ips="10.0.0.0/8")
    assert settings.server_options() == {**settings.proxy_options(), "server_header": False}


@pytest.fixture
def served(tmp_path: Path, upstream_url: str) -> Iterator[tuple[str, str]]:
    """A ``gateway serve`` process with an admin port: (public URL, admin URL)."""
    config = {
        "models": [{"name": "m1", "workers": [upstream_url]}],
        "plugins": [{"name": "routing"}],
        "logging": {"level": "WARNING"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    port, admin_port = free_port(), free_port()
    env = gateway_env(
        GATEWAY_PORT=str(port),
        GATEWAY_ADMIN_PORT=str(admin_port),
        GATEWAY_ADMIN_TOKEN=TOKEN,
        GATEWAY_CONFIG_PATH=str(path),
        GATEWAY_MANAGED_WORKERS="false",
        GATEWAY_CONFIG_WATCH_S="0",
    )
    log = (tmp_path / "gateway.log").open("wb")
    proc = subprocess.Popen([str(REPO / ".venv/bin/gateway"), "serve"], cwd=tmp_path, env=env, stdout=log, stderr=log)
    public, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
    try:
        wait_for(lambda: answers(public + "/health") and answers(admin + "/health"), 60, "gateway serve to start")
        yield public, admin
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def test_neither_port_names_the_server(served: tuple[str, str]) -> None:
    public, admin = served
    answers_seen = [
        httpx.get(public + "/health", timeout=5),
        httpx.post(public + "/v1/chat/completions", json={"model": "m1", "messages": []}, timeout=5),  # an error
        httpx.post(
            public + "/v1/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
            timeout=10,
        ),
        httpx.get(admin + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5),
    ]
    assert [r.status_code for r in answers_seen] == [200, 400, 200, 200]
    assert [r.headers.get("server") for r in answers_seen] == [None] * 4
    assert all(r.headers.get("date") for r in answers_seen)
