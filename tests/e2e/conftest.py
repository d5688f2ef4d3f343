"""Fixtures shared by the real-vLLM tests: two managed vLLM CPU workers for the whole package (started
once, on first use), for the tests that need more than one worker (prefix affinity, failover).

Set ``ROUTING_TEST_WORKERS=http://127.0.0.1:8301,http://127.0.0.1:8302`` to use workers started by hand.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import httpx
import pytest

from gateway.ops.settings import Settings
from gateway.pipeline.config import GatewayConfig
from gateway.pipeline.registry import PluginRegistry
from gateway.server.app import create_app
from tests.support.fakes import ServerThread, free_port
from tests.support.gateways import REPO, engine_config


class TwoWorkers(list[str]):
    """The two workers' URLs; ``managed`` when this process's engine supervisor restarts them."""

    managed: bool = False

    def wait_healthy(self, timeout_s: float) -> None:
        """Wait (bounded) until every worker answers /health: after a test killed one, the supervisor
        restarts it, and the tests after it get both workers back."""
        deadline = time.monotonic() + timeout_s
        for url in self:
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker {url} not healthy within {timeout_s:g} s")
                time.sleep(1)


@pytest.fixture(scope="package")
def two_workers() -> Iterator[TwoWorkers]:
    given = os.environ.get("ROUTING_TEST_WORKERS")
    if given:
        yield TwoWorkers(u.rstrip("/") for u in given.split(","))
        return
    if not (REPO / "models" / "smollm2").is_dir():
        pytest.skip("the default model is not prepared (models/smollm2)")
    ports = [free_port(), free_port()]
    config = engine_config(ports[0])
    spec = config["engine"]["workers"][0]
    # One core each: vLLM's default binding ("auto") would put both workers' OpenMP threads on core 0.
    # float32, not bfloat16: the failover test compares answers at temperature 0 across workers and batch
    # sizes, and bf16's 8-bit mantissa makes near-tied tokens flip with the batch's shape (two answers to
    # the same prompt then part from the first flip on); in float32 such ties are rare.
    cores = os.cpu_count() or 1
    config["engine"]["workers"] = [
        {**spec, "name": f"cpu-{i}", "port": p, "omp_threads_bind": str(i % cores), "dtype": "float32"}
        for i, p in enumerate(ports)
    ]
    config["models"][0]["workers"] = ["cpu-0", "cpu-1"]
    app = create_app(
        Settings(model_dir=REPO / "models"),
        registry=PluginRegistry(),
        config=GatewayConfig.model_validate(config),
    )
    with ServerThread(app, start_timeout_s=900):
        workers = TwoWorkers(f"http://127.0.0.1:{p}" for p in ports)
        workers.managed = True
        yield workers
