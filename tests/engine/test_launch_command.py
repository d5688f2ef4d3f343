"""The launch command of a managed worker: argv and env built from its spec, no process started."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from gateway.engine.launch import (
    TEMPLATES_DIR,
    VLLM_SERVER_MODULE,
    build_launch,
    find_preload_libs,
    speculative_config,
)
from gateway.engine.spec import ManagedWorkerSpec, SpeculativeSpec

MODEL = Path("/models/smollm2")


def spec(**fields: object) -> ManagedWorkerSpec:
    return ManagedWorkerSpec.model_validate({"name": "w0", "model": "smollm2", "port": 8101, **fields})


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_default_cpu_worker_argv() -> None:
    argv = build_launch(spec(), MODEL).argv
    assert argv[:3] == [sys.executable, "-m", VLLM_SERVER_MODULE]
    assert flag_value(argv, "--model") == str(MODEL)
    assert flag_value(argv, "--served-model-name") == "smollm2"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8101"
    assert flag_value(argv, "--dtype") == "auto"
    assert "--enable-prefix-caching" in argv
    assert json.loads(flag_value(argv, "--structured-outputs-config")) == {"backend": "outlines"}
    for absent in ("--enforce-eager", "--speculative-config", "--tensor-parallel-size", "--gpu-memory-utilization",
                   "--max-model-len", "--enable-chunked-prefill", "--no-enable-chunked-prefill"):  # fmt: skip
        assert absent not in argv


def test_engine_settings_become_flags() -> None:
    argv = build_launch(
        spec(
            served_model_name="tiny", dtype="bfloat16", max_model_len=4096, max_num_seqs=64,
            max_num_batched_tokens=2048, enable_prefix_caching=False, enable_chunked_prefill=True,
            enforce_eager=True, python="/venv/bin/python", extra_args=["--seed", "7"],
        ),
        MODEL,
    ).argv  # fmt: skip
    assert argv[0] == "/venv/bin/python"
    assert flag_value(argv, "--served-model-name") == "tiny"
    assert flag_value(argv, "--dtype") == "bfloat16"
    assert flag_value(argv, "--max-model-len") == "4096"
    assert flag_value(argv, "--max-num-seqs") == "64"
    assert flag_value(argv, "--max-num-batched-tokens") == "2048"
    assert "--no-enable-prefix-caching" in argv and "--enable-prefix-caching" not in argv
    assert "--enable-chunked-prefill" in argv
    assert "--enforce-eager" in argv
    assert argv[-2:] == ["--seed", "7"]
    assert "--no-enable-chunked-prefill" in build_launch(spec(enable_chunked_prefill=False), MODEL).argv


def test_ngram_speculation_json() -> None:
    argv = build_launch(spec(speculative={"method": "ngram", "num_speculative_tokens": 5}), MODEL).argv
    assert json.loads(flag_value(argv, "--speculative-config")) == {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
    }  # fmt: skip


def test_gpu_worker_with_eagle_and_tensor_parallel() -> None:
    gpu = spec(
        device="gpu", model="meta-llama/Llama-3.1-8B-Instruct", tensor_parallel_size=2, gpu_memory_utilization=0.9,
        speculative={"method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3},
        kv_cache_space_gb=4,
    )  # fmt: skip
    command = build_launch(gpu, "meta-llama/Llama-3.1-8B-Instruct", preload=["/lib/libtcmalloc.so"])
    assert flag_value(command.argv, "--tensor-parallel-size") == "2"
    assert flag_value(command.argv, "--gpu-memory-utilization") == "0.9"
    assert json.loads(flag_value(command.argv, "--speculative-config")) == {
        "method": "eagle", "model": "yuhuili/EAGLE-LLaMA3.1-Instruct-8B", "num_speculative_tokens": 3,
    }  # fmt: skip
    # CPU-only settings and the hub switch stay out of a GPU worker on a hub model
    assert not {"VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD", "HF_HUB_OFFLINE"} & command.env.keys()


def test_draft_model_speculation_json() -> None:
    draft = SpeculativeSpec(
        method="draft_model", model="org/draft", num_speculative_tokens=4, draft_tensor_parallel_size=1
    )
    assert speculative_config(draft) == {
        "method": "draft_model", "model": "org/draft", "num_speculative_tokens": 4, "draft_tensor_parallel_size": 1,
    }  # fmt: skip


def test_spec_rejects_speculation_a_cpu_cannot_run() -> None:
    with pytest.raises(ValidationError, match="needs a GPU worker"):
        spec(speculative={"method": "eagle", "model": "org/head"})
    with pytest.raises(ValidationError, match="needs `model`"):
        SpeculativeSpec(method="draft_model")


def test_tool_calling_settings_become_flags(tmp_path: Path) -> None:
    plain = build_launch(spec(), MODEL).argv
    for absent in ("--enable-auto-tool-choice", "--tool-call-parser", "--chat-template"):
        assert absent not in plain
    argv = build_launch(
        spec(enable_auto_tool_choice=True, tool_call_parser="xlam", chat_template="smollm2_tools"), MODEL
    ).argv
    assert "--enable-auto-tool-choice" in argv
    assert flag_value(argv, "--tool-call-parser") == "xlam"
    shipped = Path(flag_value(argv, "--chat-template"))
    assert shipped == TEMPLATES_DIR / "smollm2_tools.jinja" and shipped.is_file()  # a shipped template, by name
    own = tmp_path / "my.jinja"
    argv = build_launch(spec(chat_template=str(own)), MODEL).argv
    assert flag_value(argv, "--chat-template") == str(own)  # anything else is the operator's path
    # named tool_choice and "required" need only the parser; "auto" needs both
    assert "--enable-auto-tool-choice" not in build_launch(spec(tool_call_parser="hermes"), MODEL).argv


def test_auto_tool_choice_without_a_parser_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="tool_call_parser"):
        spec(enable_auto_tool_choice=True)


def test_cpu_env() -> None:
    command = build_launch(
        spec(kv_cache_space_gb=2.5, omp_threads_bind="0-1", env={"VLLM_LOGGING_LEVEL": "DEBUG"}),
        MODEL,
        preload=["/usr/lib/libtcmalloc_minimal.so.4", "/venv/lib/libiomp5.so"],
        inherited={"LD_PRELOAD": "/opt/libmine.so"},
    )
    env = command.env
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "3"  # vLLM parses whole GiB
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "0-1"
    assert env["LD_PRELOAD"] == "/usr/lib/libtcmalloc_minimal.so.4:/venv/lib/libiomp5.so:/opt/libmine.so"
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "VLLM_CPU_KVCACHE_SPACE=3" in command.shell()


def test_hub_model_keeps_the_hub_online() -> None:
    env = build_launch(spec(model="HuggingFaceTB/SmolLM2-135M-Instruct"), "HuggingFaceTB/SmolLM2-135M-Instruct").env
    assert "HF_HUB_OFFLINE" not in env and "LD_PRELOAD" not in env


def test_find_preload_libs(tmp_path: Path) -> None:
    (tmp_path / "bin").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libiomp5.so").touch()
    tcmalloc = tmp_path / "libtcmalloc_minimal.so.4"
    tcmalloc.touch()
    python = str(tmp_path / "bin" / "python")
    assert find_preload_libs(python, candidates=[str(tcmalloc)]) == [
        str(tcmalloc),
        str(tmp_path / "lib" / "libiomp5.so"),
    ]
    others = find_preload_libs(str(tmp_path / "other" / "bin" / "python"), candidates=[str(tmp_path / "no.so")])
    assert not any(p.endswith("libiomp5.so") for p in others)  # only a system tcmalloc may be found


@pytest.mark.engine
def test_installed_vllm_accepts_every_flag() -> None:
    """Parse a maximal CPU argv with the installed vLLM's own parser (catches flag renames on upgrade)."""
    pytest.importorskip("vllm")
    full = spec(
        dtype="bfloat16", max_model_len=2048, max_num_seqs=8, max_num_batched_tokens=1024, enable_chunked_prefill=True,
        enable_prefix_caching=False, enforce_eager=True, speculative={"method": "ngram"}, tensor_parallel_size=2,
        enable_auto_tool_choice=True, tool_call_parser="xlam", chat_template="smollm2_tools",
    )  # fmt: skip
    args = build_launch(full, MODEL).argv[3:]
    code = (
        "import sys\n"
        "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
        "from vllm.entrypoints.launchers.cli_args import make_arg_parser\n"
        "a = make_arg_parser(FlexibleArgumentParser()).parse_args(sys.argv[1:])\n"
        "print(a.structured_outputs_config, a.speculative_config, a.enforce_eager, a.enable_prefix_caching)\n"
        "print(a.enable_auto_tool_choice, a.tool_call_parser, a.chat_template)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "outlines" in done.stdout and "ngram" in done.stdout and "True False" in done.stdout
    assert f"True xlam {TEMPLATES_DIR / 'smollm2_tools.jinja'}" in done.stdout


def test_kv_events_publish_on_distinct_local_sockets_that_the_worker_binds() -> None:
    assert "--kv-events-config" not in build_launch(spec(), MODEL).argv
    configs = []
    for port in (8101, 8102):
        argv = build_launch(spec(port=port, kv_events=True), MODEL).argv
        assert "--enable-prompt-tokens-details" in argv  # the truth a prediction is checked against
        configs.append(json.loads(flag_value(argv, "--kv-events-config")))
    endpoints = [c[k] for c in configs for k in ("endpoint", "replay_endpoint")]
    assert len(set(endpoints)) == 4
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    from vllm.config.kv_events import KVEventsConfig

    for config in configs:
        parsed = KVEventsConfig(**config)  # vLLM's own config class takes it as it is
        assert parsed.enable_kv_cache_events and parsed.publisher == "zmq"
        # vLLM binds (rather than connects out) for this endpoint, so the gateway can connect to it
        assert kv_events.ZmqEventPublisher._is_bind_endpoint(parsed.endpoint)
