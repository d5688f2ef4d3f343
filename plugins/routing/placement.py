"""Where a request for a LoRA adapter goes: a pure function from a snapshot of the workers to a ranking.

Each signal is a small scorer with a weight, summed per worker (as llm-d's scheduler composes its
scorers); the best-scored worker wins and ties keep the order given (the caller rotates it, so an idle
pool is spread evenly):

- ``affinity``: the worker holds the adapter (or is loading it now) and is not overloaded: no load, no
  eviction, and a request that arrives while the first one's load is running joins that load.
- ``free_slot``: the worker does not hold it but has a free adapter slot: loading there evicts nothing.
- ``load``: fewer requests in flight (plus the worker's own queue when load metrics are scraped).

"Overloaded" is the bound of consistent hashing with bounded loads (``policies.WorkerPool.hashed``):
``max(ceil(load_factor * mean), ceil(mean + load_slack))`` with ``mean = (total + 1) / workers``. A hot
adapter spills to a second worker (which loads it) instead of queueing behind one.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from gateway.upstream.workers import Worker


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What placement knows of one candidate worker at one instant."""

    worker: Worker
    load: float  # requests in flight, plus any bias from the worker's own metrics
    holds: bool  # registered there, or being loaded there now
    free_slots: int  # adapter slots left before a load must evict (max_loras - held - loading)


@dataclass(frozen=True, slots=True)
class Scene:
    """What every scorer may compare a worker with: the load bound of this instant."""

    cap: float


Scorer = Callable[[WorkerView, Scene], float]


def affinity(view: WorkerView, scene: Scene) -> float:
    return 1.0 if view.holds and view.load < scene.cap else 0.0


def free_slot(view: WorkerView, scene: Scene) -> float:
    return 1.0 if not view.holds and view.free_slots > 0 else 0.0


def least_load(view: WorkerView, scene: Scene) -> float:
    return -view.load


def load_cap(loads: Sequence[float], load_factor: float, load_slack: int) -> float:
    """The bound above which a worker counts as overloaded (counting the request being placed)."""
    if not loads:
        return math.inf
    mean = (sum(loads) + 1) / len(loads)
    return max(math.ceil(load_factor * mean), math.ceil(mean + load_slack))


def scorers(affinity_weight: float, free_slot_weight: float, load_weight: float) -> list[tuple[Scorer, float]]:
    return [(affinity, affinity_weight), (free_slot, free_slot_weight), (least_load, load_weight)]


def rank(views: Sequence[WorkerView], scene: Scene, weighted: Sequence[tuple[Scorer, float]]) -> list[WorkerView]:
    """``views`` best first by the weighted sum of the scorers; equal scores keep their order."""
    scored = [(-sum(weight * score(view, scene) for score, weight in weighted), i) for i, view in enumerate(views)]
    scored.sort()
    return [views[i] for _, i in scored]
