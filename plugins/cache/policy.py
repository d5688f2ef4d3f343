"""Whether a request may be answered from the cache, and whether its answer may be stored.

A request opts out with ``Cache-Control: no-cache`` (do not answer from the cache; the fresh answer
is still stored) or ``no-store`` (do not store the answer), and bounds the age of an answer it
accepts with ``max-age=N`` (seconds; 0 behaves like ``no-cache``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plugins.cache.config import CacheConfig

#: ``finish_reason`` values of a complete answer; anything else (None, "abort", "error") is not stored.
COMPLETE_FINISH = frozenset({"stop", "length", "tool_calls", "function_call", "content_filter"})


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
            arg = arg.strip().strip('"')
            if arg.isdigit():
                max_age = int(arg)
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
    header = headers.get("cache-control")
    if not header:
        return Decision(True, True)
    no_cache, no_store, max_age = parse_cache_control(header)
    lookup = not no_cache and max_age != 0
    store = not no_store
    return Decision(lookup, store, max_age, reason="" if lookup or store else "cache_control")


def is_complete(response: dict[str, Any]) -> bool:
    """A whole, successful answer: every choice finished normally (or an embeddings list)."""
    if "error" in response:
        return False
    choices = response.get("choices")
    if not choices:
        return isinstance(response.get("data"), list)
    return all(isinstance(c, dict) and c.get("finish_reason") in COMPLETE_FINISH for c in choices)
