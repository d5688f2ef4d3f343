"""``gateway.infra.deadlines``: a bound from ``Deadlines`` behaves as ``asyncio.timeout`` does (the same cases
run through both, on asyncio's loop and on uvloop), and many bounds share one timer."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import pytest
import uvloop

from gateway.infra.deadlines import Deadlines

Bounded = Callable[[float], AbstractAsyncContextManager[Any]]
S = 0.05  # the bound of most cases: long enough for a loop turn, short enough to wait for


def _run(loop: str, main: Awaitable[Any]) -> Any:
    if loop == "uvloop":
        return uvloop.run(main)  # type: ignore[arg-type]
    return asyncio.run(main)  # type: ignore[arg-type]


async def _outcome(task: Awaitable[Any]) -> str:
    """How ``task`` ended: "cancelled", "timeout" or "ended"."""
    try:
        await task
    except asyncio.CancelledError:
        return "cancelled"
    except TimeoutError:
        return "timeout"
    return "ended"


async def _bounded_sleep(deadlines: Deadlines, takes: float) -> str:
    """Sleep ``takes`` seconds within a bound: "timeout" or "done"."""
    try:
        with deadlines.bound():
            await asyncio.sleep(takes)
    except TimeoutError:
        return "timeout"
    return "done"


def _deadlines_bound() -> Bounded:
    """Bounds from one Deadlines per duration, shaped as ``asyncio.timeout`` for the shared cases."""
    by_seconds: dict[float, Deadlines] = {}

    @asynccontextmanager
    async def bound(seconds: float) -> AsyncIterator[None]:
        deadlines = by_seconds.setdefault(seconds, Deadlines(seconds))
        with deadlines.bound():
            yield

    return bound


IMPLEMENTATIONS = {"asyncio.timeout": lambda: asyncio.timeout, "Deadlines": _deadlines_bound}


@pytest.fixture(params=["asyncio", "uvloop"])
def loop(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=list(IMPLEMENTATIONS))
def bounded(request: pytest.FixtureRequest) -> Bounded:
    return IMPLEMENTATIONS[request.param]()


# -- the same behaviour as asyncio.timeout ---------------------------------------------------------


def test_an_await_that_ends_in_time_returns_its_value(bounded: Bounded, loop: str) -> None:
    async def main() -> str:
        async with bounded(S):
            await asyncio.sleep(0)
            return "answer"

    assert _run(loop, main()) == "answer"


def test_an_await_that_overruns_is_cancelled_and_raises_timeout_error(bounded: Bounded, loop: str) -> None:
    seen: list[str] = []

    async def main() -> float:
        started = time.monotonic()
        try:
            async with bounded(S):
                try:
                    await asyncio.sleep(10)
                except asyncio.CancelledError:
                    seen.append("cancelled inside")
                    raise
        except TimeoutError:
            seen.append("timeout outside")
        assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return time.monotonic() - started

    elapsed = _run(loop, main())
    assert seen == ["cancelled inside", "timeout outside"]
    assert S * 0.9 <= elapsed < 5


def test_a_cancellation_from_outside_stays_a_cancellation(bounded: Bounded, loop: str) -> None:
    async def inner() -> None:
        async with bounded(10):
            await asyncio.sleep(10)

    async def main() -> str:
        task = asyncio.ensure_future(inner())
        await asyncio.sleep(0.01)
        task.cancel()
        return await _outcome(task)

    assert _run(loop, main()) == "cancelled"


def test_an_outside_cancellation_that_meets_the_deadline_wins(bounded: Bounded, loop: str) -> None:
    """The deadline passes and someone else cancels the task before it runs again: the task was asked to
    stop by more than the bound, so ``CancelledError`` goes on (``Task.uncancel`` counts the requests)."""

    async def inner() -> None:
        async with bounded(S):
            time.sleep(2 * S)  # noqa: ASYNC251 -- the loop is held past the deadline, on purpose
            task = asyncio.current_task()
            assert task is not None
            asyncio.get_running_loop().call_soon(task.cancel)
            await asyncio.sleep(10)

    async def main() -> str:
        return await _outcome(asyncio.ensure_future(inner()))

    assert _run(loop, main()) == "cancelled"


def test_nested_bounds_the_shorter_one_fires(bounded: Bounded, loop: str) -> None:
    async def inner_expires() -> str:
        async with bounded(10):
            try:
                async with bounded(S):
                    await asyncio.sleep(10)
            except TimeoutError:
                return "inner timed out, outer went on"
        return "no timeout"

    async def outer_expires() -> str:
        try:
            async with bounded(S), bounded(10):  # the outer one first
                await asyncio.sleep(10)
        except TimeoutError:
            return "outer timed out"
        return "no timeout"

    assert _run(loop, inner_expires()) == "inner timed out, outer went on"
    assert _run(loop, outer_expires()) == "outer timed out"


def test_a_bound_left_before_its_deadline_never_fires_later(bounded: Bounded, loop: str) -> None:
    async def main() -> str:
        async with bounded(S):
            await asyncio.sleep(0)
        await asyncio.sleep(3 * S)  # past where the deadline was
        return "not cancelled"

    assert _run(loop, main()) == "not cancelled"


def test_an_error_inside_a_bound_goes_through_it(bounded: Bounded, loop: str) -> None:
    async def main() -> None:
        async with bounded(S):
            await asyncio.sleep(0)
            raise KeyError("inside")

    with pytest.raises(KeyError, match="inside"):
        _run(loop, main())


# -- many bounds on one timer ------------------------------------------------------------------------


def test_many_bounds_each_keeps_its_own_deadline(loop: str) -> None:
    """Overlapping bounds, some ending well in time and some well past: each of the late ones raises
    TimeoutError, none of the others does, and nothing is left waiting."""
    deadlines = Deadlines(0.1)
    rng = random.Random(29)
    plan = [rng.choice([0.0, 0.01, 0.03, 0.25, 0.4]) for _ in range(200)]

    async def one(takes: float) -> str:
        await asyncio.sleep(rng.random() * 0.1)  # enter at different times
        return await _bounded_sleep(deadlines, takes)

    async def main() -> list[str]:
        outcomes = await asyncio.gather(*(one(takes) for takes in plan))
        assert deadlines.waiting == 0
        return outcomes

    outcomes = _run(loop, main())
    assert outcomes == ["timeout" if takes > 0.1 else "done" for takes in plan]


def test_bounds_that_come_and_go_share_one_timer(loop: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A thousand bounds, each left soon after it was entered: the timer fired about once per ``seconds``
    of the run, not once per bound (asyncio.timeout arms and cancels a timer per use)."""
    fired: list[float] = []
    original = Deadlines._expire

    def counted(self: Deadlines, loop_: asyncio.AbstractEventLoop) -> None:
        fired.append(time.monotonic())
        original(self, loop_)

    monkeypatch.setattr(Deadlines, "_expire", counted)
    deadlines = Deadlines(0.1)

    async def main() -> float:
        started = time.monotonic()
        for _ in range(1000):
            with deadlines.bound():
                await asyncio.sleep(0.0003)
        await asyncio.sleep(0.25)  # the last timer fires and finds nothing to do
        return time.monotonic() - started

    elapsed = _run(loop, main())
    assert 1 <= len(fired) <= elapsed / 0.1 + 2, (elapsed, fired)


def test_misuse_is_refused(loop: str) -> None:
    deadlines = Deadlines(S)
    with pytest.raises(RuntimeError, match="no running event loop"), deadlines.bound():  # as asyncio.timeout
        pass

    async def twice() -> None:
        bound = deadlines.bound()
        with bound:
            pass
        with bound:
            pass

    with pytest.raises(RuntimeError, match="entered once"):
        _run(loop, twice())


def test_a_deadlines_moves_to_the_next_loop_or_lends_a_timer_there(loop: str) -> None:
    """An idle Deadlines follows its next bound to another loop; while bounds wait in one loop, a bound
    entered in another (a thread's) gets a timer of its own there, and both still fire."""
    deadlines = Deadlines(S)

    def bounded_sleep(takes: float) -> Awaitable[str]:
        return _bounded_sleep(deadlines, takes)

    assert _run(loop, bounded_sleep(0)) == "done"
    assert _run(loop, bounded_sleep(1)) == "timeout"  # a new loop: the bound still fires there

    async def main() -> list[str]:
        here = asyncio.ensure_future(bounded_sleep(1))
        await asyncio.sleep(0)  # it waits here, in this loop
        assert deadlines.waiting == 1
        there = await asyncio.to_thread(lambda: [_run(loop, bounded_sleep(0)), _run(loop, bounded_sleep(1))])
        return [await here, *there]

    assert _run(loop, main()) == ["timeout", "done", "timeout"]
