"""The loop that runs the plugins' hooks for one request, in the order the contract gives
(``gateway.pipeline.plugin``): each hook call bounded by its time budget, a failure handled by the
plugin's ``on_error`` policy, every call reported to an observer (metrics, traces)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from gateway.ops.tracing import HookObserver
from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import OnError, Plugin, SideCall
from gateway.wire.errors import GatewayError, ServiceUnavailable

log = logging.getLogger("gateway.pipeline")


@dataclass(frozen=True, slots=True, eq=False)  # identity equality: membership tests on the hot path
class BoundPlugin:
    """A plugin instance with the policy its config entry gave it."""

    name: str
    plugin: Plugin
    on_error: OnError
    timeout_s: float | None


class Pipeline:
    """Runs the hooks of an ordered list of plugins for one request at a time (stateless itself)."""

    def __init__(self, plugins: list[BoundPlugin], observe: HookObserver | None = None) -> None:
        self.plugins = plugins
        self._observe = observe
        self._request_hooks = [p for p in plugins if type(p.plugin).overrides("on_request")]
        self._model_hooks = [p for p in plugins if type(p.plugin).overrides("on_models")]
        self._side_hooks = [p for p in plugins if type(p.plugin).overrides("on_side_request")]
        self.chunk_plugins = [p for p in plugins if type(p.plugin).overrides("on_chunk")]
        self.response_plugins = [p for p in plugins if type(p.plugin).overrides("on_response")]
        reads_text = [p for p in self.response_plugins if type(p.plugin).reads_stream_text]
        #: The plugins that make a stream be parsed chunk by chunk (when they ran and did not step aside).
        self._stream_watchers = frozenset(self.chunk_plugins + reads_text)
        #: The plugins that need only a stream's usage (``Plugin.reads_stream_text = False``).
        self._usage_watchers = frozenset(p for p in self.response_plugins if p not in self._stream_watchers)

    async def run_request(self, ctx: RequestContext) -> ModelResponse | None:
        """``on_request`` in order. Returns an early answer or None. Records in ``ctx`` who ran and did
        not step aside: the plugins whose ``on_response`` / ``on_chunk`` this request calls."""
        ran: list[BoundPlugin] = ctx.returning
        for bound in self.plugins:
            if bound in self._request_hooks:
                early = await self._call(bound, "on_request", bound.plugin.on_request, ctx)
                if early is not None:
                    return early
                aside = ctx.stepped_aside
                if aside is not None and bound.plugin in aside:
                    continue
            ran.append(bound)
        return None

    def inspects_stream(self, ctx: RequestContext) -> bool:
        """Whether this request's stream must be parsed chunk by chunk (False: byte pass-through)."""
        watchers, recorders = self._stream_watchers, ctx.recorders
        return any(bound in watchers and bound.plugin not in recorders for bound in ctx.returning)

    def settles_from_usage(self, ctx: RequestContext) -> bool:
        """Whether a pass-through stream of this request must find its usage for an ``on_response``."""
        watchers = self._usage_watchers
        return bool(watchers) and any(bound in watchers for bound in ctx.returning)

    async def run_models(self, headers: dict[str, str], models: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``on_models`` in order: the model cards this caller may see."""
        for bound in self._model_hooks:
            models = await self._call(bound, "on_models", bound.plugin.on_models, headers, models, fallback=models)
        return models

    async def run_side(self, call: SideCall) -> None:
        """``on_side_request`` in order: meter and bound a request to a route without inference."""
        for bound in self._side_hooks:
            await self._call(bound, "on_side_request", bound.plugin.on_side_request, call)

    async def run_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse:
        """``on_response`` in reverse order over the plugins whose ``on_request`` ran."""
        ran: list[BoundPlugin] = ctx.returning
        for bound in reversed(ran):
            if bound in self.response_plugins:
                replaced = await self._call(bound, "on_response", bound.plugin.on_response, ctx, response)
                if replaced is not None:
                    response = replaced
        return response

    async def run_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        ran: list[BoundPlugin] = ctx.returning
        current: dict[str, Any] | None = chunk
        for bound in reversed(ran):
            if bound not in self.chunk_plugins:
                continue
            before = current
            assert before is not None
            current = await self._call(bound, "on_chunk", bound.plugin.on_chunk, ctx, before, fallback=before)
            if current is None:
                return None
        return current

    async def _call(
        self,
        bound: BoundPlugin,
        hook: str,
        fn: Callable[..., Awaitable[Any]],
        *args: Any,
        fallback: Any = None,
    ) -> Any:
        started = time.perf_counter()
        outcome = "ok"
        try:
            if bound.timeout_s is None:
                return await fn(*args)
            async with asyncio.timeout(bound.timeout_s):
                return await fn(*args)
        except GatewayError:
            outcome = "refused"
            raise
        except TimeoutError:
            outcome = "timeout"
            return self._failed(bound, hook, f"ran over its {(bound.timeout_s or 0) * 1000:.0f} ms budget", fallback)
        except Exception as exc:  # a plugin bug must never crash the request loop
            outcome = "error"
            log.exception("plugin %s.%s failed", bound.name, hook)
            return self._failed(bound, hook, f"failed ({type(exc).__name__})", fallback)
        finally:
            if self._observe is not None:
                self._observe(bound.name, hook, outcome, time.perf_counter() - started)

    @staticmethod
    def _failed(bound: BoundPlugin, hook: str, what: str, fallback: Any) -> Any:
        if bound.on_error == "fail_open":
            log.warning("plugin %s.%s %s; continuing (fail_open)", bound.name, hook, what)
            return fallback
        raise ServiceUnavailable(
            f"The '{bound.name}' plugin {what} and is configured to fail closed; try again later.",
            code="plugin_unavailable",
        )

    async def aclose(self) -> None:
        for bound in reversed(self.plugins):
            try:
                await bound.plugin.aclose()
            except Exception:
                log.exception("plugin %s failed to close", bound.name)
