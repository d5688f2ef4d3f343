"""The engine benchmark's workload: its prompts and a streaming client that measures each request.

Every request streams a chat completion with ``include_usage``, ``temperature 0`` and ``ignore_eos`` (a
vLLM sampling field the gateway passes through) so all outputs have ``max_tokens`` tokens. TTFT is the
time to the first content delta; TPOT is (last delta - first delta) / (completion tokens - 1), right
also when speculative decoding puts several tokens in one delta.
"""

from __future__ import annotations

import asyncio
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson

MODEL = "smollm2"
TOPICS = ["the ocean", "a lighthouse keeper", "volcanoes", "a robot chef", "the moon", "winter in a city",
          "honeybees", "an old library", "trains", "a desert journey", "chess", "rainforests",
          "a lost key", "the first computer", "coffee", "mountain climbing"]  # fmt: skip
FORMS = ["Write a short story about {}.", "Explain {} to a child.", "Write a poem about {}."]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


# -- prompts ----------------------------------------------------------------------------------------


def chat_prompts(n: int, salt: str) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"{FORMS[i % 3].format(TOPICS[i % len(TOPICS)])} ({salt}-{i})"}]
            for i in range(n)]  # fmt: skip


def code_block(i: int) -> str:
    name = ["parse_order", "load_users", "merge_rows", "score_items"][i % 4]
    return (
        f"def {name}(records, limit={10 + i}):\n"
        f'    """Return the first {10 + i} valid records, newest first."""\n'
        "    result = []\n"
        "    for record in sorted(records, key=lambda r: r['created_at'], reverse=True):\n"
        "        if record.get('status') != 'active':\n"
        "            continue\n"
        "        if not record.get('email') or '@' not in record['email']:\n"
        "            continue\n"
        "        result.append({'id': record['id'], 'email': record['email'].lower(),\n"
        "                       'name': record.get('name', '').strip(), 'score': record.get('score', 0)})\n"
        "        if len(result) >= limit:\n"
        "            break\n"
        f"    total = sum(item['score'] for item in result)\n"
        f"    print('{name}:', len(result), 'records, total score', total)\n"
        "    return result\n"
    )


def grounded_prompts(n: int, salt: str) -> list[list[dict[str, str]]]:
    """Input-grounded: the answer is mostly a copy of the prompt (what prompt lookup can draft)."""
    return [[{"role": "user", "content": "Repeat the following Python code exactly, but rename the variable "
              f"`result` to `selected`. Output only the code.\n# {salt}-{i}\n```python\n{code_block(i)}```"}]
            for i in range(n)]  # fmt: skip


def long_system_prompt(nonce: str) -> str:
    """About 1,500 tokens of policy text; the nonce first, so two nonces share no cached block."""
    rules = [f"Rule {k}: when a customer asks about order {k * 7}, check the ledger entry {k * 13} and answer "
             f"politely, citing section {k % 9}." for k in range(1, 57)]  # fmt: skip
    return f"[session {nonce}] You are a support assistant. " + " ".join(rules)


# -- the client -------------------------------------------------------------------------------------


@dataclass
class Sample:
    ttft: float
    tpot: float | None
    tokens: int
    text: str


async def stream_one(client: httpx.AsyncClient, base: str, messages: Any, max_tokens: int) -> Sample:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    start = time.perf_counter()
    first = last = 0.0
    parts: list[str] = []
    tokens = 0
    async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{base}: {response.status_code} {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{base}: stream error {event['error']}")
            for choice in event.get("choices") or ():
                content = (choice.get("delta") or {}).get("content")
                if content:
                    last = time.perf_counter()
                    first = first or last
                    parts.append(content)
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    tpot = (last - first) / (tokens - 1) if tokens > 1 and first else None
    return Sample(ttft=first - start, tpot=tpot, tokens=tokens, text="".join(parts))


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with few samples p99 is the maximum, as it should be)."""
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))]


@dataclass
class Batch:
    concurrency: int
    requests: int
    wall_s: float
    tokens: int
    tokens_per_s: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    load: str
    texts: list[str] = field(repr=False)
    ttfts: list[float] = field(repr=False)
    tpots: list[float] = field(repr=False)
    #: CPU time the watched process (the gateway) used during the batch, per second of wall time.
    proxy_cpu_share: float | None = None


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a running process, from /proc (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def summarise(
    concurrency: int, wall: float, tokens: int, ttfts: list[float], tpots: list[float], load_: str, texts: list[str]
) -> Batch:
    return Batch(
        concurrency, len(ttfts), round(wall, 2), tokens, round(tokens / wall, 1),
        {"p50": round(pct(ttfts, 50), 1), "p99": round(pct(ttfts, 99), 1)},
        {"p50": round(pct(tpots, 50), 1), "p99": round(pct(tpots, 99), 1)} if tpots else {},
        load_, texts, ttfts, tpots,
    )  # fmt: skip


def merge(batches: list[Batch]) -> Batch:
    """Repetitions of one point: tokens over total wall time, percentiles over every request."""
    shares = [b.proxy_cpu_share for b in batches]
    merged = summarise(
        batches[0].concurrency, sum(b.wall_s for b in batches), sum(b.tokens for b in batches),
        [x for b in batches for x in b.ttfts], [x for b in batches for x in b.tpots],
        " | ".join(b.load for b in batches), [t for b in batches for t in b.texts],
    )  # fmt: skip
    if all(share is not None for share in shares):
        merged.proxy_cpu_share = round(
            sum(s * b.wall_s for s, b in zip(shares, batches, strict=True) if s) / merged.wall_s, 3
        )
    return merged


async def run_batch(
    base: str, prompts: list[Any], concurrency: int, max_tokens: int, watch_pid: int | None = None
) -> Batch:
    """Closed loop: ``concurrency`` clients take the prompts in order until none is left. With
    ``watch_pid``, the CPU share that process (the gateway) used meanwhile is recorded too."""
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
    for item in enumerate(prompts):
        queue.put_nowait(item)
    samples: dict[int, Sample] = {}
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def client_loop() -> None:
            while not queue.empty():
                index, messages = queue.get_nowait()
                samples[index] = await stream_one(client, base, messages, max_tokens)

        started_load, start = load(), time.perf_counter()
        cpu_start = cpu_seconds(watch_pid) if watch_pid else 0.0
        await asyncio.gather(*(client_loop() for _ in range(concurrency)))
        wall = time.perf_counter() - start
        cpu_used = cpu_seconds(watch_pid) - cpu_start if watch_pid else None
    ordered = [samples[i] for i in range(len(prompts))]
    batch = summarise(
        concurrency, wall, sum(s.tokens for s in ordered), [s.ttft * 1000 for s in ordered],
        [s.tpot * 1000 for s in ordered if s.tpot is not None], started_load, [s.text for s in ordered],
    )  # fmt: skip
    batch.proxy_cpu_share = None if cpu_used is None else round(cpu_used / wall, 3)
    return batch
