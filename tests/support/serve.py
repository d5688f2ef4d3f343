"""A real ``gateway serve`` process, uvicorn configured exactly as shipped, for tests of what only the
command line sets up (uvicorn's options, the admin port, keep-alive timers)."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.support.fakes import free_port
from tests.support.faults import REPO, answers, gateway_env, wait_for
from tests.support.gateways import base_config


@contextlib.contextmanager
def gateway_process(worker_url: str, tmp_path: Path, **env: str) -> Iterator[int]:
    """``gateway serve`` in front of ``worker_url`` (``base_config``), with ``env`` added to its settings;
    yields its port once /health answers, and stops it after."""
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(base_config([worker_url])))
    port = free_port()
    environment = gateway_env(
        GATEWAY_PORT=str(port),
        GATEWAY_CONFIG_PATH=str(path),
        GATEWAY_MANAGED_WORKERS="false",
        GATEWAY_CONFIG_WATCH_S="0",
        **env,
    )
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "serve"], env=environment, cwd=REPO, stderr=out)
    try:
        wait_for(lambda: proc.poll() is not None or answers(f"http://127.0.0.1:{port}/health"), 60, "the gateway")
        assert proc.poll() is None, log.read_text()[-3000:]
        yield port
    finally:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=40)
        proc.kill()  # a no-op once it has exited
        proc.wait()
