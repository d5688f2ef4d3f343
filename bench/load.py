"""Load generators for the benchmark: ``wrk`` for plain requests, a raw asyncio client for streams.

Plain requests (``requests``): wrk with ``wrk_post.lua`` (one thread: the load has one core), which
prints throughput and wrk's own latency percentiles as one JSON line.

Streams (``streams``): N connections, each sending one streaming chat request after another over
keep-alive until the time is up. For every stream it records the time to the first ``data:`` chunk
(from the moment the request was written), the gaps between reads that carried data, and whether any
gap was a stall (longer than ``--stall-factor`` times the upstream's pacing). Starts are spread over
one stream's length so the run measures a steady state, not a thundering herd.

Held streams (``hold``): open N slow streams, print ``{"open": N}`` once every one has sent its first
chunk, and keep them open until stdin closes (the runner measures the proxy's memory meanwhile).

Every command prints one JSON object on stdout.

    python bench/load.py requests --url http://127.0.0.1:8000 -c 16 -d 5
    python bench/load.py streams --url http://127.0.0.1:8000 -n 128 -d 5 --interval-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import httptools
import orjson
import uvloop

LUA = Path(__file__).with_name("wrk_post.lua")
CHAT = "/v1/chat/completions"


def percentile(values: list[float], pct: float) -> float:
    """Nearest-rank percentile of an unsorted list (0.0 for an empty one)."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


# -- plain requests: wrk ----------------------------------------------------------------------------


def run_wrk(
    url: str,
    connections: int,
    duration_s: float,
    *,
    model: str = "mock",
    mode: str = "fixed",
    path: str = CHAT,
    token: str = "",
) -> dict[str, Any]:
    """One wrk run (one thread). Returns requests/s, errors and latency percentiles in ms."""
    tag = uuid.uuid4().hex[:12]
    cmd = ["wrk", "-t1", f"-c{connections}", f"-d{duration_s:g}s", "--timeout", "10s", "-s", str(LUA)]
    cmd += [url, "--", model, mode, path, tag, token]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=duration_s + 60, check=True).stdout
    return parse_wrk(out)


def parse_wrk(out: str) -> dict[str, Any]:
    """The JSON line our wrk Lua scripts print at the end: requests/s, errors and the percentiles they
    report (p50/p99 always; p90 and max when the script prints them), in ms."""
    line = next((ln for ln in reversed(out.splitlines()) if ln.startswith("{")), None)
    if line is None:
        raise RuntimeError(f"wrk printed no result:\n{out}")
    raw = orjson.loads(line)
    seconds = raw["duration_us"] / 1e6
    result = {
        "requests": raw["requests"],
        "rps": raw["requests"] / seconds if seconds else 0.0,
        "errors": raw["errors"] + raw["non_2xx"],
    }
    for name in ("p50", "p90", "p99", "max"):
        if f"{name}_us" in raw:
            result[f"{name}_ms"] = raw[f"{name}_us"] / 1000
    return result


# -- streams: a raw HTTP/1.1 client -----------------------------------------------------------------


def stream_request(host: str, port: int, path: str, body: dict[str, Any], token: str = "") -> bytes:
    payload = orjson.dumps(body)
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n{auth}"
        f"Accept: text/event-stream\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    return head.encode() + payload


class StreamConnection(asyncio.Protocol):
    """One keep-alive connection that runs one streaming request at a time and times its chunks."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.sent_at = 0.0
        self.first: float | None = None
        self.last = 0.0
        self.gaps: list[float] = []
        self.status = 0
        self.saw_done = False
        self._read_had_data = False
        self.first_seen: asyncio.Event = asyncio.Event()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def start(self, request: bytes) -> asyncio.Future[None]:
        assert self.transport is not None
        self.waiter = asyncio.get_running_loop().create_future()
        self.first, self.gaps, self.status, self.saw_done = None, [], 0, False
        self.first_seen.clear()
        self.sent_at = time.perf_counter()
        self.transport.write(request)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter()
        self._read_had_data = False
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(exc)
            return
        if self._read_had_data:
            if self.first is None:
                self.first = now - self.sent_at
                self.first_seen.set()
            else:
                self.gaps.append(now - self.last)
            self.last = now

    def on_status(self, _: bytes) -> None:
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        if b"data:" in body:
            self._read_had_data = True
            if b"[DONE]" in body:
                self.saw_done = True

    def on_message_complete(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self._fail(exc or ConnectionError("connection closed"))

    def _fail(self, exc: BaseException) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(exc)
        if self.transport is not None:
            self.transport.close()


def _stream_body(model: str, tokens: int, unique: str | None, interval_ms: float | None = None) -> dict[str, Any]:
    """A streaming chat request; ``interval_ms`` adds the mock's own pacing field, which a gateway that
    refuses unknown fields will reject (run a slower mock instead)."""
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": f"Stream to the benchmark {unique or ''}".strip()}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": tokens,
        "temperature": 0,
    }
    if interval_ms is not None:
        body["mock_interval_ms"] = interval_ms
    return body


async def run_streams(
    url: str,
    concurrency: int,
    duration_s: float,
    *,
    interval_s: float,
    tokens: int,
    model: str = "mock",
    unique: bool = True,
    stall_factor: float = 3.0,
    token: str = "",
) -> dict[str, Any]:
    """Keep ``concurrency`` streams going for ``duration_s``; return TTFC, gaps and stalls (ms)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    ttfc: list[float] = []
    gaps: list[float] = []
    stalled = completed = errors = 0
    stall_gap = stall_factor * interval_s
    stream_len = (tokens + 3) * interval_s
    started = time.perf_counter()
    deadline = started + duration_s
    tag = uuid.uuid4().hex[:8]
    counter = 0

    async def one_client(delay: float) -> None:
        nonlocal stalled, completed, errors, counter
        await asyncio.sleep(delay)
        conn: StreamConnection | None = None
        while time.perf_counter() < deadline:
            if conn is None or conn.transport is None:
                _, conn = await loop.create_connection(StreamConnection, host, port)
            counter += 1
            body = _stream_body(model, tokens, f"{tag}-{counter}" if unique else None)
            try:
                async with asyncio.timeout(stream_len + 30):
                    await conn.start(stream_request(host, port, CHAT, body, token))
            except (OSError, TimeoutError, httptools.HttpParserError):
                errors += 1
                if conn.transport is not None:
                    conn.transport.close()
                conn = None
                continue
            if conn.status != 200 or not conn.saw_done or conn.first is None:
                errors += 1
                continue
            completed += 1
            ttfc.append(conn.first)
            gaps.extend(conn.gaps)
            if any(g > stall_gap for g in conn.gaps):
                stalled += 1
        if conn is not None and conn.transport is not None:
            conn.transport.close()

    spread = min(stream_len, duration_s / 2)
    await asyncio.gather(*(one_client(spread * i / concurrency) for i in range(concurrency)))
    stall_gaps = [g for g in gaps if g > stall_gap]
    return {
        "concurrency": concurrency,
        "streams": completed,
        "errors": errors,
        "stalled": stalled,
        "stall_gaps": len(stall_gaps),
        "ttfc_p50_ms": percentile(ttfc, 50) * 1000,
        "ttfc_p99_ms": percentile(ttfc, 99) * 1000,
        "gap_p50_ms": percentile(gaps, 50) * 1000,
        "gap_p99_ms": percentile(gaps, 99) * 1000,
        "gap_max_ms": max(gaps, default=0.0) * 1000,
        "seconds": time.perf_counter() - started,
    }


async def hold_streams(url: str, count: int, *, interval_ms: float | None, tokens: int, model: str = "mock") -> None:
    """Open ``count`` slow streams, report when all have started, hold them until stdin closes."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    loop = asyncio.get_running_loop()
    conns: list[StreamConnection] = []
    waiters: list[asyncio.Future[None]] = []
    for i in range(count):
        _, conn = await loop.create_connection(StreamConnection, host, port)
        body = _stream_body(model, tokens, f"hold-{i}-{random.random()}", interval_ms=interval_ms)
        waiters.append(conn.start(stream_request(host, port, CHAT, body)))
        conns.append(conn)
    async with asyncio.timeout(60):
        await asyncio.gather(*(c.first_seen.wait() for c in conns))
    print(orjson.dumps({"open": sum(c.transport is not None for c in conns)}).decode(), flush=True)
    await loop.run_in_executor(None, sys.stdin.read)  # the runner closes stdin when it has measured
    for conn in conns:
        if conn.transport is not None:
            conn.transport.close()
    for waiter in waiters:
        waiter.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    req = sub.add_parser("requests", help="wrk: requests/s and latency")
    req.add_argument("-c", "--connections", type=int, default=16)
    req.add_argument("--mode", choices=("fixed", "unique"), default="fixed")
    st = sub.add_parser("streams", help="paced SSE streams: TTFC, gaps, stalls")
    st.add_argument("-n", "--concurrency", type=int, default=128)
    st.add_argument("--interval-ms", type=float, default=20.0, help="the upstream's pacing (for stalls)")
    st.add_argument("--tokens", type=int, default=32)
    st.add_argument("--fixed", action="store_true", help="the same prompt every time (cache hits)")
    hd = sub.add_parser("hold", help="hold N slow streams open until stdin closes")
    hd.add_argument("-n", "--count", type=int, default=1000)
    hd.add_argument("--interval-ms", type=float, help="ask the mock for this pace (direct to the mock only)")
    hd.add_argument("--tokens", type=int, default=400)
    for p in (req, st, hd):
        p.add_argument("--url", required=True, help="base URL, e.g. http://127.0.0.1:8000")
        p.add_argument("--model", default="mock")
    for p in (req, st):
        p.add_argument("-d", "--duration", type=float, default=5.0, help="seconds")
        p.add_argument("--token", default="", help="bearer token (LiteLLM's master key)")
    args = parser.parse_args()
    if args.command == "requests":
        result = run_wrk(args.url, args.connections, args.duration, model=args.model, mode=args.mode, token=args.token)
    elif args.command == "streams":
        result = uvloop.run(
            run_streams(
                args.url,
                args.concurrency,
                args.duration,
                interval_s=args.interval_ms / 1000,
                tokens=args.tokens,
                model=args.model,
                unique=not args.fixed,
                token=args.token,
            )
        )
    else:
        uvloop.run(
            hold_streams(args.url, args.count, interval_ms=args.interval_ms, tokens=args.tokens, model=args.model)
        )
        return
    print(orjson.dumps(result).decode(), flush=True)


if __name__ == "__main__":
    main()
