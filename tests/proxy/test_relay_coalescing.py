"""A stream relay that falls behind passes on what has piled up in one piece (fewer, larger writes)."""

from __future__ import annotations

import asyncio
import socket
import time

from tests.upstream.test_client_against_scripted_workers import client, raw_worker

EVENTS = [b'data: {"n": %d}\n\n' % i for i in range(6)]


def chunked(piece: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(piece), piece)


def paced_then_burst(conn: socket.socket, head: bytes) -> bool:
    """Headers and one event; a pause; then five events in one write; then the end."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
    conn.sendall(chunked(EVENTS[0]))
    time.sleep(0.1)
    conn.sendall(b"".join(chunked(e) for e in EVENTS[1:]) + b"0\r\n\r\n")
    return True


async def test_chunks_that_piled_up_are_relayed_in_one_piece() -> None:
    upstream = client()
    with raw_worker(paced_then_burst) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        pieces = []
        async for piece in response.iter_chunks():
            pieces.append(piece)
            if len(pieces) == 1:
                await asyncio.sleep(0.3)  # a slow consumer: the burst is buffered meanwhile
    assert pieces[0] == EVENTS[0]
    assert b"".join(pieces) == b"".join(EVENTS)
    assert len(pieces) == 2  # the five buffered events came as one piece
    await upstream.aclose()


async def test_chunks_read_as_they_come_are_relayed_one_by_one() -> None:
    def paced(conn: socket.socket, head: bytes) -> bool:
        conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for event in EVENTS[:3]:
            conn.sendall(chunked(event))
            time.sleep(0.05)
        conn.sendall(b"0\r\n\r\n")
        return True

    upstream = client()
    with raw_worker(paced) as worker:
        response = await upstream.open(worker.url, "/v1/chat/completions", b"{}")
        pieces = [piece async for piece in response.iter_chunks()]
    assert pieces == EVENTS[:3]
    await upstream.aclose()
