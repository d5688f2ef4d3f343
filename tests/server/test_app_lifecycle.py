"""The app's process-level seams, in process: managed engine start-up and shutdown through
``engine_factory``, the uvicorn factory reading GATEWAY_* settings and watching its config file, OTLP
export to a collector, JSON logs, and the SIGTERM drain handler."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType, SimpleNamespace
from typing import Any

import httpx
import orjson
import pytest
import yaml
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from gateway.ops.logs import JSONFormatter, LoggingConfig, apply_logging, configure_logging
from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server import asgi
from gateway.server.app import create_app
from gateway.server.drain import install_sigterm_drain
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.faults import wait_for
from tests.support.gateways import base_config
from tests.wire.test_error_shape import CHAT

# -- managed engine through engine_factory --------------------------------------------------------


class FakeEngine:
    """Stands in for EngineManager: what the app calls, and when."""

    def __init__(self, workers: list[Any]) -> None:
        self.workers = workers
        self.calls: list[str] = []

    async def start(self) -> None:
        self.calls.append("start")

    async def stop(self) -> None:
        self.calls.append("stop")

    def status(self) -> list[dict[str, Any]]:
        return [{"name": w.name, "url": w.url, "state": "ready"} for w in self.workers]


def test_managed_engine_starts_before_serving_shows_in_admin_and_stops_at_shutdown(
    upstream: FakeUpstream, upstream_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    port = int(upstream_url.rsplit(":", 1)[1])  # the "managed" worker is the fake, on its port
    config = base_config(["cpu-0"], engine={"workers": [{"name": "cpu-0", "model": "smollm2", "port": port}]})
    engines: list[FakeEngine] = []
    loaded_when_started: list[bool] = []

    def factory(state: Any, initial: GatewayConfig) -> FakeEngine:
        engine = FakeEngine(list(initial.engine.workers))
        engines.append(engine)
        loaded_when_started.append(state.holder.loaded)
        return engine

    app = create_app(
        Settings(admin_token="t", port=8123),
        registry=PluginRegistry(),
        config=GatewayConfig.model_validate(config),
        engine_factory=factory,
    )
    with ServerThread(app) as server:
        assert loaded_when_started == [False]  # workers start before the config goes live
        listing = httpx.get(server.url + "/admin/engine", headers={"authorization": "Bearer t"}).json()
        assert listing == {"managed": True, "workers": [{"name": "cpu-0", "url": upstream_url, "state": "ready"}]}
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert upstream.requests[-1].path == "/v1/chat/completions"
        assert engines[0].calls == ["start"]
    assert engines[0].calls == ["start", "stop"]
    assert "ready: OpenAI-compatible API at http://127.0.0.1:8123/v1" in capsys.readouterr().err


def test_no_engine_is_started_when_managed_workers_are_off(upstream_url: str) -> None:
    port = int(upstream_url.rsplit(":", 1)[1])
    config = base_config(["cpu-0"], engine={"workers": [{"name": "cpu-0", "model": "smollm2", "port": port}]})
    started: list[Any] = []
    app = create_app(
        Settings(managed_workers=False),
        registry=PluginRegistry(),
        config=GatewayConfig.model_validate(config),
        engine_factory=lambda state, initial: started.append(initial),
    )
    with ServerThread(app) as server:
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert started == [] and app.state.engine is None


# -- the uvicorn factory ----------------------------------------------------------------------------


def test_the_uvicorn_factory_serves_the_config_file_and_follows_its_changes(
    upstream: FakeUpstream, upstream_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "config.yaml"
    config = base_config([upstream_url])
    path.write_text(yaml.safe_dump(config))
    monkeypatch.setenv("GATEWAY_CONFIG_PATH", str(path))
    monkeypatch.setenv("GATEWAY_CONFIG_WATCH_S", "0.05")
    monkeypatch.setenv("GATEWAY_MANAGED_WORKERS", "false")
    with ServerThread(asgi.app()) as server:
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
        config["models"][0]["aliases"] = ["renamed"]
        path.write_text(yaml.safe_dump(config))
        wait_for(lambda: httpx.get(server.url + "/v1/models/renamed").status_code == 200, 10, "the new alias")
        assert httpx.get(server.url + "/v1/models/alias-1").status_code == 404


# -- OTLP export ------------------------------------------------------------------------------------


async def read_body(receive: Any) -> bytes:
    """The whole body of an ASGI request."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            return body


class Collector:
    """An OTLP/HTTP trace collector: records each export request."""

    def __init__(self) -> None:
        self.exports: list[tuple[str, str, bytes]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body = await read_body(receive)
        headers = dict(scope["headers"])
        self.exports.append((scope["path"], headers.get(b"content-type", b"").decode(), body))
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/x-protobuf")]}
        )
        await send({"type": "http.response.body", "body": b""})


@pytest.mark.parametrize("suffix", ["", "/v1/traces/"])
def test_spans_are_exported_over_otlp_http_at_shutdown(upstream: FakeUpstream, upstream_url: str, suffix: str) -> None:
    collector = Collector()
    with ServerThread(collector, lifespan="off") as sink:
        app = create_app(
            Settings(otlp_endpoint=sink.url + suffix, service_name="cover-gateway"),
            registry=PluginRegistry(),
            config=GatewayConfig.model_validate(base_config([upstream_url])),
            engine_factory=None,
        )
        with ServerThread(app) as server:
            assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
        # the lifespan's shutdown flushed the batch processor
    assert collector.exports, "nothing was exported"
    names: list[str] = []
    services: set[str] = set()
    for path, content_type, body in collector.exports:
        assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
        request = ExportTraceServiceRequest.FromString(body)
        for resource_spans in request.resource_spans:
            services |= {a.value.string_value for a in resource_spans.resource.attributes if a.key == "service.name"}
            names += [span.name for scope in resource_spans.scope_spans for span in scope.spans]
    assert services == {"cover-gateway"}
    assert "POST /v1/chat/completions" in names and "upstream /v1/chat/completions" in names


# -- logs -------------------------------------------------------------------------------------------


def test_json_formatter_writes_one_object_with_fields_and_the_exception() -> None:
    logger = logging.getLogger("cover.json")
    try:
        raise ValueError("broken thing")
    except ValueError:
        record = logger.makeRecord(
            "cover.json",
            logging.ERROR,
            __file__,
            1,
            "failed %s",
            ("here",),
            sys.exc_info(),
            extra={"fields": {"request_id": "r1", "n": 2, "when": Path("/x")}},
        )
    line = JSONFormatter().format(record)
    entry = orjson.loads(line)
    assert "\n" not in line
    assert entry["level"] == "error" and entry["logger"] == "cover.json" and entry["msg"] == "failed here"
    assert entry["request_id"] == "r1" and entry["n"] == 2 and entry["when"] == "/x"  # not JSON: str()
    assert entry["pid"] == os.getpid()
    assert entry["ts"].endswith("Z") and "T" in entry["ts"]
    assert "ValueError: broken thing" in entry["exc"]


@pytest.fixture
def restored_logging() -> Iterator[None]:
    root = logging.getLogger()
    names = ("gateway.access", "uvicorn", "uvicorn.error", "uvicorn.access")
    saved = (
        root.handlers[:],
        root.level,
        {
            n: (
                logging.getLogger(n).handlers[:],
                logging.getLogger(n).level,
                logging.getLogger(n).propagate,
                logging.getLogger(n).disabled,
            )
            for n in names
        },
    )
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for name, (handlers, level, propagate, disabled) in saved[2].items():
        logger = logging.getLogger(name)
        logger.handlers[:], logger.level, logger.propagate, logger.disabled = handlers, level, propagate, disabled


def test_configure_logging_routes_every_logger_to_stderr_as_json(
    restored_logging: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    stderr = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stderr)
    uvicorn_error = logging.getLogger("uvicorn.error")
    uvicorn_error.addHandler(logging.NullHandler())
    uvicorn_error.propagate = False
    configure_logging("WARNING", access_log=False)
    logging.getLogger("gateway.test").info("not shown: below WARNING")
    logging.getLogger("gateway.test").warning("shown")
    uvicorn_error.error("from uvicorn")
    logging.getLogger("gateway.access").info("an access line, off")
    logging.getLogger("uvicorn.access").warning("uvicorn's access line is always off")
    lines = [orjson.loads(line) for line in stderr.getvalue().splitlines()]
    assert [(e["logger"], e["msg"]) for e in lines] == [("gateway.test", "shown"), ("uvicorn.error", "from uvicorn")]


def test_apply_logging_follows_the_config_unless_overridden(restored_logging: None) -> None:
    apply_logging(LoggingConfig(level="ERROR", access_log=False))
    assert logging.getLogger().level == logging.ERROR
    assert logging.getLogger("gateway.access").level == logging.WARNING
    apply_logging(LoggingConfig(level="ERROR", access_log=True), override="DEBUG")
    assert logging.getLogger().level == logging.DEBUG
    assert logging.getLogger("gateway.access").level == logging.INFO


# -- SIGTERM drain ----------------------------------------------------------------------------------


@pytest.fixture
def server_handler() -> Iterator[list[float]]:
    """A stand-in for uvicorn's SIGTERM handler (records when it was called); restores the real one."""
    calls: list[float] = []
    original = signal.getsignal(signal.SIGTERM)

    def handle(sig: int, frame: FrameType | None) -> None:
        calls.append(time.monotonic())

    signal.signal(signal.SIGTERM, handle)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, original)


async def test_first_sigterm_drains_then_hands_over_and_a_second_one_stops_at_once(server_handler: list[float]) -> None:
    state = SimpleNamespace(draining=False)
    restore = install_sigterm_drain(state, 0.2)  # type: ignore[arg-type]
    assert restore is not None
    os.kill(os.getpid(), signal.SIGTERM)  # Python runs the handler before the next statement
    assert state.draining and server_handler == []  # draining: still serving, the server not told yet
    for _ in range(500):
        if server_handler:
            break
        await asyncio.sleep(0.01)
    assert len(server_handler) == 1  # after the delay
    os.kill(os.getpid(), signal.SIGTERM)  # asked again while draining: straight to the server
    assert len(server_handler) == 2
    restore()
    os.kill(os.getpid(), signal.SIGTERM)
    assert len(server_handler) == 3  # the server's own handler again, not the drain


async def test_drain_is_not_installed_without_delay_handler_or_main_thread(server_handler: list[float]) -> None:
    state = SimpleNamespace(draining=False)
    assert install_sigterm_drain(state, 0) is None  # type: ignore[arg-type]
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    assert install_sigterm_drain(state, 1.0) is None  # type: ignore[arg-type]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN  # left alone

    from_thread: list[object] = []
    loop_thread = threading.Thread(target=lambda: from_thread.append(asyncio.run(_install_in_thread(state))))
    loop_thread.start()
    loop_thread.join(timeout=5)
    assert from_thread == [None]


async def _install_in_thread(state: Any) -> object:
    return install_sigterm_drain(state, 1.0)
