"""A WebSocket handshake the server would reject, answered in the gateway's error shape.

uvicorn hands an ``Upgrade: websocket`` request to its WebSocket protocol (``websockets``' sans-I/O
``ServerProtocol`` with uvicorn[standard]); a handshake that protocol rejects (no or a malformed
``Sec-WebSocket-Key``, a ``Sec-WebSocket-Version`` other than 13, ...) is answered there, before the app
runs, in ``text/plain``. The front door asks the same ``ServerProtocol`` first, so the rules are the
library's own, and answers a rejected handshake with the OpenAI-shaped error instead. A handshake it
accepts goes to uvicorn unchanged, and the app answers it.
"""

from __future__ import annotations

from collections.abc import Iterable

from gateway.server.head_answers import error_response

try:
    from websockets.datastructures import Headers
    from websockets.http11 import Request
    from websockets.server import ServerProtocol
except ImportError:  # pragma: no cover - without websockets uvicorn serves no WebSocket either
    ServerProtocol = None  # type: ignore[assignment, misc]


def handshake_refusal(method: bytes, target: bytes, headers: Iterable[tuple[bytes, bytes]]) -> bytes | None:
    """The complete answer to a WebSocket handshake the server would reject, or None when it would
    accept it (or cannot tell: ``websockets`` is not installed)."""
    if ServerProtocol is None:
        return None
    if method != b"GET":  # RFC 6455 4.1; websockets' request parser would fail on it with no answer
        return error_response(400, "A WebSocket handshake must be a GET request.", "invalid_websocket_handshake")
    protocol = ServerProtocol()
    request = Request(
        target.decode("latin-1"), Headers([(n.decode("latin-1"), v.decode("latin-1")) for n, v in headers])
    )
    response = protocol.accept(request)
    if response.status_code == 101:
        return None
    reason = protocol.handshake_exc or "rejected"
    return error_response(
        response.status_code,
        f"The WebSocket handshake is invalid: {reason}.",
        "invalid_websocket_handshake",
    )
