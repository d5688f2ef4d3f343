"""Whether a request may be answered from the cache, and whether its answer may be stored.

A request opts out with ``Cache-Control: no-cache`` (do not answer from the cache; the fresh answer
is still stored) or ``no-store`` (do not store the answer), and bounds the age of an answer it
accepts with ``max-age=N`` (seconds; 0 behaves like ``no-cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from gateway.wire.protocol import decimal, requested_choices
from plugins.cache.config import CacheConfig

#: ``finish_reason`` values of a complete answer; anything else (None, "abort", "error") is not stored.
COMPLETE_FINISH = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})
#: ``finish_reason`` values of an answer that ended on its own: what is stored for a request whose
#: ``max_tokens`` the gateway clamped (``RequestContext.clamped_max_tokens``), keyed as the client sent it.
#: One cut at the clamp ("length") is not the answer that request gets with more budget.
UNCUT_FINISH = COMPLETE_FINISH - {"length"}


@dataclass(frozen=True, slots=True)
class Decision:
    lookup: bool
    store: bool
    max_age_s: int | None = None
    reason: str = ""  # why the cache stays out of the way, for the bypass metric

    @property
    def bypass(self) -> bool:
        return not (self.lookup or self.store)


def parse_cache_control(value: str) -> tuple[bool, bool, int | None]:
    """(no_cache, no_store, max_age) from a ``Cache-Control`` request header; unknown directives ignored."""
    no_cache = no_store = False
    max_age: int | None = None
    for part in value.split(","):
        directive, _, arg = part.strip().lower().partition("=")
        if directive == "no-cache":
            no_cache = True
        elif directive == "no-store":
            no_store = True
        elif directive == "max-age":
            max_age = decimal(arg.strip().strip('"'))
    return no_cache, no_store, max_age


def is_deterministic(endpoint: str, body: dict[str, Any]) -> bool:
    """Greedy decoding (temperature 0) or a fixed seed; embeddings always are."""
    if endpoint == "embeddings":
        return True
    temperature = body.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0:
        return True
    seed = body.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def decide(config: CacheConfig, endpoint: str, model: str, body: dict[str, Any], headers: dict[str, str]) -> Decision:
    if endpoint not in config.endpoints:
        return Decision(False, False, reason="endpoint")
    if config.ttl_for(model) <= 0:
        return Decision(False, False, reason="model_disabled")
    if config.only_deterministic and not is_deterministic(endpoint, body):
        return Decision(False, False, reason="nondeterministic")
    options = body.get("stream_options")
    if options and type(options) is dict and options.get("continuous_usage_stats"):
        # vLLM's usage on every event: neither a stored answer nor recorded events replay it faithfully
        # to a client that asks otherwise (and the store asks the worker for the usage a miss needs).
        return Decision(False, False, reason="continuous_usage")
    header = headers.get("cache-control")
    if not header:
        return Decision(True, True)
    no_cache, no_store, max_age = parse_cache_control(header)
    lookup = not no_cache and max_age != 0
    store = not no_store
    return Decision(lookup, store, max_age, reason="" if lookup or store else "cache_control")


def is_complete(response: dict[str, Any], finished: frozenset[str] = COMPLETE_FINISH) -> bool:
    """A whole, successful answer: every choice finished normally, for one of the reasons ``finished``
    (or an embeddings list)."""
    if "error" in response:
        return False
    choices = response.get("choices")
    if not choices:
        return isinstance(response.get("data"), list)
    return all(isinstance(c, dict) and c.get("finish_reason") in finished for c in choices)


def stream_choices(endpoint: str, body: dict[str, Any]) -> int | None:
    """How many choices a streamed answer to ``body`` has (``n``), or None when that depends on more
    (legacy completions of a list of prompts: ``n`` for each)."""
    if endpoint == "chat/completions" or (endpoint == "completions" and isinstance(body.get("prompt"), str)):
        return requested_choices(body)
    return None


_FINISH = b'"finish_reason":'
_NOT_FINISHED = b'"finish_reason":null'


def events_complete(events: bytes, choices: int, finished: frozenset[str] = COMPLETE_FINISH) -> bool | None:
    """``is_complete`` for a streamed answer of ``choices`` choices from its events (JSON payloads one per
    line), parsing only the events that finish a choice (found from the end, where they are): every choice
    0 .. choices-1 finished normally (for one of the reasons ``finished``). None when its events carry no
    compact ``"finish_reason":`` member (assemble them instead). Only the members can match: inside a
    string value every quote is escaped."""
    members = events.count(_FINISH)
    if not members:
        return None
    left = members - events.count(_NOT_FINISHED)  # the members that are not null
    reasons_of: dict[int, Any] = {}  # read from the end: the first reason found for a choice is its last
    end = len(events)
    while left > 0:
        at = events.rfind(_FINISH, 0, end)
        start = events.rfind(b"\n", 0, at) + 1
        stop = events.find(b"\n", at)
        line = events[start : stop if stop >= 0 else len(events)]
        left -= line.count(_FINISH) - line.count(_NOT_FINISHED)
        end = start
        if line.count(_FINISH) == line.count(_NOT_FINISHED):
            continue
        try:
            chunk = orjson.loads(line)
        except orjson.JSONDecodeError:
            return False
        reasons: dict[int, Any] = {}
        for choice in chunk.get("choices") or () if isinstance(chunk, dict) else ():
            if isinstance(choice, dict) and choice.get("finish_reason") is not None:
                index = choice.get("index", 0)
                if type(index) is not int:
                    return None
                reasons[index] = choice["finish_reason"]
        for index, reason in reasons.items():
            reasons_of.setdefault(index, reason)
    return reasons_of.keys() == set(range(choices)) and all(
        isinstance(reason, str) and reason in finished for reason in reasons_of.values()
    )
