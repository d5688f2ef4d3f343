"""The bytes every stream being recorded at once may keep together: ``RecordingPool``.

A stream kept for the cache is held as its events until it ends (the core's recording of a pass-through
stream, up to twice the cache's ``max_value_bytes``; the cache's own of a parsed one, up to
``max_value_bytes``), and SSE takes about fifty times the room of the text it carries. Each recording is
bounded, but not their sum: a client with as many long streams as routing admits (256 a model in
``deploy/k8s``) could make the process hold half a gigabyte, past the pod's memory limit, and every
tenant's streams would end with it. The pool bounds the sum (``GATEWAY_MAX_RECORDING_BYTES``).

A recording takes its room in grants of ``GRANT`` bytes as it grows (most streams need one), and gives it
back when it ends however it ends (``release``, or when the reservation is collected: a stream whose
client left). A recording refused room stops keeping events, as one past its own bound does: the
answer is still stored, added up as the events come, so the pool costs the cache no answers, only the
events' chunking of the ones past it.
"""

from __future__ import annotations

#: What a recording takes from the pool at a time (a short answer's whole stream).
GRANT = 64 * 1024


class RecordingPool:
    """Bytes left for recordings in this process. Used on the event loop only (no lock)."""

    __slots__ = ("left", "total")

    def __init__(self, total: int) -> None:
        self.total = total
        self.left = total

    def reserve(self, limit: int) -> Reservation:
        """An empty reservation for a recording of at most ``limit`` bytes."""
        return Reservation(self, limit)


class Reservation:
    """The room one recording holds in the pool (``held``), taken as it grows up to ``limit``."""

    __slots__ = ("_pool", "held", "limit")

    def __init__(self, pool: RecordingPool, limit: int) -> None:
        self._pool = pool
        self.limit = limit
        self.held = 0

    def fits(self, size: int) -> bool:
        """Whether the recording may hold ``size`` bytes in all: more room is taken from the pool when
        ``size`` is past what is held (a grant, or what is needed if more), within ``limit``."""
        if size <= self.held:
            return True
        pool = self._pool
        need = size - self.held
        if size > self.limit or need > pool.left:
            return False
        take = min(max(need, GRANT), self.limit - self.held, pool.left)
        pool.left -= take
        self.held += take
        return True

    def release(self) -> None:
        """Give the room back (the recording ended, or stopped keeping events); idempotent."""
        if self.held:
            self._pool.left += self.held
            self.held = 0

    def __del__(self) -> None:
        # A stream abandoned mid-way (its client left, a task cancelled) never reaches its release.
        self.release()
