"""A scripted HTTP/1.1 server on a real socket (asyncio, same loop as the test), for tests of HTTP clients:
each request path names what the server does with the bytes, including what a clean server never does
(reset mid-body, cut a body short, stall, answer garbage, close a kept-alive connection as a request
arrives). No tests here.

Paths (the query string carries the numbers):
- ``/echo``: 200, content-length, the request body; the request's headers are kept in ``seen``.
- ``/chunked?n=N&size=S``: 200, chunked, N chunks of S bytes (``b"a"``, ``b"b"``, ...).
- ``/large?size=S``: 200, content-length, S bytes written in one go.
- ``/gated?n=N``: chunked; chunk i is sent once ``gate.release()`` was called i times (proves a client
  hands out bytes before the body has ended).
- ``/status?code=C``: that status, a small JSON body.
- ``/close``: 200 with ``Connection: close``; the server closes after it.
- ``/idle-close``: 200 keep-alive, then the server closes the connection after 50 ms.
- ``/once``: the first request on a connection is answered; any later one on the same connection is
  met with a close and no answer (a keep-alive timer firing as a request arrives).
- ``/slow-head?s=X``: headers after X seconds.
- ``/stall?sent=N``: headers (content-length 1 MiB), N bytes, then nothing.
- ``/cut?sent=N``: headers (content-length 1 MiB), N bytes, then FIN.
- ``/cut-chunked``: chunked, one chunk, then FIN without the last chunk.
- ``/reset?sent=N``: headers, N bytes, then RST.
- ``/reset-head``: RST as soon as the request was read.
- ``/garbage``: bytes that are not HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any
from urllib.parse import parse_qs, urlsplit


class Gate:
    def __init__(self) -> None:
        self._count = 0
        self._changed = asyncio.Event()

    def release(self) -> None:
        self._count += 1
        self._changed.set()

    async def wait(self, count: int) -> None:
        while self._count < count:
            self._changed.clear()
            await self._changed.wait()


class ScriptedHTTPServer:
    def __init__(self) -> None:
        self.connections = 0  # accepted
        self.open = 0
        self.most_open = 0
        self.closed_by_client = 0  # connections that ended with EOF from the client
        self.requests: list[str] = []
        self.seen: list[dict[str, str]] = []
        self.gate = Gate()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def __aenter__(self) -> ScriptedHTTPServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        served = 0
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.closed_by_client += 1
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                self.requests.append(f"{method} {target}")
                self.seen.append(headers)
                parts = urlsplit(target)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                keep = await self._answer(parts.path, query, body, reader, writer, served)
                served += 1
                if not keep:
                    return
        except (ConnectionError, asyncio.CancelledError):
            return
        finally:
            self.open -= 1
            self._tasks.discard(task)
            if not writer.transport.is_closing():
                writer.close()

    async def _pause(self, reader: asyncio.StreamReader, awaitable: Any) -> None:
        """Wait for ``awaitable`` unless the client closes the connection first (then end this one:
        a server that is not reading must still see a client give up, as vLLM does)."""
        wait = asyncio.ensure_future(awaitable)
        eof = asyncio.ensure_future(reader.read(1))
        try:
            done, _ = await asyncio.wait({wait, eof}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            wait.cancel()
            eof.cancel()
            await asyncio.gather(wait, eof, return_exceptions=True)  # the reader is free again
        if eof in done and not eof.cancelled() and eof.exception() is None and eof.result():
            raise AssertionError("the client sent bytes while its request was being answered")
        if wait not in done:
            self.closed_by_client += 1
            raise ConnectionResetError("the client closed the connection")

    async def _answer(
        self,
        path: str,
        q: dict[str, str],
        body: bytes,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        served: int,
    ) -> bool:
        w = writer.write
        if path == "/echo":
            w(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        elif path == "/chunked":
            n, size = int(q.get("n", "3")), int(q.get("size", "5"))
            w(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(n):
                w(b"%x\r\n%s\r\n" % (size, bytes([97 + i % 26]) * size))
                await writer.drain()
            w(b"0\r\n\r\n")
        elif path == "/large":
            size = int(q["size"])
            w(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
            w(_pattern(size))
        elif path == "/gated":
            w(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            for i in range(int(q.get("n", "3"))):
                await self._pause(reader, self.gate.wait(i))
                w(b"2\r\n%02d\r\n" % i)
                await writer.drain()
            w(b"0\r\n\r\n")
        elif path == "/status":
            code = int(q["code"])
            payload = b'{"error": "%d"}' % code
            w(b"HTTP/1.1 %d Whatever\r\nContent-Length: %d\r\n\r\n%s" % (code, len(payload), payload))
        elif path == "/close":
            w(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            return False
        elif path == "/idle-close":
            w(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
            await writer.drain()
            await asyncio.sleep(0.05)
            return False
        elif path == "/once":
            if served:
                return False
            w(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nonce")
        elif path == "/slow-head":
            await self._pause(reader, asyncio.sleep(float(q["s"])))
            w(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        elif path in ("/stall", "/cut", "/reset"):
            w(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % (1 << 20))
            w(_pattern(int(q.get("sent", "100"))))
            await writer.drain()
            if path == "/stall":
                await self._pause(reader, asyncio.sleep(3600))
            if path == "/reset":
                await asyncio.sleep(0.05)  # the bytes sent so far arrive first
                _reset(writer)
            return False
        elif path == "/cut-chunked":
            w(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
            await writer.drain()
            return False
        elif path == "/reset-head":
            _reset(writer)
            return False
        elif path == "/garbage":
            w(b"SSH-2.0-OpenSSH_9.6\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.5)
            return False
        else:
            w(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        return True


def _pattern(size: int) -> bytes:
    """``size`` bytes that show a lost or reordered piece (not one byte repeated)."""
    block = bytes(range(256)) * 4
    return (block * (size // len(block) + 1))[:size]


def _reset(writer: asyncio.StreamWriter) -> None:
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


pattern = _pattern
