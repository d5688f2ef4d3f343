"""``gateway serve`` does not name the software that serves it: no ``server: uvicorn`` header on the public
port or the admin port (``Settings.server_options``), while the ``date`` header HTTP/1.1 asks of an origin
server stays. Checked on a real ``gateway serve`` process, the way operators run it."""

from __future__ import annotations

from pathlib import Path

import httpx

from gateway.ops.settings import Settings
from tests.support.fakes import free_port
from tests.support.faults import answers, wait_for
from tests.support.serve import gateway_process

TOKEN = "serve-header-admin-token"


def test_server_options_are_the_proxy_options_without_the_server_header() -> None:
    settings = Settings(forwarded_allow_ips="10.0.0.0/8")
    assert settings.server_options() == {**settings.proxy_options(), "server_header": False}


def test_neither_port_names_the_server(upstream_url: str, tmp_path: Path) -> None:
    admin_port = free_port()
    with gateway_process(upstream_url, tmp_path, GATEWAY_ADMIN_PORT=str(admin_port), GATEWAY_ADMIN_TOKEN=TOKEN) as port:
        public, admin = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{admin_port}"
        wait_for(lambda: answers(admin + "/health"), 30, "the admin port")
        chat = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}
        answers_seen = [
            httpx.get(public + "/health", timeout=5),
            httpx.post(public + "/v1/chat/completions", json={"model": "m1", "messages": []}, timeout=5),  # a 400
            httpx.post(public + "/v1/chat/completions", json=chat, timeout=10),
            httpx.get(admin + "/admin/config", headers={"authorization": f"Bearer {TOKEN}"}, timeout=5),
        ]
    assert [r.status_code for r in answers_seen] == [200, 400, 200, 200]
    assert [r.headers.get("server") for r in answers_seen] == [None] * 4
    assert all(r.headers.get("date") for r in answers_seen)
