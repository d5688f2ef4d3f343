"""End to end: the official openai SDK -> gateway -> a real vLLM worker on the CPU with SmolLM2.

The worker is a managed one: the gateway's lifespan prepared the model and started it (`real_engine`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest
import yaml

from tests.support.fakes import free_port
from tests.support.gateways import REPO, RealEngine, engine_config

pytestmark = pytest.mark.engine

HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]


def sdk(engine: RealEngine) -> openai.OpenAI:
    return openai.OpenAI(base_url=engine.gateway_url + "/v1", api_key="unused", max_retries=0, timeout=300)


def test_chat(real_engine: RealEngine) -> None:
    reply = sdk(real_engine).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=16)
    assert reply.choices[0].message.content
    assert reply.model == "smollm2"
    assert reply.usage is not None and 0 < reply.usage.completion_tokens <= 16


def test_alias_reaches_the_same_model(real_engine: RealEngine) -> None:
    reply = sdk(real_engine).chat.completions.create(model="default", messages=HELLO, max_tokens=4)
    assert reply.choices[0].message.content is not None


def test_stream_with_usage(real_engine: RealEngine) -> None:
    stream = sdk(real_engine).chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=16, stream=True, stream_options={"include_usage": True}
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage:
            usage = chunk.usage
    assert text
    assert finish in {"stop", "length"}
    assert usage is not None and usage.completion_tokens > 0


def test_legacy_completions(real_engine: RealEngine) -> None:
    reply = sdk(real_engine).completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8)
    assert reply.choices[0].text


def test_n_2(real_engine: RealEngine) -> None:
    reply = sdk(real_engine).chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=8, n=2, temperature=0.8, seed=1
    )
    assert sorted(c.index for c in reply.choices) == [0, 1]


def test_logprobs(real_engine: RealEngine) -> None:
    reply = sdk(real_engine).chat.completions.create(
        model="smollm2", messages=HELLO, max_tokens=4, logprobs=True, top_logprobs=2
    )
    logprobs = reply.choices[0].logprobs
    assert logprobs is not None and logprobs.content
    assert all(item.logprob <= 0 for item in logprobs.content)
    assert len(logprobs.content[0].top_logprobs) == 2


def test_stop_sequence(real_engine: RealEngine) -> None:
    reply = sdk(real_engine).completions.create(
        model="smollm2", prompt="1, 2, 3, 4, 5,", max_tokens=32, temperature=0, stop=["8"]
    )
    assert "8" not in reply.choices[0].text
    assert reply.choices[0].finish_reason == "stop"


def test_same_seed_at_temperature_zero_gives_the_same_text(real_engine: RealEngine) -> None:
    c = sdk(real_engine)
    first = c.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=24, temperature=0, seed=7)
    second = c.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=24, temperature=0, seed=7)
    assert first.choices[0].message.content == second.choices[0].message.content


def test_response_format_json_schema_returns_valid_json(real_engine: RealEngine) -> None:
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    reply = sdk(real_engine).chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Give a person's name and age as JSON."}],
        max_tokens=64,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": schema}},
    )
    content = reply.choices[0].message.content
    assert content is not None
    jsonschema.validate(json.loads(content), schema)


def test_worker_error_is_translated(real_engine: RealEngine) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        sdk(real_engine).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=100_000)
    body = info.value.body
    assert isinstance(body, dict) and body["type"] == "invalid_request_error"
    assert body["code"] is None or isinstance(body["code"], str)


def test_killed_worker_is_restarted_and_serves_again(real_engine: RealEngine) -> None:
    engine = real_engine.app.state.engine
    (status,) = engine.status()
    pid = status["pid"]
    restarts = status["restarts"]
    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        (now,) = engine.status()
        if now["restarts"] > restarts and now["state"] == "ready":
            break
        time.sleep(1)
    else:
        pytest.fail(f"worker was not restarted: {engine.status()}")
    # The gateway's health checks see it again; then it answers.
    deadline = time.monotonic() + 30
    while httpx.get(real_engine.gateway_url + "/ready").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.5)
    reply = sdk(real_engine).chat.completions.create(model="smollm2", messages=HELLO, max_tokens=4)
    assert reply.choices[0].message.content is not None


def test_gateway_shutdown_leaves_no_worker_process(tmp_path: Path) -> None:
    """`gateway serve` as a real process: SIGTERM stops its managed worker too."""
    worker_port, gateway_port = free_port(), free_port()
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(engine_config(worker_port)))
    env = {
        **os.environ,
        "GATEWAY_PORT": str(gateway_port),
        "GATEWAY_MODEL_DIR": str(REPO / "models"),
        "GATEWAY_CONFIG_PATH": str(config_path),
        "GATEWAY_MANAGED_WORKERS": "true",  # whatever the test process's environment says
    }
    gateway = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve"],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{gateway_port}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert gateway.poll() is None, "gateway exited during start-up"
            time.sleep(1)
        else:
            pytest.fail("gateway with a managed worker did not become ready")
        worker_pids = _worker_pids(worker_port)
        assert worker_pids, "no worker process found"
        gateway.send_signal(signal.SIGTERM)
        gateway.wait(timeout=120)
    finally:
        if gateway.poll() is None:
            gateway.kill()
    deadline = time.monotonic() + 30
    while _worker_pids(worker_port) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _worker_pids(worker_port) == []


def _worker_pids(port: int) -> list[int]:
    """vLLM server processes listening on ``port``, from /proc (ps truncates long command lines)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(b"vllm.entrypoints" in a for a in args) and str(port).encode() in args:
            pids.append(int(entry.name))
    return pids
