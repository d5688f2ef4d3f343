"""The loop that runs the plugins' hooks for one request, in the order the contract gives
(``gateway.pipeline.plugin``): each hook call bounded by its time budget, a failure handled by the
plugin's ``on_error`` policy, every call reported to an observer (metrics, traces)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from gateway.infra.deadlines import Deadlines
from gateway.ops.tracing import HookObserver
from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import OnError, Plugin, SideCall
from gateway.wire.errors import GatewayError, ServiceUnavailable

log = logging.getLogger("gateway.pipeline")

#: Records how long a hook call that returned took (``HookObserver.hook_recorder``).
Recorder = Callable[[float], None]


def _unobserved(seconds: float) -> None:
    """The recorder of a pipeline without an observer."""


@dataclass(frozen=True, slots=True, eq=False)  # identity equality: membership tests on the hot path
class BoundPlugin:
    """A plugin instance with the policy its config entry gave it."""

    name: str
    plugin: Plugin
    on_error: OnError
    timeout_s: float | None
    #: The time budget of each hook call, one timer for all of them (None: unbounded).
    deadlines: Deadlines | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadlines", Deadlines(self.timeout_s) if self.timeout_s is not None else None)


class Pipeline:
    """Runs the hooks of an ordered list of plugins for one request at a time (stateless itself)."""

    def __init__(self, plugins: list[BoundPlugin], observe: HookObserver | None = None) -> None:
        for bound in plugins:
            # ``_call`` awaits what a hook returns, inside the time budget and the on_error policy: a hook
            # that is not a coroutine function would run, and could raise, before either applies.
            plain = type(bound.plugin).plain_hooks()
            if plain:
                raise TypeError(
                    f"plugin '{bound.name}': {type(bound.plugin).__name__}.{plain[0]} must be an 'async def'"
                )
        self.plugins = plugins
        self._observe = observe
        # Per hook, the plugins that override it -> the recorder of their calls that return: a lookup is
        # both the membership test and the observer's label set, resolved here once.
        self._request_hooks = self._hooks("on_request")
        self._model_hooks = self._hooks("on_models")
        self._side_hooks = self._hooks("on_side_request")
        self._chunk_hooks = self._hooks("on_chunk")
        self._response_hooks = self._hooks("on_response")
        self.chunk_plugins = list(self._chunk_hooks)
        reads_text = [p for p in self._response_hooks if type(p.plugin).reads_stream_text]
        #: The plugins that make a stream be parsed chunk by chunk (when they ran and did not step aside).
        self._stream_watchers = frozenset(self.chunk_plugins + reads_text)
        #: The plugins that need only a stream's usage (``Plugin.reads_stream_text = False``).
        self._usage_watchers = frozenset(p for p in self._response_hooks if p not in self._stream_watchers)

    def _hooks(self, hook: str) -> dict[BoundPlugin, Recorder]:
        observe = self._observe
        return {
            bound: observe.hook_recorder(bound.name, hook) if observe is not None else _unobserved
            for bound in self.plugins
            if type(bound.plugin).overrides(hook)
        }

    async def run_request(self, ctx: RequestContext) -> ModelResponse | None:
        """``on_request`` in order. Returns an early answer or None. Records in ``ctx`` who ran and did
        not step aside: the plugins whose ``on_response`` / ``on_chunk`` this request calls."""
        ran: list[BoundPlugin] = ctx.returning
        hooks = self._request_hooks
        for bound in self.plugins:
            ok = hooks.get(bound)
            if ok is not None:
                early = await self._call(bound, "on_request", bound.plugin.on_request(ctx), ok)
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
        for bound, ok in self._model_hooks.items():
            models = await self._call(bound, "on_models", bound.plugin.on_models(headers, models), ok, models)
        return models

    async def run_side(self, call: SideCall) -> None:
        """``on_side_request`` in order: meter and bound a request to a route without inference."""
        for bound, ok in self._side_hooks.items():
            await self._call(bound, "on_side_request", bound.plugin.on_side_request(call), ok)

    async def run_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse:
        """``on_response`` in reverse order over the plugins whose ``on_request`` ran."""
        ran: list[BoundPlugin] = ctx.returning
        hooks = self._response_hooks
        for bound in reversed(ran):
            ok = hooks.get(bound)
            if ok is not None:
                replaced = await self._call(bound, "on_response", bound.plugin.on_response(ctx, response), ok)
                if replaced is not None:
                    response = replaced
        return response

    async def run_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        ran: list[BoundPlugin] = ctx.returning
        hooks = self._chunk_hooks
        current: dict[str, Any] | None = chunk
        for bound in reversed(ran):
            ok = hooks.get(bound)
            if ok is None:
                continue
            before = current
            assert before is not None
            current = await self._call(bound, "on_chunk", bound.plugin.on_chunk(ctx, before), ok, before)
            if current is None:
                return None
        return current

    async def _call(
        self, bound: BoundPlugin, hook: str, call: Awaitable[Any], ok: Recorder, fallback: Any = None
    ) -> Any:
        """Await one hook call (``call``, not started yet) within ``bound``'s time budget; ``ok`` records
        the time of a call that returned. A refusal is observed and goes on to the client; any other failure
        is observed and handled by ``_failed``; a cancelled call (the request went away) is not observed."""
        started = time.perf_counter()
        deadlines = bound.deadlines
        try:
            if deadlines is None:
                result = await call
            else:
                with deadlines.bound():
                    result = await call
        except GatewayError:
            # A refusal goes on to the client, re-raised bare here: raised again from a frame that names it (a
            # helper's parameter), it would hold that frame, and with it the request, in a reference cycle.
            self._observed(bound, hook, "refused", time.perf_counter() - started)
            raise
        except Exception as exc:  # a plugin bug must never crash the request loop
            return self._failed(bound, hook, exc, time.perf_counter() - started, fallback)
        ok(time.perf_counter() - started)
        return result

    def _failed(self, bound: BoundPlugin, hook: str, exc: Exception, seconds: float, fallback: Any) -> Any:
        """A hook call raised ``exc``, not a refusal (``GatewayError``, which goes on to the client): running
        over the budget or any other error is the plugin's failure, answered by its ``on_error`` policy (the
        ``fallback`` when it fails open, a 503 when it fails closed). Called in the ``except`` block."""
        if isinstance(exc, TimeoutError):
            outcome, what = "timeout", f"ran over its {(bound.timeout_s or 0) * 1000:.0f} ms budget"
        else:
            outcome, what = "error", f"failed ({type(exc).__name__})"
            log.exception("plugin %s.%s failed", bound.name, hook)
        self._observed(bound, hook, outcome, seconds)
        if bound.on_error == "fail_open":
            log.warning("plugin %s.%s %s; continuing (fail_open)", bound.name, hook, what)
            return fallback
        raise ServiceUnavailable(
            f"The '{bound.name}' plugin {what} and is configured to fail closed; try again later.",
            code="plugin_unavailable",
        )

    def _observed(self, bound: BoundPlugin, hook: str, outcome: str, seconds: float) -> None:
        if self._observe is not None:
            self._observe.observe_hook(bound.name, hook, outcome, seconds)

    async def aclose(self) -> None:
        for bound in reversed(self.plugins):
            try:
                await bound.plugin.aclose()
            except Exception:
                log.exception("plugin %s failed to close", bound.name)
