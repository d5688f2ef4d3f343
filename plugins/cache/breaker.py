"""A circuit breaker for Redis: stop calling it for a while after repeated failures, then probe.

Closed: every call goes through. After ``failures`` consecutive failures it opens: calls are skipped
(the cache steps aside and requests go to the engine) for ``cooldown_s``. Then it is half-open: one
caller at a time may probe; a success closes it, a failure opens it for another cooldown. A probe that
never reports (its request was cancelled) gives up its slot after a cooldown, so the breaker always
recovers by itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._consecutive = 0
        self._open_until = 0.0
        self._probe_until = 0.0

    def configure(self, failures: int, cooldown_s: float) -> None:
        """A reloaded config changes the thresholds, not the current state."""
        self.failures = failures
        self.cooldown_s = cooldown_s

    @property
    def state(self) -> str:
        if self._consecutive < self.failures:
            return "closed"
        return "open" if self._clock() < self._open_until else "half_open"

    def allow(self) -> bool:
        if self._consecutive < self.failures:
            return True
        now = self._clock()
        if now < self._open_until or now < self._probe_until:
            return False
        self._probe_until = now + self.cooldown_s  # this caller is the probe
        return True

    def success(self) -> None:
        self._consecutive = 0
        self._open_until = self._probe_until = 0.0

    def failure(self) -> None:
        self._consecutive += 1
        if self._consecutive >= self.failures:
            self._open_until = self._clock() + self.cooldown_s
            self._probe_until = 0.0
