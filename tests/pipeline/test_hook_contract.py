"""The plugin contract: order, reverse order, early answers, refusals, failure policies, time budgets."""

from __future__ import annotations

import asyncio
import functools
from typing import Any, ClassVar

import httpx
import openai
import pytest
from pydantic import BaseModel

from gateway.pipeline.context import ModelResponse, RequestContext
from gateway.pipeline.plugin import Plugin
from gateway.wire.errors import InvalidRequest
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.support.metrics import admin_metrics

CHAT = {"model": "m1", "messages": [{"role": "user", "content": "hi"}]}


class TagConfig(BaseModel):
    tag: str = "x"
    answer_early: bool = False
    refuse: bool = False
    step_aside: bool = False


class Recorder(Plugin):
    """Records every hook call into a list shared through the test."""

    calls: ClassVar[list[str]] = []
    Config = TagConfig

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        self.calls.append(f"req:{self.config.tag}")
        if self.config.refuse:
            raise InvalidRequest(f"refused by {self.config.tag}", param="messages", code="content_filter")
        if self.config.step_aside:
            ctx.step_aside(self)
        if self.config.answer_early:
            return ModelResponse(
                json={
                    "id": "early",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m1",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "early answer"},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3},
                }
            )
        return None

    async def on_response(self, ctx: RequestContext, response: ModelResponse) -> ModelResponse | None:
        self.calls.append(f"resp:{self.config.tag}")
        return None

    async def on_chunk(self, ctx: RequestContext, chunk: dict[str, Any]) -> dict[str, Any] | None:
        self.calls.append(f"chunk:{self.config.tag}")
        return chunk


def recorder(tag: str, **extra: Any) -> dict[str, Any]:
    return {"name": f"rec_{tag}", "config": {"tag": tag, **extra}}


def rec_plugins(*tags: str) -> dict[str, type[Plugin]]:
    return {f"rec_{t}": Recorder for t in tags}


@pytest.fixture(autouse=True)
def _clear_calls() -> None:
    Recorder.calls.clear()


def test_hooks_run_in_order_and_reverse_order(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url], plugins=[recorder("a"), recorder("b"), {"name": "routing"}])
    with gateway_factory(config, plugins=rec_plugins("a", "b")) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert Recorder.calls == ["req:a", "req:b", "resp:b", "resp:a"]


def test_stream_chunks_run_in_reverse_order_and_response_sees_the_assembly(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url], plugins=[recorder("a"), recorder("b"), {"name": "routing"}])
    upstream.behavior.chunks = 2
    with gateway_factory(config, plugins=rec_plugins("a", "b")) as (_, server):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        text = "".join(
            ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**CHAT, stream=True) if ch.choices
        )
    assert text == "Hello from the fake worker."
    chunk_calls = [c for c in Recorder.calls if c.startswith("chunk")]
    assert chunk_calls[:2] == ["chunk:b", "chunk:a"]
    assert Recorder.calls[-2:] == ["resp:b", "resp:a"]


@pytest.mark.parametrize("stream", [False, True])
def test_early_answer_skips_later_hooks_and_the_upstream(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, stream: bool
) -> None:
    plugins = [recorder("a"), recorder("b", answer_early=True), recorder("c"), {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins), plugins=rec_plugins("a", "b", "c")) as (
        _,
        server,
    ):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        if stream:
            events = list(c.chat.completions.create(**CHAT, stream=True, stream_options={"include_usage": True}))
            text = "".join(e.choices[0].delta.content or "" for e in events if e.choices)
            assert events[-1].usage is not None and events[-1].usage.total_tokens == 3
        else:
            text = c.chat.completions.create(**CHAT).choices[0].message.content or ""
    assert text == "early answer"
    assert upstream.requests == []
    # Symmetry: the plugin that answered and those after it get no on_response; those before do.
    assert Recorder.calls == ["req:a", "req:b", "resp:a"]


@pytest.mark.parametrize("stream", [False, True])
def test_refusal_makes_zero_upstream_calls(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, stream: bool
) -> None:
    plugins = [recorder("a"), recorder("b", refuse=True), {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins), plugins=rec_plugins("a", "b")) as (_, server):
        c = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.BadRequestError) as info:
            c.chat.completions.create(**CHAT, stream=stream)
    assert info.value.code == "content_filter"
    assert upstream.requests == []
    assert Recorder.calls == ["req:a", "req:b"]


class Broken(Plugin):
    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        raise RuntimeError("bug in a plugin")


class Slow(Plugin):
    default_timeout_ms = 50

    async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
        await asyncio.sleep(5)
        return None


@pytest.mark.parametrize("cls", [Broken, Slow])
def test_fail_closed_answers_503_and_fail_open_goes_on(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, cls: type[Plugin]
) -> None:
    closed = base_config([upstream_url], plugins=[{"name": "p"}, {"name": "routing"}])
    with gateway_factory(closed, plugins={"p": cls}) as (_, server):
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "plugin_unavailable"
        assert "Traceback" not in response.text and "bug in a plugin" not in response.text
    assert upstream.requests == []

    opened = base_config([upstream_url], plugins=[{"name": "p", "on_error": "fail_open"}, {"name": "routing"}])
    with gateway_factory(opened, plugins={"p": cls}) as (_, server):
        response = httpx.post(server.url + "/v1/chat/completions", json=CHAT, timeout=10)
        assert response.status_code == 200
        metrics = admin_metrics(server)
        outcome = "error" if cls is Broken else "timeout"
        assert f'gateway_plugin_hook_duration_seconds_count{{hook="on_request",outcome="{outcome}",plugin="p"}}' in (
            metrics
        )


def test_hook_time_budget_from_config_overrides_the_default(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    config = base_config([upstream_url], plugins=[{"name": "p", "timeout_ms": 20000}, {"name": "routing"}])

    class AlmostSlow(Slow):
        async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
            await asyncio.sleep(0.2)  # over the class default (50 ms), within the configured budget
            return None

    with gateway_factory(config, plugins={"p": AlmostSlow}) as (_, server):
        assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200


def test_body_changes_by_a_plugin_reach_the_upstream(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    class Rewrite(Plugin):
        async def on_request(self, ctx: RequestContext) -> ModelResponse | None:
            ctx.body["messages"][0]["content"] = "rewritten"
            ctx.mark_body_changed()
            return None

    config = base_config([upstream_url], plugins=[{"name": "rw"}, {"name": "routing"}])
    with gateway_factory(config, plugins={"rw": Rewrite}) as (_, server):
        httpx.post(server.url + "/v1/chat/completions", json=CHAT)
    assert upstream.requests[-1].body["messages"][0]["content"] == "rewritten"


def test_unchanged_bodies_go_upstream_byte_for_byte(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    raw = b'{"model":"m1",  "messages":[{"role":"user","content":"hi"}], "x_unknown": {"kept": true}}'
    # x_unknown stands for an operator's extension field, allowed through limits.extra_params.
    with gateway_factory(base_config([upstream_url], limits={"extra_params": ["x_unknown"]})) as (_, server):
        httpx.post(server.url + "/v1/chat/completions", content=raw)
    assert upstream.requests[-1].raw == raw


def test_unknown_plugin_and_invalid_plugin_config_are_refused_with_field_paths(
    gateway_factory: GatewayFactory, upstream_url: str
) -> None:
    from gateway.pipeline.config import ConfigError, GatewayConfig
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins

    registry = PluginRegistry({"rec_a": Recorder})
    config = GatewayConfig.model_validate(
        base_config([upstream_url], plugins=[{"name": "nope"}, {"name": "rec_a", "config": {"tag": 5}}])
    )
    with pytest.raises(ConfigError) as info:
        resolve_plugins(config, registry)
    assert info.value.problems[0].startswith("plugins[0].name: unknown plugin 'nope'")
    assert info.value.problems[1].startswith("plugins[1].config.tag:")


class Replacer(Plugin):
    """Stands for a plugin whose on_response may put another answer in place (a retry)."""

    replaces_answers = True


def resolved_names(upstream_url: str, plugins: dict[str, type[Plugin]], *entries: dict[str, Any]) -> list[str]:
    """The names of the plugins a config listing ``entries`` resolves to, with only ``plugins`` registered
    (a ``ConfigError`` when its order breaks the contract)."""
    from gateway.pipeline.config import GatewayConfig
    from gateway.pipeline.registry import PluginRegistry
    from gateway.pipeline.validate import resolve_plugins

    config = GatewayConfig.model_validate(base_config([upstream_url], plugins=list(entries)))
    return [item.entry.name for item in resolve_plugins(config, PluginRegistry(plugins, discover=False))]


class Keeper(Plugin):
    """Stands for a plugin whose on_response keeps answers for later requests (a cache)."""

    keeps_answers = True


def test_a_plugin_that_keeps_answers_must_come_before_one_that_replaces_them(upstream_url: str) -> None:
    """on_response runs in reverse order: listed after a plugin that replaces answers, a keeper would keep
    an answer before it was replaced. The order is refused by name, whatever the plugins are called; a
    disabled replacer, a keeper listed first, and plugins that set neither attribute are taken."""
    from gateway.pipeline.config import ConfigError

    resolve = functools.partial(resolved_names, upstream_url, {"retrier": Replacer, "store": Keeper, "plain": Recorder})

    with pytest.raises(ConfigError) as info:
        resolve({"name": "retrier"}, {"name": "plain"}, {"name": "store"})
    [problem] = info.value.problems
    assert problem.startswith("plugins[2].name: 'store' must come before 'retrier' (plugins[0])")
    assert resolve({"name": "store"}, {"name": "retrier"}) == ["store", "retrier"]
    assert resolve({"name": "retrier", "enabled": False}, {"name": "store"}) == ["store"]
    assert resolve({"name": "plain"}, {"name": "store"}) == ["plain", "store"]


class Identifier(Plugin):
    """Stands for a plugin whose on_request decides who is calling (access control)."""

    identifies_callers = True


def test_a_plugin_that_identifies_callers_must_come_before_one_that_keeps_answers(upstream_url: str) -> None:
    """on_request runs in list order: listed after a plugin that keeps answers, the one that decides who is
    calling would see a request the keeper already answered. The order is refused by the plugins'
    attributes, whatever they are called; a disabled identifier and plugins that set neither are taken."""
    from gateway.pipeline.config import ConfigError

    resolve = functools.partial(resolved_names, upstream_url, {"auth": Identifier, "store": Keeper, "plain": Recorder})

    with pytest.raises(ConfigError) as info:
        resolve({"name": "store"}, {"name": "plain"}, {"name": "auth"})
    [problem] = info.value.problems
    assert problem.startswith("plugins[2].name: 'auth' must come before 'store' (plugins[0])")
    assert resolve({"name": "auth"}, {"name": "store"}) == ["auth", "store"]
    assert resolve({"name": "store"}, {"name": "auth", "enabled": False}) == ["store"]
    assert resolve({"name": "plain"}, {"name": "store"}) == ["plain", "store"]


# -- stepping aside: per-request opt-out of the way back -------------------------------------------

COMMENT = b": from the worker\n\n"  # an SSE comment: kept by a byte pass-through, dropped by parsing


def stream_bytes(server_url: str, **extra: Any) -> bytes:
    body = {**CHAT, "stream": True, **extra}
    with httpx.stream("POST", server_url + "/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
        return response.read()


@pytest.mark.parametrize("stream", [False, True])
def test_a_plugin_that_steps_aside_gets_no_chunk_or_response_hooks(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str, stream: bool
) -> None:
    plugins = [recorder("a", step_aside=True), recorder("b"), {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins), plugins=rec_plugins("a", "b")) as (_, server):
        if stream:
            stream_bytes(server.url)
        else:
            assert httpx.post(server.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert [c for c in Recorder.calls if c.endswith(":a")] == ["req:a"]
    assert "resp:b" in Recorder.calls
    assert ("chunk:b" in Recorder.calls) is stream


def test_a_stream_passes_through_as_bytes_only_when_every_watcher_stepped_aside(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    upstream.behavior.preamble = COMMENT
    both_aside = [recorder("a", step_aside=True), recorder("b", step_aside=True), {"name": "routing"}]
    one_watching = [recorder("a", step_aside=True), recorder("b"), {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=both_aside), plugins=rec_plugins("a", "b")) as (_, s):
        passed = stream_bytes(s.url)
    with gateway_factory(base_config([upstream_url], plugins=one_watching), plugins=rec_plugins("a", "b")) as (_, s):
        parsed = stream_bytes(s.url)
    assert passed.startswith(COMMENT) and passed.endswith(b"data: [DONE]\n\n")
    assert COMMENT not in parsed and parsed.endswith(b"data: [DONE]\n\n")
    # The same events either way: only the comment (which parsing drops) differs.
    assert passed.removeprefix(COMMENT) == parsed


def test_stepping_aside_does_not_skip_an_early_answer_or_the_hooks_of_plugins_before_it(
    gateway_factory: GatewayFactory, upstream: FakeUpstream, upstream_url: str
) -> None:
    plugins = [recorder("a"), recorder("b", step_aside=True), recorder("c", answer_early=True), {"name": "routing"}]
    with gateway_factory(base_config([upstream_url], plugins=plugins), plugins=rec_plugins("a", "b", "c")) as (_, s):
        response = httpx.post(s.url + "/v1/chat/completions", json=CHAT)
    assert response.json()["choices"][0]["message"]["content"] == "early answer"
    assert Recorder.calls == ["req:a", "req:b", "req:c", "resp:a"]
    assert upstream.requests == []
