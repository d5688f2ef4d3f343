"""Shared pieces of the fault-injection tests (no tests here): processes a test may SIGKILL, a TCP black
hole, a Redis proxy that can black-hole its traffic, and stream helpers.

Everything runs on loopback as real processes or real sockets: a fault is what the kernel makes of it
(a reset connection, a refused connect, a silent peer), not a mocked exception.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from tests.support.fakes import free_port

REPO = Path(__file__).resolve().parents[2]

_SERVE_FAKE = """
import json, sys, uvicorn
from tests.support.fakes import Behavior, FakeUpstream
fake = FakeUpstream(behavior=Behavior(**json.loads(sys.argv[2])))
uvicorn.run(fake, host="127.0.0.1", port=int(sys.argv[1]), log_config=None, access_log=False,
            lifespan="on", loop="asyncio", http="httptools")
"""


def wait_for(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.02) -> None:
    """Poll ``predicate`` until it is true; fail with ``what`` after ``timeout_s`` (every wait is bounded)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


def answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=0.5).status_code < 500
    except httpx.HTTPError:
        return False


class WorkerProcess:
    """The fake OpenAI worker (``tests.support.fakes.FakeUpstream``) in its own process, so it can be killed."""

    def __init__(self, **behavior: Any) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.behavior = behavior
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> WorkerProcess:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVE_FAKE, str(self.port), json.dumps(self.behavior)],
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: answers(self.url + "/health"), 30, f"the fake worker on port {self.port}")
        return self

    def kill(self) -> None:
        """SIGKILL: no goodbye, the kernel resets or closes every connection the worker held."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def __exit__(self, *exc: object) -> None:
        self.kill()


@contextlib.contextmanager
def unaccepting_port() -> Iterator[int]:
    """A port whose listener never accepts and whose accept queue is full: a connection attempt gets
    no answer at all (a connect timeout, not a refusal)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):  # fill the accept queue: later connection attempts get no answer at all
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    try:
        yield int(port)
    finally:
        for filler in fillers:
            filler.close()
        listener.close()


class BlackHole:
    """A TCP listener that accepts every connection and never answers (and never closes one)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(512)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted.append(conn)

    def __enter__(self) -> BlackHole:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        for conn in self.accepted:
            conn.close()


class SwitchableProxy:
    """A TCP proxy to ``127.0.0.1:target_port`` that can be switched into a black hole: bytes in both
    directions are then swallowed and new connections are accepted but never served, as when a network
    path silently drops packets. ``restore()`` forwards again (connections opened meanwhile stay dead)."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.blackholed = threading.Event()
        self._stop = threading.Event()
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._listener = socket.create_server(("127.0.0.1", self.port), backlog=512)
        self._listener.settimeout(0.1)
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            if self.blackholed.is_set():
                threading.Thread(target=self._pump, args=(client, None), daemon=True).start()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=2)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets.append(server)
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket | None) -> None:
        src.settimeout(None)
        try:
            while data := src.recv(65536):
                if dst is not None and not self.blackholed.is_set():
                    dst.sendall(data)
        except OSError:
            pass
        finally:
            if dst is not None and not self.blackholed.is_set():
                for s in (src, dst):
                    with contextlib.suppress(OSError):
                        s.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> SwitchableProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


def sse_events(text: str) -> list[bytes]:
    """The payloads of an SSE body, in order (``[DONE]`` included)."""
    return [line[6:].encode() for line in text.split("\n") if line.startswith("data: ")]


def error_events(events: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for payload in events:
        if payload != b"[DONE]":
            event = orjson.loads(payload)
            if "error" in event:
                out.append(event["error"])
    return out


def check_openai_error(body: dict[str, Any]) -> dict[str, Any]:
    """The error object of an OpenAI-shaped error body (asserting the shape)."""
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def gateway_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GATEWAY_")}
    env.update(extra)
    return env
