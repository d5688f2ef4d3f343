"""Placement of adapter requests as a pure function, and each worker's adapter state (LRU, reconcile)."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.upstream.adapters import AdapterSync, WorkerAdapters, listed_adapters
from gateway.upstream.workers import Worker
from plugins.routing.placement import Scene, WorkerView, load_cap, rank, scorers

WEIGHTS = scorers(100.0, 0.5, 1.0)  # the defaults


def view(url: str, load: float, holds: bool = False, free: int = 1) -> WorkerView:
    return WorkerView(worker=Worker(url=url), load=load, holds=holds, free_slots=free)


def best(views: list[WorkerView]) -> str:
    cap = load_cap([v.load for v in views], 1.25, 4)
    return rank(views, Scene(cap), WEIGHTS)[0].worker.url


def test_a_worker_holding_the_adapter_wins_over_a_less_loaded_one() -> None:
    assert best([view("a", 0), view("b", 3, holds=True)]) == "b"


def test_an_overloaded_holder_spills_to_the_least_loaded_worker() -> None:
    # mean (20 + 0 + 1) / 2 = 10.5: the cap is 15, the holder is at 20
    assert best([view("a", 20, holds=True), view("b", 0)]) == "b"


def test_without_a_holder_the_least_loaded_worker_is_chosen_and_a_free_slot_breaks_ties() -> None:
    assert best([view("a", 2), view("b", 1, free=0)]) == "b"  # a load difference beats the free-slot bonus
    assert best([view("a", 1, free=0), view("b", 1, free=2)]) == "b"  # equal loads: no eviction needed
    assert best([view("a", 1), view("b", 1)]) == "a"  # a full tie keeps the (rotated) order


@settings(deadline=None)  # a loaded machine must not fail a pure function on time
@given(st.lists(st.tuples(st.integers(0, 50), st.booleans(), st.integers(0, 4)), min_size=1, max_size=8))
def test_rank_is_a_permutation_and_a_non_overloaded_holder_always_comes_first(
    rows: list[tuple[int, bool, int]],
) -> None:
    views = [view(f"w{i}", load, holds, free) for i, (load, holds, free) in enumerate(rows)]
    cap = load_cap([v.load for v in views], 1.25, 4)
    ranked = rank(views, Scene(cap), WEIGHTS)
    assert sorted(v.worker.url for v in ranked) == sorted(v.worker.url for v in views)
    if any(v.holds and v.load < cap for v in views):
        assert ranked[0].holds and ranked[0].load < cap


def test_lru_victim_skips_pinned_and_busy_adapters() -> None:
    state = WorkerAdapters()
    for at, name in enumerate(["old", "mid", "new"]):
        state.added(name, float(at))
    assert state.lru_victim() == "old"
    state.pinned.add("old")
    assert state.lru_victim() == "mid"
    state.acquire("mid")
    assert state.lru_victim() == "new"
    state.release("mid")
    state.touch("mid", 10.0)
    assert state.lru_victim() == "new"


def test_reconcile_drops_what_the_worker_lost_but_not_a_load_that_raced_the_read() -> None:
    state = WorkerAdapters()
    state.added("kept", 1.0)
    state.added("lost", 1.0)
    state.added("raced", 5.0)  # learnt after the read was sent at 3.0
    added, dropped = state.reconcile(["kept", "foreign"], asked_at=3.0, now=6.0)
    assert (added, dropped) == (["foreign"], ["lost"])
    assert set(state.held) == {"kept", "raced", "foreign"}
    assert state.lru_victim() == "foreign"  # learnt from the worker: least recently used here


def test_listed_adapters_reads_cards_with_a_parent_only() -> None:
    body = b'{"data":[{"id":"base","parent":null},{"id":"sql","parent":"base","root":"/a/sql"},{"id":3}]}'
    assert listed_adapters(body) == {"sql": "/a/sql"}
    assert listed_adapters(b"not json") is None
    assert listed_adapters(b'{"detail":"x"}') is None


def test_the_sync_notices_a_restarted_worker_and_keeps_state_when_the_worker_cannot_be_read() -> None:
    worker = Worker(url="http://w")
    worker.adapters.added("sql", 0.0)
    answers: list[tuple[int, bytes] | Exception] = [OSError("refused"), (200, b'{"data":[{"id":"base"}]}')]

    async def get(url: str, timeout_s: float) -> tuple[int, bytes]:
        assert url == "http://w/v1/models"
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    clock = iter(range(10, 100))
    sync = AdapterSync(get, lambda: [worker], interval_s=1, timeout_s=1, clock=lambda: float(next(clock)))
    assert asyncio.run(sync.sync_one(worker)) is False
    assert "sql" in worker.adapters.held  # unknown is not empty
    assert asyncio.run(sync.sync_one(worker)) is True
    assert worker.adapters.held == {}


def test_an_adapter_being_unloaded_is_not_listed_back_by_a_read_of_the_worker() -> None:
    """The worker still lists it until the unload returns: a read meanwhile must not make it held again
    (a request would be sent to it, and the eviction loop would pick it a second time)."""
    state = WorkerAdapters()
    state.unloading.add("support")
    added, dropped = state.reconcile(["sql", "support"], asked_at=1.0, now=2.0)
    assert (added, dropped) == (["sql"], [])
    assert not state.holds("support")
