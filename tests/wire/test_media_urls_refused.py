"""Media URLs pointing inside the network are refused before a worker (which fetches them) sees them;
the gateway itself never fetches a client's URL."""

from __future__ import annotations

import socket
import threading
from typing import Any

import httpx
import pytest

from gateway.wire.media_urls import url_problem
from tests.support.fakes import FakeUpstream

INTERNAL = [
    "http://127.0.0.1:6379/",
    "http://127.1/x.png",
    "http://0x7f.0.0.1/x.png",
    "http://2130706433/x.png",
    "http://017700000001/x.png",
    "http://0.0.0.0/x.png",
    "http://169.254.169.254/latest/meta-data/iam/security-credentials/",
    "http://[::1]/x.png",
    "http://[::ffff:127.0.0.1]/x.png",
    "http://[fd00::1]/x.png",
    "http://10.0.0.5/x.png",
    "http://192.168.1.1/x.png",
    "http://172.16.0.1/x.png",
    "http://100.64.0.1/x.png",
    "https://localhost/x.png",
    "https://LOCALHOST./x.png",
    "http://api.localhost/x.png",
    "http://redis:6379/",
    "http://vllm-0/v1/pause",
    "http://metadata.google.internal/computeMetadata/v1/",
    "http://worker.default.svc.cluster.local/x",
    "http://printer.local/x",
    "http://user:pass@127.0.0.1/x.png",
    "file:///etc/passwd",
    "ftp://example.com/x.png",
    "gopher://127.0.0.1:6379/_FLUSHALL",
    "/etc/passwd",
    "http://[not-an-ip/x",
]
PUBLIC = ["https://images.example.com/cat.png", "http://93.184.215.14/cat.png", "data:image/png;base64,iVBORw0KGgo="]


@pytest.mark.parametrize("url", INTERNAL)
def test_internal_urls_have_a_problem(url: str) -> None:
    assert url_problem(url) is not None


@pytest.mark.parametrize("url", PUBLIC)
def test_public_and_data_urls_are_fine(url: str) -> None:
    assert url_problem(url) is None


def _chat(url: str, field: str = "image_url") -> dict[str, Any]:
    value: Any = {"url": url} if field != "input_image" else url
    return {
        "model": "m1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": field, field: value}]},
        ],
    }


class Listener:
    """A loopback socket that counts connections: proof of whether anyone fetched a URL."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.connections = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.connections += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
        self.sock.close()


@pytest.mark.parametrize("field", ["image_url", "audio_url", "video_url", "input_image"])
def test_internal_media_url_is_refused_and_nobody_fetches_it(gateway: Any, upstream: FakeUpstream, field: str) -> None:
    listener = Listener()
    try:
        url = f"http://127.0.0.1:{listener.port}/secret.png"
        response = httpx.post(gateway.url + "/v1/chat/completions", json=_chat(url, field))
    finally:
        listener.close()
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "url_not_allowed"
    assert error["param"] == f"messages[1].content[1].{field}"
    assert listener.connections == 0
    assert upstream.requests == []


def test_public_url_is_passed_to_the_worker_untouched_and_not_fetched(gateway: Any, upstream: FakeUpstream) -> None:
    body = _chat("https://images.example.com/cat.png")
    response = httpx.post(gateway.url + "/v1/chat/completions", json=body)
    assert response.status_code == 200
    assert upstream.requests[-1].body["messages"] == body["messages"]
