"""Detection and redaction rates of the default safety rules on the red-team corpus, and false positives.

Every injection (should be blocked) and every secret or card (should be redacted: no spelling of it
reaches the worker) of ``tests/plugins/safety/corpus/`` is sent through the plugin's ``on_request``
as is and under each evasion (homoglyphs, fullwidth, zero-width, soft hyphens, whitespace, math
letters, combining marks, split over parts or messages, base64, tag characters, Hangul fillers, and for
injections only spaced-out letters and leetspeak); the clean prompts must pass untouched.
Then the cost of ``on_request`` (p50, including building the request context) by script and shape.

    .venv/bin/python bench/bench_safety_corpus.py
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.safety_corpus import EVASIONS, clean, injections, leaked, make_plugin, screen, secrets


def row(name: str, blocked: int, n_inj: int, redacted: int, n_sec: int) -> str:
    secrets_cell = f"{redacted:>7}/{n_sec:<3} {redacted / n_sec:6.1%}" if n_sec else f"{'n/a':>18}"
    return f"{name:18} {blocked:>9}/{n_inj:<3} {blocked / n_inj:6.1%} {secrets_cell}"


async def main() -> None:
    plugin = await make_plugin()
    print(f"{'evasion':18} {'injections blocked':>20} {'secrets redacted':>18}")
    total_inj = total_sec = hit_inj = hit_sec = 0
    for evasion in EVASIONS:
        blocked = 0
        for sample in injections():
            rule, _ = await screen(plugin, {"messages": evasion.messages(sample)})
            blocked += rule == "prompt-injection"
        redacted = 0
        tried = secrets() if evasion.secrets else []
        for _, sample in tried:
            rule, sent = await screen(plugin, {"messages": evasion.messages(sample)})
            redacted += rule is None and not leaked(sample, sent)
        n_inj, n_sec = len(injections()), len(tried)
        total_inj, total_sec, hit_inj, hit_sec = (
            total_inj + n_inj,
            total_sec + n_sec,
            hit_inj + blocked,
            hit_sec + redacted,
        )
        print(row(evasion.name, blocked, n_inj, redacted, n_sec))
    print(row("all", hit_inj, total_inj, hit_sec, total_sec))
    flagged = 0
    for sample in clean():
        messages = [{"role": "user", "content": sample}]
        rule, sent = await screen(plugin, {"messages": messages})
        flagged += rule is not None or sent["messages"] != messages
    print(f"false positives on the clean corpus: {flagged}/{len(clean())} ({flagged / len(clean()):.1%})")
    await cost(plugin)
    await plugin.aclose()


async def cost(plugin: object) -> None:
    """What normalisation and the wider scan cost: on_request p50 by script and request shape."""
    latin = "The quick brown fox jumps over the lazy dog while the team reviews the release plan. "
    samples = {
        "ASCII prose": latin,
        "accented Latin": "Café crème, naïve façade, jalapeño, Ångström, déjà vu. ",
        "Cyrillic": "Встреча перенесена на пятницу, пожалуйста, подтвердите. ",
        "CJK": "会议改到周五下午三点\uff0c请准时参加。",
        "zero-width every 3rd char": "ab\u200b",
    }
    print(f"\non_request p50 (ms), default rules, one user message{'':8} {'2 KB':>8} {'32 KB':>8}")
    for name, unit in samples.items():
        row_ms = []
        for size in (2048, 32768):
            text = (unit * (size // len(unit) + 1))[:size]
            row_ms.append(await p50(plugin, {"messages": [{"role": "user", "content": text}]}))
        print(f"{name:56} {row_ms[0]:8.3f} {row_ms[1]:8.3f}")
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": "Look up the weather for a city and a date.",
                "parameters": {
                    "type": "object",
                    "properties": {f"p{j}": {"type": "string", "description": "a parameter"} for j in range(8)},
                },
            },
        }
        for i in range(16)
    ]
    messages = [{"role": "user", "content": latin * 3} for _ in range(8)]
    shape = "8 messages of 256 chars + 16 tools x 8 parameters"
    print(f"{shape:56} {await p50(plugin, {'messages': messages, 'tools': tools}):8.3f}")


async def p50(plugin: object, body: dict[str, object], runs: int = 300) -> float:
    times = []
    for i in range(runs + 30):
        started = time.perf_counter()
        await screen(plugin, body)
        if i >= 30:
            times.append((time.perf_counter() - started) * 1000)
    return sorted(times)[len(times) // 2]


if __name__ == "__main__":
    asyncio.run(main())
