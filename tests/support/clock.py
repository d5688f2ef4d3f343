"""A clock that stands still until a test moves it (``clock.now += 5``): for code that takes a ``clock``."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
