"""A JSON reply (answer or error) carries its content-length instead of chunked framing, under either
server uvicorn offers, and a client that pipelines requests on one connection gets each reply whole."""

from __future__ import annotations

import socket
from typing import Any

import httpx
import orjson
import pytest

from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def read_response(stream: Any) -> tuple[dict[bytes, bytes], bytes]:
    """One response off a buffered socket reader, framed by its content-length only."""
    lines = [stream.readline()]
    while lines[-1] not in (b"\r\n", b""):
        lines.append(stream.readline())
    assert lines[-1] == b"\r\n", "the connection closed before a whole head"
    fields = dict(line.rstrip(b"\r\n").lower().split(b": ", 1) for line in lines[1:-1])
    fields[b":status"] = lines[0].split(b" ")[1]
    assert b"transfer-encoding" not in fields
    return fields, stream.read(int(fields[b"content-length"]))


@pytest.mark.parametrize("http", ["gateway", "httptools", "h11"])
def test_answers_and_errors_carry_their_length(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, http: str
) -> None:
    with gateway_factory(base_config([upstream_url]), http=http) as (_, server), httpx.Client() as client:
        for _ in range(2):  # the second on the kept-alive connection
            ok = client.post(server.url + "/v1/chat/completions", json=CHAT)
            assert ok.status_code == 200 and ok.json()["choices"]
            assert ok.headers["content-length"] == str(len(ok.content))
            assert "transfer-encoding" not in ok.headers
        missing = client.post(server.url + "/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
        assert missing.headers["content-length"] == str(len(missing.content))
        assert "transfer-encoding" not in missing.headers


def test_pipelined_requests_each_get_one_whole_reply(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    ok = orjson.dumps(CHAT)
    bad = b'{"model": "m1", "messages": '  # cut short: 400
    with (
        gateway_factory(base_config([upstream_url])) as (_, server),
        socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock,
    ):
        raw = b""
        for body in (ok, bad, ok):
            raw += b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            raw += b"content-length: %d\r\n\r\n%s" % (len(body), body)
        sock.sendall(raw)  # all three at once: each waits for the reply before it
        stream = sock.makefile("rb")
        replies = [read_response(stream) for _ in range(3)]
    assert [fields[b":status"] for fields, _ in replies] == [b"200", b"400", b"200"]
    assert orjson.loads(replies[0][1])["choices"] and orjson.loads(replies[2][1])["choices"]
    assert orjson.loads(replies[1][1])["error"]["type"] == "invalid_request_error"
    assert replies[0][0][b"x-request-id"] != replies[2][0][b"x-request-id"]
