"""OpenTelemetry traces: one span per request, one per plugin hook call, one per upstream call.

Off by default, and then free: the app holds ``None`` instead of a ``Tracing`` and the hot path tests
for that once per request; the SDK and exporter are imported only when ``GATEWAY_OTLP_ENDPOINT`` is set.
When on, spans go through a batch processor to the OTLP/HTTP endpoint, the request span continues the
client's ``traceparent`` and the upstream call sends one to the worker (vLLM can continue it with
``--otlp-traces-endpoint``).

Hook and upstream spans are recorded *after* the call with its measured start and end, from the timing
the pipeline already takes for metrics: no extra context switch or allocation inside the hook itself.
The provider is owned by the app, never installed as the process-global one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

    from gateway.ops.settings import Settings


class HookObserver(Protocol):
    """Told of every plugin hook call (the pipeline calls it; metrics and traces implement it)."""

    def observe_hook(self, plugin: str, hook: str, outcome: str, seconds: float) -> None:
        """One call of ``plugin.hook`` that ended with ``outcome`` (ok, refused, timeout, error)."""
        ...

    def hook_recorder(self, plugin: str, hook: str) -> Callable[[float], None]:
        """What ``observe_hook(plugin, hook, "ok", seconds)`` does, as a function of ``seconds`` alone:
        the pipeline asks once per plugin and hook and calls it on every call that returned, so the
        common outcome's label lookup is not paid per call."""
        ...


_PROPAGATOR = TraceContextTextMapPropagator()  # stateless, immutable


@dataclass(slots=True)
class RequestSpan:
    """The open span of one request, current in its task until ``end``."""

    span: trace.Span
    token: object

    def end(self, attributes: dict[str, Any], status: int) -> None:
        for key, value in attributes.items():
            if isinstance(value, str | bool | int | float):
                self.span.set_attribute(f"gateway.{key}", value)
        self.span.set_attribute("http.response.status_code", status)
        if status >= 500 or status == 0:
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()
        otel_context.detach(self.token)  # type: ignore[arg-type]


class Tracing:
    """The app's tracer. Build with ``from_settings`` (OTLP) or ``with_exporter`` (tests, other sinks)."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("gateway")

    @classmethod
    def from_settings(cls, settings: Settings) -> Tracing | None:
        if not settings.otlp_endpoint:
            return None
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        endpoint = settings.otlp_endpoint.rstrip("/")
        if not endpoint.endswith("/v1/traces"):
            endpoint += "/v1/traces"
        return cls.with_exporter(OTLPSpanExporter(endpoint=endpoint, timeout=5), settings.service_name, batch=True)

    @classmethod
    def with_exporter(
        cls, exporter: SpanExporter, service_name: str = "vllm-gateway", *, batch: bool = False
    ) -> Tracing:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
        provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
        return cls(provider)

    # -- request ----------------------------------------------------------------------------------

    def start_request(self, route: str, headers: list[tuple[bytes, bytes]]) -> RequestSpan:
        """Open the request span (continuing an incoming ``traceparent``) and make it current."""
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
        parent = _PROPAGATOR.extract(carrier) if carrier else None
        span = self.tracer.start_span(f"POST /v1/{route}", context=parent, kind=SpanKind.SERVER)
        span.set_attribute("gateway.route", route)
        token = otel_context.attach(trace.set_span_in_context(span))
        return RequestSpan(span, token)

    # -- children, recorded after the fact --------------------------------------------------------

    def hook_observer(self, inner: HookObserver) -> HookObserver:
        """Wrap the metrics observer so each hook call also becomes a span under the request span."""
        return _TracedHooks(inner, self)

    def record(self, name: str, seconds: float, attributes: dict[str, Any], *, error: bool = False) -> None:
        end = time.time_ns()
        span = self.tracer.start_span(name, start_time=end - int(seconds * 1e9), attributes=attributes)
        if error:
            span.set_status(Status(StatusCode.ERROR))
        span.end(end_time=end)

    @staticmethod
    def inject() -> dict[str, str]:
        """``traceparent`` for the upstream call, continuing the current span."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier)
        return carrier

    def shutdown(self) -> None:
        """Flush what is buffered (bounded by the exporter's timeout) and stop exporting."""
        self.provider.shutdown()


class _TracedHooks:
    """A ``HookObserver`` that passes each call on to ``inner`` and records it as a span."""

    __slots__ = ("_inner", "_tracing")

    def __init__(self, inner: HookObserver, tracing: Tracing) -> None:
        self._inner, self._tracing = inner, tracing

    def observe_hook(self, plugin: str, hook: str, outcome: str, seconds: float) -> None:
        self._inner.observe_hook(plugin, hook, outcome, seconds)
        self._tracing.record(f"{plugin}.{hook}", seconds, {"gateway.plugin": plugin, "gateway.outcome": outcome})

    def hook_recorder(self, plugin: str, hook: str) -> Callable[[float], None]:
        inner, record = self._inner.hook_recorder(plugin, hook), self._tracing.record
        name, attributes = f"{plugin}.{hook}", {"gateway.plugin": plugin, "gateway.outcome": "ok"}

        def ok(seconds: float) -> None:
            inner(seconds)
            record(name, seconds, attributes)

        return ok
