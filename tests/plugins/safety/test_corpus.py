"""The red-team corpus: every injection and every secret, as is and under every evasion of issue 23,
is blocked or redacted by the default rules (issue 30 added tag characters, Hangul fillers, spaced letters
and leetspeak), and no clean prompt is flagged."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.safety_corpus import EVASIONS, clean, injections, leaked, make_plugin, screen, secrets


@pytest.fixture(scope="module")
def plugin() -> Iterator[Any]:
    loop = asyncio.new_event_loop()
    made = loop.run_until_complete(make_plugin())
    yield made
    loop.run_until_complete(made.aclose())
    loop.close()


def run(plugin: Any, messages: list[dict[str, Any]]) -> tuple[str | None, Any]:
    return asyncio.run(screen(plugin, {"messages": messages}))


@pytest.mark.parametrize("evasion", EVASIONS, ids=lambda e: e.name)
@pytest.mark.parametrize("sample", injections())
def test_injection_is_blocked(plugin: Any, sample: str, evasion: Any) -> None:
    blocked, _ = run(plugin, evasion.messages(sample))
    assert blocked == "prompt-injection"


@pytest.mark.parametrize("evasion", [e for e in EVASIONS if e.secrets], ids=lambda e: e.name)
@pytest.mark.parametrize(("kind", "sample"), secrets())
def test_secret_is_redacted(plugin: Any, kind: str, sample: str, evasion: Any) -> None:
    messages = evasion.messages(sample)
    blocked, sent = run(plugin, messages)
    assert blocked is None
    assert not leaked(sample, sent), sent["messages"]
    placeholder = "[CARD]" if kind == "card" else "[SECRET]"
    assert placeholder in str(sent["messages"])


@pytest.mark.parametrize("sample", clean())
def test_clean_prompt_passes_untouched(plugin: Any, sample: str) -> None:
    messages = [{"role": "user", "content": sample}]
    blocked, sent = run(plugin, messages)
    assert blocked is None
    assert sent["messages"] == messages
