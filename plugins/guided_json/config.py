"""The guided_json plugin's ``config:`` section."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class GuidedJSONConfig(BaseModel):
    """Budgets for compiling constraints, what to do with an invalid answer, and the capability probe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # -- compiling (at the gateway, before anything reaches a worker) --------------------------------
    whitespace_pattern: str = Field(
        "[ ]?",
        description="whitespace allowed between JSON tokens; unbounded whitespace lets small models emit blanks"
        " until max_tokens",
    )
    max_schema_bytes: int = Field(65_536, ge=64, description="largest schema accepted (serialized JSON)")
    max_schema_nodes: int = Field(5_000, ge=10, description="schema nodes after inlining local $refs")
    max_regex_chars: int = Field(50_000, ge=100, description="longest regex a schema may turn into")
    max_states: int = Field(5_000, ge=10, description="most automaton states a constraint may compile to")
    max_choices: int = Field(256, ge=1, description="most options a choice constraint may list")
    compile_timeout_ms: float = Field(2_000, gt=0, description="CPU budget of a compile (waits: 5x, then 503)")
    cache_size: int = Field(1_024, ge=1, description="compiled constraints kept (LRU by schema hash)")
    max_compiles_per_tenant: int = Field(
        1,
        ge=1,
        description="new constraints one tenant may have compiling or queued to compile at once (with tenancy);"
        " a further new one is refused at once with 503 guided_compiler_busy, so one tenant's schemas cannot"
        " fill the one compile thread's queue ahead of others'",
    )

    # -- answers ---------------------------------------------------------------------------------------
    on_invalid: Literal["error", "retry"] = Field(
        "retry",
        description="an answer cut by the token limit when the client set none: 'retry' asks once more with"
        " retry_max_tokens (within the model's context; non-streamed requests only), 'error' returns it cut"
        " (finish_reason 'length'). A client's own max_tokens is never exceeded; an invalid complete"
        " answer is a 422 either way",
    )
    retry_max_tokens: int = Field(2_048, ge=1, description="the max_tokens of that retry (capped by the context)")

    # -- capability probe ------------------------------------------------------------------------------
    probe: bool = Field(True, description="check once per worker that it enforces a constraint")
    probe_timeout_s: float = Field(30.0, gt=0, description="time budget of one probe")
    probe_recheck_s: float = Field(300.0, gt=0, description="re-probe a worker that failed the check after this")

    @property
    def compile_budget_s(self) -> float:
        """``compile_timeout_ms`` in seconds: one compile's CPU budget. A request waits ``WALL_FACTOR``
        times it (plugins.guided_json.compile), and is told to come back after it when that runs out."""
        return self.compile_timeout_ms / 1000
