"""Traces: off by default; when on, a request span with one child per plugin hook and per upstream call,
continuing the client's traceparent and passing one to the worker. Also the opt-in content logging."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from gateway.ops.settings import Settings
from gateway.ops.tracing import Tracing
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.context import RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import GatewayApp, create_app
from tests.support.fakes import FakeUpstream, ServerThread
from tests.support.gateways import GatewayFactory, base_config

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "a private question"}]}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"


class Noop(Plugin):
    name = "noop"

    async def on_request(self, ctx: RequestContext) -> None:
        ctx.log["noop"] = "seen"


@contextlib.contextmanager
def traced_gateway(upstream_url: str, exporter: InMemorySpanExporter) -> Iterator[tuple[GatewayApp, ServerThread]]:
    config = base_config([upstream_url], plugins=[{"name": "noop"}, {"name": "routing"}])
    app = create_app(
        Settings(),
        registry=PluginRegistry({"noop": Noop}),
        config=GatewayConfig.model_validate(config),
        engine_factory=None,
    )
    # What GATEWAY_OTLP_ENDPOINT would build, with an in-memory exporter instead of OTLP/HTTP.
    app.state.services.tracing = Tracing.with_exporter(exporter)
    with ServerThread(app) as server:
        yield app, server


def test_tracing_is_off_by_default(gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str) -> None:
    with gateway_factory(base_config([upstream_url])) as (app, server):
        assert app.state.services.tracing is None
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
        assert "traceparent" not in upstream.requests[-1].headers


@pytest.mark.parametrize("stream", [False, True])
def test_request_hook_and_upstream_spans(upstream: FakeUpstream, upstream_url: str, stream: bool) -> None:
    exporter = InMemorySpanExporter()
    with traced_gateway(upstream_url, exporter) as (_, server):
        traceparent = f"00-{CLIENT_TRACE}-b7ad6b7169203331-01"
        r = httpx.post(
            server.url + "/v1/chat/completions", json={**CHAT, "stream": stream}, headers={"traceparent": traceparent}
        )
        assert r.status_code == 200
    spans = {span.name: span for span in exporter.get_finished_spans()}
    request = spans["POST /v1/chat/completions"]
    hook = spans["noop.on_request"]
    upstream_span = spans["upstream /v1/chat/completions"]
    assert format(request.context.trace_id, "032x") == CLIENT_TRACE  # continues the client's trace
    for child in (hook, upstream_span):
        assert child.context.trace_id == request.context.trace_id
        assert child.parent is not None and child.parent.span_id == request.context.span_id
        assert request.start_time <= child.start_time <= child.end_time <= request.end_time
    assert hook.attributes["gateway.outcome"] == "ok"
    assert upstream_span.attributes["gateway.worker"] == upstream_url
    assert request.attributes["gateway.model"] == "m1" and request.attributes["http.response.status_code"] == 200
    # The worker receives the trace context of the upstream call.
    sent = upstream.requests[-1].headers["traceparent"]
    assert sent.split("-")[1] == CLIENT_TRACE


def test_refused_request_span_is_an_error_only_for_server_failures(upstream: FakeUpstream, upstream_url: str) -> None:
    exporter = InMemorySpanExporter()
    upstream.behavior.status = 500
    with traced_gateway(upstream_url, exporter) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 502
    request = next(s for s in exporter.get_finished_spans() if s.name.startswith("POST"))
    assert request.status.status_code.name == "ERROR"


def _access_lines(caplog: pytest.LogCaptureFixture) -> list[dict[str, Any]]:
    return [r.fields for r in caplog.records if r.name == "gateway.access" and hasattr(r, "fields")]


def test_access_line_has_no_content_unless_enabled(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="gateway.access")
    plugins = {"noop": Noop}
    config = base_config([upstream_url], plugins=[{"name": "noop"}, {"name": "routing"}])
    with gateway_factory(config, plugins=plugins) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    (line,) = _access_lines(caplog)
    assert line["noop"] == "seen" and line["usage"]["completion_tokens"] == 3
    assert {"request_id", "model", "worker", "status", "duration_ms"} <= set(line)
    assert "a private question" not in repr(line) and upstream.behavior.text not in repr(line)

    caplog.clear()
    with gateway_factory({**config, "logging": {"log_content": True}}, plugins=plugins) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    (line,) = _access_lines(caplog)
    assert line["prompt"] == CHAT["messages"]
    assert line["completion"][0]["content"] == upstream.behavior.text
