"""A real vLLM CPU worker with the default model, started and supervised by EngineManager."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path

import pytest

from gateway.engine.model_prep import is_complete
from gateway.engine.procgroup import group_members
from gateway.engine.spec import ManagedWorkerSpec
from gateway.engine.supervisor import EngineManager, RestartPolicy
from tests.support.gateways import REPO

pytestmark = pytest.mark.engine

openai = pytest.importorskip("openai")
pytest.importorskip("vllm")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """GATEWAY_TEST_MODELS_DIR, else the repo's models/ when `make model` prepared smollm2 there (as `make
    test` does), else a directory this run prepares it in. The conversion itself is tested once, in
    tests/engine/test_model_prep.py: doing it again here cost about 20 s of the suite."""
    shared = os.environ.get("GATEWAY_TEST_MODELS_DIR")
    if shared:
        return Path(shared)
    return REPO / "models" if is_complete(REPO / "models" / "smollm2") else tmp_path_factory.mktemp("models")


async def chat(base_url: str) -> str:
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    try:
        reply = await client.chat.completions.create(
            model="smollm2", messages=[{"role": "user", "content": "Say hello."}], max_tokens=16, temperature=0
        )
    finally:
        await client.close()
    assert reply.choices[0].message.content
    return str(reply.choices[0].message.content)


async def test_real_worker_serves_restarts_and_stops(tmp_path_factory: pytest.TempPathFactory) -> None:
    spec = ManagedWorkerSpec(
        name="cpu0", model="smollm2", port=free_port(), enforce_eager=True, max_model_len=2048, kv_cache_space_gb=1
    )
    events: list[tuple[str, str]] = []
    engine = EngineManager(
        [spec],
        models_dir(tmp_path_factory),
        ready_timeout_s=300,
        restart=RestartPolicy(initial_delay_s=0.5),
        on_event=lambda name, event: events.append((name, event)),
    )
    await engine.start()
    try:
        [status] = engine.status()
        assert status["state"] == "ready"
        first_pid = int(str(status["pid"]))
        assert len(group_members(first_pid)) >= 2  # API server, EngineCore, CPU worker, ...
        assert await chat(spec.url)

        os.kill(first_pid, signal.SIGKILL)
        deadline = time.monotonic() + 300
        while not (engine.status()[0]["state"] == "ready" and engine.status()[0]["pid"] not in (None, first_pid)):
            assert time.monotonic() < deadline, engine.workers["cpu0"].last_lines()
            await asyncio.sleep(0.5)
        assert engine.status()[0]["restarts"] == 1
        assert group_members(first_pid) == []  # the killed server's EngineCore and worker are gone too
        assert await chat(spec.url)
        second_pid = int(str(engine.status()[0]["pid"]))
    finally:
        await engine.stop()
    assert group_members(second_pid) == []
    assert [e for _, e in events] == ["ready", "exited", "restarting", "ready", "restarted", "stopped"]
