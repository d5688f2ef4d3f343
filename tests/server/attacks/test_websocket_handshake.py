"""A WebSocket handshake the server rejects (uvicorn's WebSocket protocol) is answered in OpenAI's error
shape, as a well-formed one is by the app (unsupported_transport), not in uvicorn's text/plain."""

from __future__ import annotations

import orjson
import pytest

from tests.server.attacks.raw import connect, error_of, read_until_closed, served
from tests.support.fakes import ServerThread

KEY = b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
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
    answer = handshake(gateway.port, b"GET", b"/v1/responses", KEY + b"Sec-WebSocket-Version: 13\r\n")
    assert answer.startswith(b"HTTP/1.1 400"), answer
    assert orjson.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "unsupported_transport"
