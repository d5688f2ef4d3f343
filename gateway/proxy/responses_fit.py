"""``truncation: "auto"`` on a Responses turn: drop the oldest turns of the conversation until what the
worker will read fits its context.

The worker counts: its ``/tokenize`` renders the chat messages with the model's own template and
answers the count and the model's context (``max_model_len``), so nothing here guesses a tokenizer.
Whole turns go (a turn starts at a user message), never half of one, so a tool output is never sent
without the call it answers. What is dropped is only left out of this request: the stored conversation
keeps every turn. When the worker cannot count (no ``/tokenize``, no answer in time) the request goes
as it is, and a conversation longer than the context is refused by the worker, as with
``truncation: "disabled"``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import orjson

from gateway.upstream.client import UpstreamClient, UpstreamFailure

log = logging.getLogger("gateway.responses")
#: Header on the answer naming how many input items of the conversation were left out (0: none).
TRUNCATED_HEADER = "x-gateway-truncated-items"
_MAX_ROUNDS = 64  # counts per turn at most (each one /tokenize call); bisection needs about log2(turns) + 2
_COUNT_WAIT_S = 2.0


async def fit_history(
    upstream: UpstreamClient,
    worker_url: str,
    chat_for: Callable[[list[dict[str, Any]]], dict[str, Any]],
    history: list[dict[str, Any]],
    reserve: int,
) -> tuple[list[dict[str, Any]], int]:
    """The newest whole turns of ``history`` whose chat request (``chat_for(kept)``) leaves ``reserve``
    tokens of the worker's context free, and how many items were left out."""
    # Where ``kept`` may start: the first item, every later turn (a user message), the end (nothing kept).
    # Fewer turns never count more tokens, so the first start that fits is found by bisection: a few
    # counts for any length of conversation, rather than one per dropped turn.
    starts = [0, *_turn_starts(history), len(history)]
    low, high = 0, len(starts) - 1  # starts[high] fits (nothing kept is always accepted)
    for _ in range(_MAX_ROUNDS):
        if low >= high:
            break
        middle = low if low == 0 else (low + high) // 2  # the whole conversation is counted first
        counted = await _count(upstream, worker_url, chat_for(history[starts[middle] :]))
        if counted is None:
            if high == len(starts) - 1:
                return history, 0  # no count that fits: the request goes whole
            break
        tokens, context = counted
        if tokens + reserve <= context:
            high = middle
        else:
            low = middle + 1
    kept = history[starts[high] :]
    return kept, len(history) - len(kept)


def _turn_starts(items: list[dict[str, Any]]) -> list[int]:
    """Where each turn of ``items`` after the first starts (its user message)."""
    return [
        index
        for index, item in enumerate(items)
        if index > 0 and item.get("type") == "message" and item.get("role") == "user"
    ]


async def _count(upstream: UpstreamClient, worker_url: str, chat: dict[str, Any]) -> tuple[int, int] | None:
    body = {key: chat[key] for key in ("model", "messages", "tools") if chat.get(key) is not None}
    try:
        async with asyncio.timeout(_COUNT_WAIT_S):
            response = await upstream.open(worker_url, "/tokenize", orjson.dumps(body))
            raw = await response.read()
        answer = orjson.loads(raw) if response.status == 200 else None
    except (TimeoutError, UpstreamFailure, orjson.JSONDecodeError) as exc:
        log.info("no token count from %s for truncation: %s", worker_url, exc)
        return None
    count = answer.get("count") if isinstance(answer, dict) else None
    context = answer.get("max_model_len") if isinstance(answer, dict) else None
    if isinstance(count, int) and isinstance(context, int) and context > 0:
        return count, context
    return None
