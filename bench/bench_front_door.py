"""The front door's cost per request, without the network: uvicorn's HttpToolsProtocol and the gateway's
GatewayHttpProtocol each parse the same keep-alive requests (an OpenAI SDK-like head and a small JSON
body, in one read and in two) with the app replaced by a no-op, so only the protocol's work differs.

    PYTHONPATH=$PWD .venv/bin/python bench/bench_front_door.py [--requests 200000]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from typing import Any

import uvicorn
import uvloop
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from gateway.server.front_door import FrontDoorLimits, GatewayHttpProtocol

BODY = b'{"model": "m1", "messages": [{"role": "user", "content": "Say hello in one sentence."}], "stream": false}'
HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8000\r\nAccept-Encoding: gzip, deflate\r\n"
    b"Connection: keep-alive\r\nAccept: application/json\r\nContent-Type: application/json\r\n"
    b"User-Agent: OpenAI/Python 1.99.0\r\nX-Stainless-Lang: python\r\nX-Stainless-Package-Version: 1.99.0\r\n"
    b"X-Stainless-OS: Linux\r\nX-Stainless-Arch: x64\r\nX-Stainless-Runtime: CPython\r\n"
    b"X-Stainless-Runtime-Version: 3.11.9\r\nAuthorization: Bearer sk-0123456789abcdef0123456789abcdef\r\n"
    b"X-Stainless-Async: false\r\nx-stainless-retry-count: 0\r\nx-stainless-read-timeout: 600\r\n"
    b"Content-Length: %d\r\n\r\n" % len(BODY)
)


class Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"peername": ("127.0.0.1", 5000), "sockname": ("127.0.0.1", 8000)}.get(name, default)

    def write(self, data: Any) -> None:
        pass

    def is_closing(self) -> bool:
        return self.closing

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def close(self) -> None:
        self.closing = True


async def noop_app(scope: Any, receive: Any, send: Any) -> None:
    return None


def run(protocol_class: Any, reads: list[bytes], requests: int) -> float:
    """Seconds per request for ``requests`` keep-alive requests on one connection."""
    loop = uvloop.new_event_loop()  # what gateway serve runs
    config = uvicorn.Config(noop_app, log_config=None, access_log=False)
    config.load()
    proto = protocol_class(config=config, server_state=ServerState(), app_state={}, _loop=loop)

    def start(cycle: Any, app: Any) -> None:  # the app's response, done at once
        cycle.response_complete = True

    proto._start_asgi_task = start
    proto.connection_made(Transport())
    started = time.perf_counter()
    for _ in range(requests):
        for data in reads:
            proto.data_received(data)
        proto.on_response_complete()
    elapsed = time.perf_counter() - started
    proto.connection_lost(None)
    loop.close()
    return elapsed / requests


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=200_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    gateway = lambda **kw: GatewayHttpProtocol(limits=FrontDoorLimits(), **kw)  # noqa: E731
    for name, reads in (("head+body in one read", [HEAD + BODY]), ("head, then body", [HEAD, BODY])):
        results: dict[str, list[float]] = {"uvicorn httptools": [], "front door": []}
        for _ in range(args.reps):  # interleaved, medians
            results["uvicorn httptools"].append(run(HttpToolsProtocol, reads, args.requests))
            results["front door"].append(run(gateway, reads, args.requests))
        base, ours = (statistics.median(v) * 1e6 for v in results.values())
        print(f"{name:24s} uvicorn {base:6.2f} us/request   front door {ours:6.2f} us/request", end="")
        print(f"   (+{ours - base:.2f} us)")


if __name__ == "__main__":
    main()
