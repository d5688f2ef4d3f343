"""A WebSocket handshake the server rejects (uvicorn's WebSocket protocol) is answered in OpenAI's error
shape, as a well-formed one is by the app (unsupported_transport), not in uvicorn's text/plain; and a
well-formed one to a path with no WebSocket route gets the error of what that path is over HTTP, not
uvicorn's empty text/plain 403."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.server.attacks.raw import connect, error_of, parse, read_until_closed, served
from tests.support.fakes import ServerThread

KEY = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
WELL_FORMED = KEY + b"Sec-WebSocket-Version: 13\r\n"
MALFORMED = {
    "no-key": (b"GET", b"Sec-WebSocket-Version: 13\r\n", "Sec-WebSocket-Key"),
    "bad-version": (b"GET", KEY + b"Sec-WebSocket-Version: 8\r\n", "Sec-WebSocket-Version"),
    "no-version": (b"GET", KEY, "Sec-WebSocket-Version"),
    "bad-key": (b"GET", b"Sec-WebSocket-Key: short\r\nSec-WebSocket-Version: 13\r\n", "Sec-WebSocket-Key"),
    "two-keys": (b"GET", KEY + KEY + b"Sec-WebSocket-Version: 13\r\n", "Sec-WebSocket-Key"),
    "post": (b"POST", KEY + b"Sec-WebSocket-Version: 13\r\n", "GET"),
}


def handshake(port: int, method: bytes, path: bytes, fields: bytes) -> bytes:
    with connect(port) as sock:
        sock.sendall(
            b"%b %b HTTP/1.1\r\nHost: gateway\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n%b\r\n"
            % (method, path, fields)
        )
        return read_until_closed(sock)


@pytest.mark.parametrize("path", [b"/v1/responses", b"/v1/chat/completions"])
@pytest.mark.parametrize("case", list(MALFORMED.values()), ids=list(MALFORMED))
def test_a_malformed_handshake_is_an_openai_error(gateway: ServerThread, path: bytes, case: tuple) -> None:
    method, fields, named = case
    answer = handshake(gateway.port, method, path, fields)
    error = error_of(answer, 400)  # also checks content-type application/json and connection: close
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_websocket_handshake"
    assert named in str(error["message"]), error
    served(gateway)


def test_a_well_formed_handshake_is_still_answered_by_the_app(gateway: ServerThread) -> None:
    answer = handshake(gateway.port, b"GET", b"/v1/responses", WELL_FORMED)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "unsupported_transport"


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        ("/v1/nothing", 404, None),  # no route at all
        ("/v1/chat/completions", 400, "unsupported_transport"),  # POST only over HTTP
        ("/v1/models", 400, "unsupported_transport"),
        ("/v1/files/file-abc", 400, "unsupported_transport"),  # a route with a path parameter
        ("/v1/audio/transcriptions", 400, "unsupported_transport"),  # served outside FastAPI
        ("/v1/%2e%2e/admin/config", 400, "invalid_path"),
    ],
)
def test_a_handshake_where_no_websocket_route_is_answered_as_the_path_is_over_http(
    gateway: ServerThread, path: str, status: int, code: str | None
) -> None:
    answer = handshake(gateway.port, b"GET", path.encode(), WELL_FORMED)
    error = error_of(answer, status)  # also checks content-type application/json and connection: close
    assert error["type"] == "invalid_request_error" and error["code"] == code, error
    if status == 404:
        assert error == httpx.get(gateway.url + path).json()["error"]  # the same words as over HTTP
    served(gateway)


def test_a_handshake_on_the_messages_path_is_answered_in_anthropics_shape(gateway: ServerThread) -> None:
    status, headers, body = parse(handshake(gateway.port, b"GET", b"/v1/messages", WELL_FORMED))
    assert (status, headers["content-type"], headers.get("connection")) == (400, "application/json", "close")
    error = orjson.loads(body)
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
    assert "WebSocket" in error["error"]["message"] and "/v1/messages" in error["error"]["message"]
