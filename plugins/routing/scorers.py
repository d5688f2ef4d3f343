"""Placement as a pure function: a snapshot of the candidate workers' state in, a ranked list out.

Each signal is a small scorer returning 0..1 for one worker, combined by weight (as llm-d's scheduler
composes its scorers):

- ``prefix``: the share of the prompt's full blocks the worker holds from the start (its KV index);
- ``queue``: ``1 - load / cap``, the load being the larger of this replica's in-flight requests and the
  worker's own running count (it sees every replica's requests; ours are fresher) plus the worker's
  waiting requests, and ``cap`` the bounded-load cap below. Not min-max over the candidates: with two
  workers and a few requests each, min-max makes one request's difference worth the whole weight, so a
  worker holding most of the prompt lost to one running a single request less, and the same prefix
  ended up cached (and evicted) on both;
- ``kv``: 1 - the worker's KV cache use (a full cache evicts to admit anything new);
- ``home``: the worker the request's ``prompt_cache_key`` last went to (``cache_keys``): the key's
  history is there even where it is not in full blocks yet.

A worker over the bounded-load cap (the policy's ``load_factor`` x the mean load, or the mean plus
``load_slack``, whichever is higher) ranks after every worker under it, whatever its prefix: a hot
prefix spills to another worker instead of queueing, as in approximate affinity.

A cold prompt (every candidate holds the same prefix of it, usually none) gives the prefix scorer
nothing to go by. Placed by load alone, new prefixes can pile up on one worker until its cache holds
fewer of them than it is asked for, and its LRU evicts each before it comes back while the other
worker's cache has room. So among the workers under the cap, a cold prompt goes to the one with the
smallest recent working set (``Candidate.working_set``: the distinct blocks recently placed there, see
``precise.PrecisePlacement``), as SGLang's cache-aware router sends a low-match request to the worker
with the smallest tree; working sets within one prompt's blocks of the smallest count as equal, and
the weighted score decides between them. The first request of a new ``prompt_cache_key`` (``fresh``)
is placed the same way whatever it holds: the client says it starts a lineage of its own. A request
whose key has a home among the candidates is never placed as cold: the home scorer keeps it there
unless the held prefix or the load says otherwise.

A prompt held for less than ``min_match`` of its blocks (half, by default) is placed as cold too: what
it would reuse is smaller than what it brings, so its new blocks go where the cache has room, as
SGLang's cache-aware router sends a request whose match rate is at most its ``cache_threshold`` (0.3)
to the worker with the smallest tree. Without it, a head every prompt shares (a long system prompt, a
benchmark's common prefix) pulls each new conversation to the worker that cached the head first, since
the other holds nothing; there the conversations outgrow one cache while the other stays empty.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker as placement sees it. ``running``, ``waiting`` and ``kv_usage`` are the worker's own
    signals (None when unknown or stale)."""

    key: str
    prefix_blocks: int
    in_flight: int
    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None
    working_set: int = 0  # distinct blocks recently placed on the worker (cold prompts go to the smallest)
    home: bool = False  # the request's prompt_cache_key last went here

    @property
    def load(self) -> float:
        return max(float(self.in_flight), self.running or 0.0) + (self.waiting or 0.0)


@dataclass(frozen=True, slots=True)
class Weights:
    prefix: float = 3.0
    queue: float = 2.0
    kv: float = 1.0
    home: float = 2.5


def prefix_score(c: Candidate, total_blocks: int) -> float:
    return c.prefix_blocks / total_blocks if total_blocks > 0 else 0.0


def queue_score(c: Candidate, cap: float) -> float:
    return max(0.0, 1.0 - c.load / cap)


def kv_score(c: Candidate) -> float:
    return 1.0 - min(max(c.kv_usage, 0.0), 1.0) if c.kv_usage is not None else 1.0


def rank(
    candidates: Sequence[Candidate],
    total_blocks: int,
    weights: Weights,
    *,
    load_factor: float = 1.25,
    load_slack: float = 4.0,
    fresh: bool = False,
    min_match: float = 0.5,
) -> list[tuple[float, Candidate]]:
    """Candidates best first, each with its score; ties keep the given order (callers rotate it).
    ``fresh``: the request starts a new ``prompt_cache_key`` lineage, placed as a cold prompt.
    ``min_match``: a prompt whose best-held share of blocks is under it is placed as a cold prompt."""
    if not candidates:
        return []
    mean = (sum(c.load for c in candidates) + 1) / len(candidates)
    cap = max(math.ceil(load_factor * mean), math.ceil(mean + load_slack))
    # cold: nothing says where the prompt belongs (no worker holds more of it, or a new lineage), so the
    # working sets decide; a request whose lineage has a home among the candidates is never cold
    cold = total_blocks > 0 and not any(c.home for c in candidates)
    best_held = max(c.prefix_blocks for c in candidates)
    weak = best_held < min_match * total_blocks  # it brings more than it would reuse
    cold = cold and (fresh or weak or len({c.prefix_blocks for c in candidates}) == 1)
    smallest = min(c.working_set for c in candidates)
    step = total_blocks
    scored = []
    for i, c in enumerate(candidates):
        score = (
            weights.prefix * prefix_score(c, total_blocks)
            + weights.queue * queue_score(c, cap)
            + weights.kv * kv_score(c)
            + (weights.home if c.home else 0.0)
        )
        room = (c.working_set - smallest) // step if cold else 0  # 0: as good as the smallest
        scored.append((c.load >= cap, room, -score, i, c))
    scored.sort(key=lambda t: t[:4])
    return [(-t[2], t[4]) for t in scored]
