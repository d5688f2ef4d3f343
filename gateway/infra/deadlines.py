"""Time bounds on awaits that all last the same time, on one timer: ``asyncio.timeout``'s behaviour at a
fraction of its cost.

``asyncio.timeout`` arms a timer per use and cancels it on the way out. Under uvloop that is a libuv timer
started, stopped and closed each time, about 29,000 instructions per use (``bench/bench_deadlines.py``),
on the request path once per worker answer awaited and once per cache lookup. The bounds there all last
the same time (a config value), so their deadlines come in the order they were entered: ``Deadlines``
keeps the live ones in that order (a dict, insertion-ordered) and one timer for the oldest. A bound that
ends before its deadline only leaves the dict; when the timer fires it expires what is due and is armed
again for the oldest still waiting, so it fires about once per ``seconds`` however many bounds come and go.

What a bound does on expiry is what ``asyncio.timeout`` does, step for step: its task is cancelled and
the ``CancelledError`` that reaches the end of the ``with`` block becomes ``TimeoutError``, unless
another cancellation was asked for meanwhile (``Task.uncancel`` counts them), which then propagates.
``tests/infra/test_deadlines.py`` runs the same cases through both.

A bound is a plain ``with`` block (entering and leaving need no await): ::

    first_byte = Deadlines(30.0)
    with first_byte.bound():
        answer = await worker.post(...)
"""

from __future__ import annotations

import asyncio
from types import TracebackType

_ENTERED, _EXPIRING, _EXITED = 1, 2, 3


class Deadlines:
    """Bounds of ``seconds`` each, sharing a timer in one event loop at a time: the loop of the first
    bound entered. An idle ``Deadlines`` moves to the loop of its next bound; a bound entered in another
    loop while bounds wait in this one arms a timer of its own there (as ``asyncio.timeout`` would)."""

    __slots__ = ("_loop", "_timer", "_waiting", "seconds")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._waiting: dict[Bound, float] = {}  # live bounds -> their deadline, oldest first
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def bound(self) -> Bound:
        """A bound of ``seconds`` from when its ``with`` block is entered (once)."""
        return Bound(self)

    @property
    def waiting(self) -> int:
        """Bounds entered and not yet left or expired."""
        return len(self._waiting)

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        """The timer: expire every bound that is due, then wait for the oldest that is not."""
        if loop is not self._loop:
            return
        self._timer = None
        now = loop.time()
        due: list[Bound] = []
        for bound, when in self._waiting.items():
            if when > now:
                self._timer = loop.call_at(when, self._expire, loop)
                break
            due.append(bound)
        for bound in due:
            del self._waiting[bound]
            bound._on_timeout()


class Bound:
    """One use of a ``Deadlines``: a ``with`` block in a task, raising ``TimeoutError`` when it overruns."""

    __slots__ = ("_alone", "_cancelling", "_deadlines", "_state", "_task")

    def __init__(self, deadlines: Deadlines) -> None:
        self._deadlines = deadlines
        self._state = 0
        self._task: asyncio.Task[object] | None = None
        self._cancelling = 0
        self._alone: asyncio.TimerHandle | None = None  # its own timer, in a loop the Deadlines is not in

    def __enter__(self) -> Bound:
        if self._state:
            raise RuntimeError("a bound is entered once")
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("a bound is used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        # Deadlines' own step, written here: this runs once per bounded await on the request path.
        deadlines = self._deadlines
        loop = task.get_loop()
        when = loop.time() + deadlines.seconds
        if loop is not deadlines._loop:
            if deadlines._waiting:  # busy in another loop
                self._alone = loop.call_at(when, self._on_timeout)
                self._state = _ENTERED
                return self
            deadlines._loop, deadlines._timer = loop, None  # a timer left in the old loop finds itself stale
        deadlines._waiting[self] = when
        if deadlines._timer is None:
            deadlines._timer = loop.call_at(when, deadlines._expire, loop)
        self._state = _ENTERED
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == _ENTERED:
            self._state = _EXITED
            if self._alone is None:
                del self._deadlines._waiting[self]
            else:
                self._alone.cancel()
            return
        self._state = _EXITED  # it was expiring: the cancellation this bound asked for is over
        assert self._task is not None
        if self._task.uncancel() <= self._cancelling and exc_type is asyncio.CancelledError:
            raise TimeoutError from exc

    def _on_timeout(self) -> None:
        assert self._task is not None and self._state == _ENTERED
        self._task.cancel()
        self._state = _EXPIRING
