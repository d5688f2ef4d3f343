"""The last config reloads of this process, accepted or refused, for the operator console and the admin API.

Bounded (``ReloadHistory(limit)``, 50 by default): the oldest entry goes when a new one comes. An entry says
when (UTC), who (the admin caller's address, ``file watcher``, ``SIGHUP``, ``config channel``), from which
source, whether the config went live (``accepted``: a new version; ``unchanged``: the same content again;
``refused``), the version it runs after, and for a refusal the reason the caller got.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, Literal

Outcome = Literal["accepted", "unchanged", "refused"]


@dataclass(frozen=True, slots=True)
class ReloadEvent:
    at: float
    source: str
    who: str
    outcome: Outcome
    version: str | None
    reason: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "at_iso": datetime.fromtimestamp(self.at, UTC).isoformat()}


class ReloadHistory:
    def __init__(self, limit: int = 50) -> None:
        self._events: deque[ReloadEvent] = deque(maxlen=limit)

    def record(
        self, source: str, who: str | None, outcome: Outcome, version: str | None, reason: str | None = None
    ) -> ReloadEvent:
        event = ReloadEvent(time.time(), source, who or source, outcome, version, reason)
        self._events.append(event)
        return event

    def latest(self) -> list[ReloadEvent]:
        """Newest first."""
        return list(reversed(self._events))
