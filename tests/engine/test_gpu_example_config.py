"""The GPU example config (examples/config.gpu.yaml): it cannot run here, so what it would run is checked.

It must pass the gateway's own config check (the file, every plugin section) and turn into the vLLM
command line of a GPU worker: tensor parallelism, GPU memory share and the EAGLE speculative config as
flags, and none of the CPU-only environment (KV cache space, thread binding, preloaded allocator).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from gateway.cli import main as cli
from gateway.engine.launch import build_launch
from gateway.engine.spec import ManagedWorkerSpec
from gateway.pipeline.config import ConfigError, load_config, parse_config
from gateway.pipeline.registry import PluginRegistry
from gateway.pipeline.validate import resolve_plugins

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "config.gpu.yaml"
MODEL_DIR = Path("/models/smollm2")


def gpu_worker() -> ManagedWorkerSpec:
    config = load_config(EXAMPLE)
    (worker,) = config.engine.workers
    return worker


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} should appear once in {argv}"
    return argv[argv.index(flag) + 1]


def test_example_passes_the_config_check() -> None:
    config = parse_config(EXAMPLE.read_bytes(), source=str(EXAMPLE))
    resolved = resolve_plugins(config, PluginRegistry())
    assert [p.entry.name for p in resolved] == ["safety", "cache", "guided_json", "routing"]
    assert config.models[0].workers == ["smollm2-gpu"]


def test_check_config_command_accepts_it() -> None:
    result = CliRunner().invoke(cli, ["check-config", str(EXAMPLE)])
    assert result.exit_code == 0, result.output
    assert "ok" in result.output


def test_the_worker_is_a_gpu_worker_with_eagle() -> None:
    worker = gpu_worker()
    assert worker.device == "gpu"
    assert worker.dtype in {"float16", "bfloat16"}
    assert worker.tensor_parallel_size > 1
    assert worker.gpu_memory_utilization is not None
    assert worker.speculative is not None and worker.speculative.method == "eagle"
    assert worker.speculative.model


def test_gpu_argv() -> None:
    worker = gpu_worker()
    argv = build_launch(worker, MODEL_DIR).argv
    assert flag_value(argv, "--model") == str(MODEL_DIR)
    assert flag_value(argv, "--served-model-name") == "smollm2"
    assert flag_value(argv, "--dtype") == worker.dtype
    assert flag_value(argv, "--tensor-parallel-size") == str(worker.tensor_parallel_size)
    assert float(flag_value(argv, "--gpu-memory-utilization")) == worker.gpu_memory_utilization
    assert json.loads(flag_value(argv, "--speculative-config")) == {
        "method": "eagle",
        "model": worker.speculative.model if worker.speculative else None,
        "num_speculative_tokens": 3,
    }
    assert json.loads(flag_value(argv, "--structured-outputs-config")) == {"backend": "outlines"}
    assert "--enforce-eager" not in argv  # CUDA graphs on a GPU
    assert "--enable-chunked-prefill" in argv and "--enable-prefix-caching" in argv


def test_gpu_env_has_no_cpu_settings() -> None:
    # Even when the gateway found tcmalloc and its own environment preloads something, a GPU worker gets
    # neither: the CPU performance environment is for CPU workers only.
    command = build_launch(
        gpu_worker(), MODEL_DIR, preload=["/usr/lib/libtcmalloc_minimal.so.4"], inherited={"LD_PRELOAD": "/x.so"}
    )
    assert not [k for k in command.env if k.startswith("VLLM_CPU_")]
    assert "LD_PRELOAD" not in command.env
    assert command.env["HF_HUB_OFFLINE"] == "1"  # a prepared local directory: no hub at start-up


def test_the_same_worker_on_the_cpu_is_refused() -> None:
    # EAGLE needs a GPU: moving the example's worker to the CPU is a config error that names the reason.
    text = EXAMPLE.read_text().replace("device: gpu", "device: cpu")
    with pytest.raises(ConfigError) as caught:
        parse_config(text, source="cpu variant")
    assert any("needs a GPU worker" in problem for problem in caught.value.problems)
