"""Keep-alive races on both sides of the gateway.

Client side: uvicorn closes a connection that has been idle for ``timeout_keep_alive`` seconds (5 by
default), while httpx, and so the OpenAI SDK, reuses an idle connection for up to ``keepalive_expiry``
(5 s by default). A client that writes its next request as the server's timer fires gets no answer
(httpx: ``ReadError`` or ``RemoteProtocolError``). The gateway keeps idle client connections open for
``GATEWAY_KEEPALIVE_TIMEOUT_S`` (75 s), longer than such clients keep them, so the client closes first.

Worker side: the same race against the worker's uvicorn (vLLM: ``VLLM_HTTP_TIMEOUT_KEEP_ALIVE``, 5 s).
A request that fails on a reused connection before any response byte is sent once more, on a fresh one.
"""

from __future__ import annotations

import asyncio
import http.client
import re
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from gateway.upstream.client import UpstreamClient, UpstreamConfig, UpstreamFailure
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.serve import gateway_process

CHAT = orjson.dumps({"model": "m1", "messages": [{"role": "user", "content": "hi"}]})


def chat(conn: http.client.HTTPConnection) -> int:
    """One chat request on ``conn``'s current connection (http.client reuses it as long as it is open)."""
    conn.request("POST", "/v1/chat/completions", body=CHAT, headers={"content-type": "application/json"})
    response = conn.getresponse()
    response.read()
    return response.status


def test_a_client_connection_idle_past_five_seconds_is_still_served(upstream_url: str, tmp_path: Path) -> None:
    """With uvicorn's default (5 s) the second request finds the connection closed: RemoteDisconnected."""
    with gateway_process(upstream_url, tmp_path) as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            assert chat(conn) == 200
            kept = conn.sock
            time.sleep(6.0)  # past httpx's keepalive_expiry and uvicorn's default timeout_keep_alive (5 s)
            assert chat(conn) == 200
            assert conn.sock is kept  # served on the connection the client kept, not on a new one
        finally:
            conn.close()


def test_writing_on_a_connection_the_gateway_closed_at_its_keepalive_timeout_gets_no_answer(
    upstream_url: str, tmp_path: Path
) -> None:
    """The race, made deterministic: the client writes after the gateway's timer fired (here at 1 s), as
    a client whose own idle expiry is as long as the server's does when both timers meet. This is what
    the soak's client saw once in 294,627 requests with both at 5 s."""
    with gateway_process(upstream_url, tmp_path, GATEWAY_KEEPALIVE_TIMEOUT_S="1") as port:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        try:
            assert chat(conn) == 200
            time.sleep(3.0)
            with pytest.raises(ConnectionError):  # http.client.RemoteDisconnected, or a reset
                chat(conn)
        finally:
            conn.close()


async def test_a_request_on_a_connection_the_worker_just_closed_is_sent_again_on_a_fresh_one() -> None:
    """A real uvicorn worker closing idle connections after 1 s (vLLM's: 5 s); the pool keeps them 30 s."""
    fake = FakeUpstream()
    worker = ServerThread(fake)
    worker.server.config.timeout_keep_alive = 1  # read when each connection is made
    with worker:
        client = UpstreamClient(UpstreamConfig(keepalive_s=30))
        try:
            response = await client.open(worker.url, "/v1/chat/completions", CHAT)
            assert response.status == 200
            await response.read()
            # Block this event loop past the worker's keep-alive timeout, as a busy gateway loop is: the
            # worker's close has arrived but is not processed yet, so the pool still holds the connection
            # as idle and usable, and the next request is written on it.
            time.sleep(2.0)  # noqa: ASYNC251 (blocking the loop is the point)
            response = await client.open(worker.url, "/v1/chat/completions", CHAT)
            assert response.status == 200
            assert orjson.loads(await response.read())["choices"][0]["message"]["content"] == fake.behavior.text
        finally:
            await client.aclose()
    assert len(fake.requests) == 2  # the attempt on the closed connection never reached the worker


class ClosingWorker:
    """A worker that answers the first request on a connection while it has ``answers`` left, and closes
    the connection without a word on any other request, as a worker whose keep-alive timer fires just as
    a request arrives."""

    def __init__(self, answers: int) -> None:
        self.answers = answers
        self.connections = 0
        self.url = ""
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> ClosingWorker:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = True
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = re.search(rb"content-length: *(\d+)", head, re.IGNORECASE)
                await reader.readexactly(int(length.group(1)) if length else 0)
                if not first or self.answers == 0:
                    return
                first = False
                self.answers -= 1
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}")
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


async def _post(client: UpstreamClient, url: str) -> Any:
    response = await client.open(url, "/v1/chat/completions", CHAT)
    return response.status, await response.read()


async def test_a_request_is_sent_again_once_only() -> None:
    """A reused connection closed, then the fresh one closed too: the failure is the caller's to handle
    (routing tries another worker), after exactly one more connection."""
    async with ClosingWorker(answers=1) as worker:
        client = UpstreamClient(UpstreamConfig())
        try:
            assert await _post(client, worker.url) == (200, b"{}")
            with pytest.raises(UpstreamFailure) as failure:
                await _post(client, worker.url)
        finally:
            await client.aclose()
    assert (failure.value.kind, failure.value.retryable) == ("connect", True)
    assert worker.connections == 2


async def test_a_fresh_connection_closed_without_an_answer_is_not_tried_again_here() -> None:
    """Only a kept-alive connection can be stale; a fresh one that fails says something about the worker."""
    async with ClosingWorker(answers=0) as worker:
        client = UpstreamClient(UpstreamConfig())
        try:
            with pytest.raises(UpstreamFailure):
                await _post(client, worker.url)
        finally:
            await client.aclose()
    assert worker.connections == 1
