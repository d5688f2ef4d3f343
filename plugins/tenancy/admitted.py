"""What tenancy keeps per admitted request until it is settled: the counters it reserved on, how much,
and what has been charged so far."""

from __future__ import annotations

from dataclasses import dataclass

from plugins.tenancy.limits import Plan


@dataclass(slots=True)
class Admitted:
    """What the settlement needs: the counters the request reserved on and how much."""

    plan: Plan
    reserved: int  # tokens reserved on admission
    prompt_estimate: int
    via_redis: bool
    answer: tuple[int, int] | None = None  # (prompt, completion) of the answer on_response saw
    factor: float = 1.0  # the share of its tokens the request is charged (a batch line's price)
    # Tokens the counters hold for this request now; None until the first settlement (they hold the
    # reservation). Not a count (-1 was), so no settlement to a negative cost can pass for "unsettled".
    held: int | None = None
    prompt_charged: int = 0
    completion_charged: int = 0
    finished: bool = False

    def settle_to(self, prompt: int, completion: int) -> tuple[int, int, int] | None:
        """Record that the request costs (prompt, completion) from now on; the (token delta, prompt
        delta, completion delta) to apply to the counters, or None when nothing changes."""
        held = self.reserved if self.held is None else self.held
        change = (prompt + completion - held, prompt - self.prompt_charged, completion - self.completion_charged)
        self.held, self.prompt_charged, self.completion_charged = prompt + completion, prompt, completion
        return change if any(change) else None
