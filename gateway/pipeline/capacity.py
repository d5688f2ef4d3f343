"""What the core may know of a model's admission without importing the plugin that runs it.

The routing plugin admits requests per model (``max_in_flight`` slots and a queue). The batch runner
sends a line only while a model has room to spare and nobody waits, so it reads that state through
``services.shared[ADMISSION_OF]``: an ``(model name) -> ModelAdmission | None`` the routing plugin
registers (None: the model has no admission limit, or no plugin admits requests).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: ``services.shared`` key of the ``AdmissionOf`` callable.
ADMISSION_OF = "admission_of"


@dataclass(frozen=True, slots=True)
class ModelAdmission:
    """One model's admission now: requests holding a slot, the limit (None: unlimited), and waiters."""

    in_flight: int
    max_in_flight: int | None
    queued: int

    def has_room(self, share: float) -> bool:
        """Nobody waits and the admitted requests are below ``share`` of the limit."""
        if self.queued:
            return False
        return self.max_in_flight is None or self.in_flight < share * self.max_in_flight


AdmissionOf = Callable[[str], ModelAdmission | None]
