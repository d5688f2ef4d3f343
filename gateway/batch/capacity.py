"""Idle capacity: whether a batch line for a model may be sent now.

A line goes only while (1) the model's admission (routing's ``max_in_flight``, read through
``ADMISSION_OF``) is below ``admission_share`` of its limit with nobody waiting, and (2) one of the
model's available workers holds fewer than ``worker_max_in_flight`` requests. Interactive requests
are never queued behind a line: a line waits in Redis, not in the admission queue, and the worker's
engine sees it at the lowest priority (``engine_priority``) when it runs the priority policy.

Priority only orders the engine's queue: a CPU step that decodes eight batch lines beside an
interactive request is still slower than one that decodes it alone. So while interactive requests run
on the model's workers, or ran there within ``interactive_quiet_s``, the batch shrinks to
``busy_lines_per_worker`` lines per available worker; when the workers go quiet it grows back to the
limits above. What counts as interactive is what this replica sends (its workers' in-flight requests
less its own batch lines on them): another replica's traffic is seen only through admission.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from gateway.pipeline.batch_config import BatchesConfig
from gateway.pipeline.capacity import ADMISSION_OF, AdmissionOf
from gateway.pipeline.config import GatewayConfig, ModelConfig
from gateway.pipeline.services import Services


def model_workers(config: GatewayConfig, model: ModelConfig, services: Services) -> list[str]:
    """The URLs of the model's workers (managed worker names resolved, discovered refs expanded)."""
    managed = {w.name: w.url for w in config.engine.workers}
    return services.workers.expand(managed.get(ref, ref) for ref in model.workers)


class IdleGate:
    """Decides, line by line, whether the fleet has idle capacity for a model's batch line; remembers
    when each model's workers last carried interactive traffic."""

    def __init__(self) -> None:
        self._last_interactive: dict[str, float] = {}

    def has_room(
        self,
        services: Services,
        config: GatewayConfig,
        model: ModelConfig,
        batches: BatchesConfig,
        lines_in_flight: Mapping[str, int],
    ) -> bool:
        """``lines_in_flight``: this replica's batch lines running now, per model name."""
        admission_of: AdmissionOf | None = services.shared.get(ADMISSION_OF)
        admission = admission_of(model.name) if admission_of is not None else None
        if admission is not None and not admission.has_room(batches.admission_share):
            return False
        wanted = set(model_workers(config, model, services))
        now = time.monotonic()
        workers = [w for w in services.workers.all() if w.url in wanted and w.available(now)]
        if not any(w.in_flight < batches.worker_max_in_flight for w in workers):
            return False
        by_name = {m.name: m for m in config.models}
        ours = sum(  # our lines that may be on these workers: every line of a model sharing one of them
            count
            for name, count in lines_in_flight.items()
            if (other := by_name.get(name)) is not None and wanted.intersection(model_workers(config, other, services))
        )
        if sum(w.in_flight for w in workers) > ours:
            self._last_interactive[model.name] = now
        if now - self._last_interactive.get(model.name, -1e18) >= batches.interactive_quiet_s:
            return True
        return lines_in_flight.get(model.name, 0) < batches.busy_lines_per_worker * len(workers)
