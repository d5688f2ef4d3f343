"""Prompts and answers longer than ``INLINE_SCAN_CHARS`` are scanned on the safety plugin's own thread, so
the event loop goes on serving other requests meanwhile; shorter ones are scanned on the loop (no thread
hop)."""

from __future__ import annotations

import asyncio
import threading
import time

from gateway.pipeline.plugin import Plugin
from plugins.safety.scan import INLINE_SCAN_CHARS
from tests.support.fakes import FakeUpstream
from tests.support.gateways import GatewayFactory, base_config
from tests.support.safety import chat

TICK_S = 0.01
# The rules of the shipped config.yaml.
RULES = [
    {"id": "secrets", "kind": "secrets", "action": "redact"},
    {"id": "payment-cards", "kind": "card", "action": "redact"},
    {"id": "prompt-injection", "kind": "injection", "action": "block", "threshold": 1.0},
]
KEY = "AKIAIOSFODNN7EXAMPLE"


class LoopWatch(Plugin):
    """Ticks every 10 ms on the gateway's event loop; ``longest`` is the largest pause past a tick."""

    name = "loop_watch"

    async def start(self) -> None:
        self.longest = 0.0
        self._ticker = asyncio.create_task(self._tick())

    async def _tick(self) -> None:
        last = time.perf_counter()
        while True:
            await asyncio.sleep(TICK_S)
            now = time.perf_counter()
            self.longest = max(self.longest, now - last - TICK_S)
            last = now

    async def aclose(self) -> None:
        self._ticker.cancel()


def _config(upstream_url: str, rules: list[dict[str, object]] = RULES) -> dict[str, object]:
    plugins = [{"name": "loop_watch"}, {"name": "safety", "config": {"rules": rules}}, {"name": "routing"}]
    return base_config([upstream_url], plugins=plugins)


def _orders(size: int) -> str:
    """``size`` characters of order lines (ids and hex references, which the secret and base64 passes look
    into) with a key at the end: about a second of scanning for 3 MB."""
    line = "Order 1234 shipped to Alice at 10:30; ref ABCDEF0123456789xyz, total $45.67. "
    return (line * (size // len(line))) + f"key {KEY} end"


def _scan_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("safety-scan")}


def test_a_prompt_of_megabytes_does_not_stall_the_event_loop(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream
) -> None:
    prompt = _orders(3_000_000)  # the gateway's body bound (4 MB by default) takes it
    with gateway_factory(_config(upstream_url), plugins={"loop_watch": LoopWatch}) as (app, server):
        watch = app.state.holder.current.pipeline.plugins[0].plugin
        assert isinstance(watch, LoopWatch)
        watch.longest = 0.0
        response = chat(server, prompt)
        longest = watch.longest
    assert response.status_code == 200, response.text
    sent = upstream.requests[-1].body["messages"][0]["content"]
    assert sent.endswith("key [SECRET] end") and KEY not in sent  # scanned off the loop, still redacted
    # Scanned on the loop this was a pause of about a second; on the thread, the loop's longest pause is
    # what the request's own parsing and forwarding take, and the scan's longest hold of the GIL.
    assert longest < 0.5, f"the event loop paused for {longest * 1000:.0f} ms"


def test_an_answer_of_megabytes_does_not_stall_the_event_loop(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream
) -> None:
    upstream.behavior.text = _orders(3_000_000)
    rules: list[dict[str, object]] = [{"id": "secrets", "kind": "secrets", "action": "redact", "apply_to": ["output"]}]
    with gateway_factory(_config(upstream_url, rules), plugins={"loop_watch": LoopWatch}) as (app, server):
        watch = app.state.holder.current.pipeline.plugins[0].plugin
        assert isinstance(watch, LoopWatch)
        watch.longest = 0.0
        response = chat(server, "Write out the order log.", n=2)
        longest = watch.longest
    assert response.status_code == 200, response.text
    answers = [choice["message"]["content"] for choice in response.json()["choices"]]
    assert len(answers) == 2
    assert all(a.endswith("key [SECRET] end") and KEY not in a for a in answers)  # scanned off the loop, redacted
    # Scanned on the loop, this answer was a pause of about two seconds (a second a choice).
    assert longest < 0.5, f"the event loop paused for {longest * 1000:.0f} ms"


def test_short_prompts_are_scanned_on_the_loop_and_the_thread_ends_with_the_plugin(
    gateway_factory: GatewayFactory, upstream_url: str, upstream: FakeUpstream
) -> None:
    before = _scan_threads()
    with gateway_factory(_config(upstream_url), plugins={"loop_watch": LoopWatch}) as (_, server):
        short = chat(server, "x" * (INLINE_SCAN_CHARS - len(KEY) - 1) + " " + KEY)
        assert short.status_code == 200, short.text
        assert upstream.requests[-1].body["messages"][0]["content"].endswith(" [SECRET]")
        assert _scan_threads() == before  # no thread hop for a prompt of INLINE_SCAN_CHARS characters
        long = chat(server, "x" * (INLINE_SCAN_CHARS - len(KEY)) + " " + KEY)
        assert long.status_code == 200, long.text
        assert upstream.requests[-1].body["messages"][0]["content"].endswith(" [SECRET]")
        started = _scan_threads() - before
        assert len(started) == 1  # one character more: scanned on the plugin's thread
    (thread,) = started
    thread.join(timeout=5)  # the gateway shut down: the plugin closed its thread
    assert not thread.is_alive()
