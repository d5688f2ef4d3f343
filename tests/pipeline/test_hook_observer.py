"""What the pipeline tells its observer of each hook call: a call that returned through the recorder the
observer gave for that plugin and hook (asked once, when the pipeline is built), every other outcome
through ``observe_hook``; and a hook that is not a coroutine function is refused when the pipeline is
built, since it would be called outside the time budget and the failure policy."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from gateway.pipeline.chain import BoundPlugin, Pipeline
from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.wire.errors import GatewayError, InvalidRequest


class Observer:
    """A HookObserver that writes down what it is asked and told."""

    def __init__(self) -> None:
        self.asked: list[tuple[str, str]] = []
        self.events: list[tuple[str, str, str]] = []

    def observe_hook(self, plugin: str, hook: str, outcome: str, seconds: float) -> None:
        assert seconds >= 0
        self.events.append((plugin, hook, outcome))

    def hook_recorder(self, plugin: str, hook: str) -> Callable[[float], None]:
        self.asked.append((plugin, hook))

        def ok(seconds: float) -> None:
            assert seconds >= 0
            self.events.append((plugin, hook, "ok"))

        return ok


class Plain(Plugin):
    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        return None

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        return None


class Refuses(Plugin):
    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        raise InvalidRequest("no", param="messages", code="content_filter")


class Breaks(Plugin):
    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        raise RuntimeError("bug")


class Sleeps(Plugin):
    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        await asyncio.sleep(5)
        return None


def bound(name: str, cls: type[Plugin], on_error: Any = "fail_open", timeout_s: float | None = None) -> BoundPlugin:
    return BoundPlugin(name, cls(None, None), on_error, timeout_s)  # type: ignore[arg-type]


def context() -> Any:
    return SimpleNamespace(returning=[], stepped_aside=None)


async def test_returned_calls_go_to_the_recorder_asked_once_per_plugin_and_hook() -> None:
    observer = Observer()
    pipeline = Pipeline([bound("a", Plain), bound("b", Plain)], observe=observer)
    assert sorted(observer.asked) == [
        ("a", "on_request"),
        ("a", "on_response"),
        ("b", "on_request"),
        ("b", "on_response"),
    ]
    for _ in range(3):
        ctx = context()
        assert await pipeline.run_request(ctx) is None
        await pipeline.run_response(ctx, ModelResponse(status=200, json={}))
    assert len(observer.asked) == 4  # nothing more asked per call
    one_request = [("a", "on_request", "ok"), ("b", "on_request", "ok"), ("b", "on_response", "ok")]
    one_request.append(("a", "on_response", "ok"))
    assert observer.events == one_request * 3


async def test_other_outcomes_are_observed_by_name() -> None:
    observer = Observer()
    plugins = [bound("slow", Sleeps, timeout_s=0.05), bound("broken", Breaks), bound("refuses", Refuses)]
    pipeline = Pipeline(plugins, observe=observer)
    with pytest.raises(GatewayError) as info:
        await pipeline.run_request(context())
    assert info.value.code == "content_filter"
    assert observer.events == [
        ("slow", "on_request", "timeout"),
        ("broken", "on_request", "error"),
        ("refuses", "on_request", "refused"),
    ]


async def test_a_time_budget_is_kept_per_call_and_fails_closed() -> None:
    observer = Observer()
    slow = bound("slow", Sleeps, on_error="fail_closed", timeout_s=0.05)
    pipeline = Pipeline([slow], observe=observer)
    with pytest.raises(GatewayError) as info:
        await asyncio.wait_for(pipeline.run_request(context()), 2)
    assert info.value.code == "plugin_unavailable" and "50 ms budget" in info.value.message
    assert slow.deadlines is not None and slow.deadlines.waiting == 0


async def test_a_cancelled_call_is_not_observed_and_stays_cancelled() -> None:
    observer = Observer()
    pipeline = Pipeline([bound("slow", Sleeps)], observe=observer)
    task = asyncio.ensure_future(pipeline.run_request(context()))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert observer.events == []


async def test_without_an_observer_calls_still_run() -> None:
    pipeline = Pipeline([bound("a", Plain)])
    ctx = context()
    assert await pipeline.run_request(ctx) is None
    assert [b.name for b in ctx.returning] == ["a"]


def test_a_hook_that_is_not_a_coroutine_function_is_refused_when_the_pipeline_is_built() -> None:
    class Sync(Plugin):
        def on_request(self, ctx: RequestContext) -> Any:
            raise RuntimeError("would escape the failure policy")

    with pytest.raises(TypeError, match=r"plugin 'sync': Sync\.on_request must be an 'async def'"):
        Pipeline([bound("sync", Sync)], observe=Observer())


def test_a_config_naming_a_plugin_with_a_plain_hook_is_refused_before_it_starts() -> None:
    import json

    from gateway.pipeline.config import ConfigError, parse_config
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins
    from tests.support.gateways import base_config

    class Started(Plugin):
        started = False

        async def start(self) -> None:
            Started.started = True

        def on_response(self, ctx: RequestContext, response: ModelResponse) -> Any:
            return None

    config = parse_config(json.dumps(base_config(["http://127.0.0.1:9"], plugins=[{"name": "p"}, {"name": "routing"}])))
    with pytest.raises(ConfigError) as info:
        resolve_plugins(config, PluginRegistry({"p": Started}, discover=False))
    assert "plugins[0].name: Started.on_response must be an 'async def'" in str(info.value)
    assert not Started.started
    assert Plain.plain_hooks() == [] and Started.plain_hooks() == ["on_response"]


def test_a_config_naming_a_plugin_with_an_async_plain_hook_is_refused() -> None:
    import json

    from gateway.pipeline.config import ConfigError, parse_config
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins
    from tests.support.gateways import base_config

    class Live(Plugin):
        # The core calls went_live without awaiting it: this body would never run.
        async def went_live(self) -> None:  # type: ignore[override]
            return None

        async def model_moves(self) -> Any:  # type: ignore[override]
            return {}

    config = parse_config(json.dumps(base_config(["http://127.0.0.1:9"], plugins=[{"name": "p"}, {"name": "routing"}])))
    with pytest.raises(ConfigError) as info:
        resolve_plugins(config, PluginRegistry({"p": Live}, discover=False))
    assert "plugins[0].name: Live.model_moves must be a plain 'def'" in str(info.value)
    assert "plugins[0].name: Live.went_live must be a plain 'def'" in str(info.value)
    assert Plain.async_hooks() == [] and Live.async_hooks() == ["model_moves", "went_live"]
