"""Idle capacity: whether a batch line for a model may be sent now.

A line goes only while (1) the model's admission (routing's ``max_in_flight``, read through
``ADMISSION_OF``) is below ``admission_share`` of its limit with nobody waiting, and (2) one of the
model's available workers holds fewer than ``worker_max_in_flight`` requests. Interactive requests
are never queued behind a line: a line waits in Redis, not in the admission queue, and the worker's
engine sees it at the lowest priority (``engine_priority``) when it runs the priority policy.
"""

from __future__ import annotations

import time

from gateway.pipeline.batch_config import BatchesConfig
from gateway.pipeline.capacity import ADMISSION_OF, AdmissionOf
from gateway.pipeline.config import GatewayConfig, ModelConfig
from gateway.pipeline.services import Services


def model_workers(config: GatewayConfig, model: ModelConfig, services: Services) -> list[str]:
    """The URLs of the model's workers (managed worker names resolved, discovered refs expanded)."""
    managed = {w.name: w.url for w in config.engine.workers}
    return services.workers.expand(managed.get(ref, ref) for ref in model.workers)


def has_room(services: Services, config: GatewayConfig, model: ModelConfig, batches: BatchesConfig) -> bool:
    admission_of: AdmissionOf | None = services.shared.get(ADMISSION_OF)
    admission = admission_of(model.name) if admission_of is not None else None
    if admission is not None and not admission.has_room(batches.admission_share):
        return False
    wanted = set(model_workers(config, model, services))
    now = time.monotonic()
    return any(
        w.url in wanted and w.available(now) and w.in_flight < batches.worker_max_in_flight
        for w in services.workers.all()
    )
