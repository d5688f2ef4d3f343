"""Raw-socket tools for the attack suite: what an attacker sends, and how a normal client checks that it
is still served meanwhile."""

from __future__ import annotations

import socket
import time

import httpx
import orjson

from tests.support.fakes import ServerThread

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


def connect(port: int, timeout: float = 10.0) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def read_until_closed(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection (or ``timeout``); a reset after
    data counts as the end."""
    sock.settimeout(timeout)
    data = b""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        data += chunk
    return data


def closed_by_server(sock: socket.socket, timeout: float) -> bool:
    """True when the server closes the connection within ``timeout`` without sending anything."""
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def read_response(sock: socket.socket, timeout: float = 10.0) -> bytes:
    """One content-length-framed response, read whole (its head and body may come in separate reads)."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data or len(data) < data.index(b"\r\n\r\n") + 4 + int(parse(data)[1]["content-length"]):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def parse(data: bytes) -> tuple[int, dict[str, str], bytes]:
    """Status, headers and body of the first response in ``data`` (framed by content-length)."""
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.strip().lower().decode()] = value.strip().decode()
    length = int(headers.get("content-length", len(rest)))
    return status, headers, rest[:length]


def responses(data: bytes) -> list[tuple[int, bytes]]:
    """Every content-length-framed response in ``data``, in order (status, body)."""
    found = []
    while data.startswith(b"HTTP/1.1 ") and b"\r\n\r\n" in data:
        status, headers, body = parse(data)
        head_len = data.index(b"\r\n\r\n") + 4
        length = int(headers["content-length"])
        if len(data) < head_len + length:
            break  # not all here yet
        found.append((status, body))
        data = data[head_len + length :]
    return found


def error_of(data: bytes, status: int) -> dict[str, object]:
    """The OpenAI-shaped error of a raw answer with ``status``, which also closes the connection."""
    got, headers, body = parse(data)
    assert got == status, data[:300]
    assert headers["content-type"] == "application/json"
    assert headers.get("connection") == "close"
    assert 0 < len(headers.get("x-request-id", "")) <= 128, data[:300]  # the front door's own answers too
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


def served(server: ServerThread, timeout: float = 10.0) -> None:
    """A normal client, on a new connection: /health and a chat completion answer 200."""
    with httpx.Client(base_url=server.url, timeout=timeout) as client:
        assert client.get("/health").status_code == 200
        reply = client.post("/v1/chat/completions", json=CHAT)
        assert reply.status_code == 200, reply.text
        assert reply.json()["choices"][0]["message"]["content"]


def head(path: str = "/v1/chat/completions", method: str = "POST", extra: bytes = b"") -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: gateway\r\n".encode() + extra
